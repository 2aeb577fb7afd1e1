"""Micro-batching for an in-process transformers model.

Graph branches call the model from several threads at once (the extractor fan-out). Running those as
separate `generate()` calls makes them fight over the same cores; gathering requests that arrive within a
few milliseconds into one left-padded batch makes them share every decoding step instead.

Memory: the per-token statistics (the chosen token's log-probability and the entropy of the next-token
distribution) are reduced from each step's [batch, vocab] logits while generating (`StepStatistics`), so at
most one step's log-softmax is alive at a time. Asking `generate` for the logits instead kept a
[batch, vocab] float32 tensor per step: ~1 MB per row per token with Gemma's 262k vocabulary, ~1.4 GB for a
batch of 8 writing 180 tokens.

Shared prompt prefix: the rows of a batch often start alike (an extractor fan-out: the same instructions and
question, then each its own snippet). Their common prefix goes through the model once; its KV cache is copied to
every row and only each row's rest is computed (`shared_prefix_length`, `padded_rows`). Same tokens and
statistics as computing every row whole, exactly in float32 (tests/tools/models/test_hf_backend.py); in bfloat16 within its
rounding, as any change of batch composition is. `ERMEDRAG_HF_SHARE_PREFIX=0` turns it off.

Timing: each request reports `queue_s` (from `generate` until its batch starts computing) and `compute_s`,
its share of the batch's compute time (`apportion_compute`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class GenerationParams:
    """Requests batch together only when these are equal."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    scored_ids: tuple[int, ...] = ()  # tokens whose first-step log-probabilities come back (`Generated.first_scores`)


@dataclass
class Generated:
    token_ids: list[int]
    logprobs: list[dict[str, Any]]  # per token: {"token", "logprob", "entropy"} (OpenAI's logprobs.content shape)
    hit_eos: bool
    queue_s: float | None = None  # waiting for the model: from `generate` until this request's batch started
    compute_s: float | None = None  # this request's share of its batch's compute time
    batch_size: int = 1
    first_scores: dict[int, float] | None = None  # log-probability of each `scored_ids` token at the first step


@dataclass(eq=False)  # one call is one request: `in` compares identity, not prompt lists
class Request:
    """One call waiting for (or in) a batch; its caller waits on `future`."""

    prompt_ids: list[int]
    params: GenerationParams
    submitted_at: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)


def apportion_compute(
    prefill_s: float, decode_s: float, prompt_tokens: Sequence[int], new_tokens: Sequence[int]
) -> list[float]:
    """Each request's share of a batch's compute time; the shares add up to prefill_s + decode_s.

    The prompt pass is shared by prompt length and the decoding steps by generated tokens: a request that
    wrote 200 tokens kept the batch stepping for the one that wrote 5, so it carries most of the steps (an
    equal split would bill short answers for long ones). A part with no tokens at all is split equally.
    """
    n = len(prompt_tokens)
    if n == 0:
        return []

    def shares(total: float, weights: Sequence[int]) -> list[float]:
        weight_sum = sum(weights)
        return [total * w / weight_sum for w in weights] if weight_sum > 0 else [total / n] * n

    return [p + d for p, d in zip(shares(prefill_s, prompt_tokens), shares(decode_s, new_tokens))]


class StepStatistics:
    """A logits processor that reduces each decoding step to [batch] numbers and passes the scores on unchanged.

    At step t it sees the scores that choose token t, but token t itself is only known once it is chosen
    (after sampling), i.e. at step t + 1 as the last column of `input_ids`, or at the end in the output.
    So it keeps the current step's log-softmax (one [batch, vocab] row set) until then, and nothing longer.

    The scores are the model's raw logits, as before, when the model's generation config adds no logits
    processors of its own (repetition penalty, bad words, ...): `generate` runs those before custom ones.
    Temperature and top-p run after, so the statistics are those of the model's own distribution.
    """

    def __init__(self, scored_ids: tuple[int, ...] = ()) -> None:
        self.scored_ids = scored_ids
        self.first_scores: list[list[float]] | None = None  # [batch][len(scored_ids)], from the first step
        self.chosen: list[Any] = []  # [batch] tensors: log-probability of the chosen token, per step
        self.entropy: list[Any] = []  # [batch] tensors: entropy of the next-token distribution, per step
        self.first_step_at: float | None = None  # when the prompt pass ended (the first step's scores arrived)
        self._current: Any = None  # the current step's log-softmax, [batch, vocab]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        first = self._current is None
        if first:
            self.first_step_at = time.perf_counter()
        else:
            self.chosen.append(self._current.gather(1, input_ids[:, -1:]).squeeze(1))
        logp = torch.log_softmax(scores.float(), dim=-1)
        if first and self.scored_ids:
            self.first_scores = logp[:, list(self.scored_ids)].tolist()
        self.entropy.append(-(logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(-1))
        self._current = logp
        return scores

    def finish(self, new_ids: Any) -> tuple[list[list[float]], list[list[float]]]:
        """Per row: (chosen-token log-probs, entropies) for the `new_ids` [batch, steps] that generate returned.

        Steps that generate ran past the end and then undid (its deferred stop check, on Apple GPUs) are dropped."""
        import torch

        steps = new_ids.shape[1]
        if self._current is not None and len(self.chosen) < steps:
            at = len(self.chosen)
            self.chosen.append(self._current.gather(1, new_ids[:, at : at + 1]).squeeze(1))
        self._current = None
        if steps == 0 or not self.chosen:
            return [[] for _ in range(new_ids.shape[0])], [[] for _ in range(new_ids.shape[0])]
        chosen = torch.stack(self.chosen[:steps], dim=1).tolist()
        entropy = torch.stack(self.entropy[:steps], dim=1).tolist()
        return chosen, entropy


def generation_kwargs(params: Any, stats: StepStatistics, tokenizer: Any, pad_token_id: int | None) -> dict[str, Any]:
    """`generate`'s arguments for one call's sampling parameters, with `stats` reducing each step as it goes (and
    the seed set, when given): only the token ids come back, no per-step logits or scores, no KV cache kept."""
    import torch
    from transformers import LogitsProcessorList

    gen: dict[str, Any] = dict(
        max_new_tokens=params.max_new_tokens,
        do_sample=params.temperature > 0,
        logits_processor=LogitsProcessorList([stats]),
        return_dict_in_generate=False,
        pad_token_id=pad_token_id,
    )
    if params.temperature > 0:
        gen.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
    if params.stop:
        gen.update(stop_strings=list(params.stop), tokenizer=tokenizer)
    if params.seed is not None:
        torch.manual_seed(params.seed)
    return gen


MIN_SHARED_PREFIX = 32  # tokens: below this a separate prompt pass costs more than it saves


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least its last token (`generate` needs one new input
    token per row to start from)."""
    shortest = min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


def padded_rows(prompts: Sequence[Sequence[int]], shared: int, pad: int) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and attention masks of one batch. Without a shared prefix the rows are left-padded. With one
    (cached once for all rows) the padding goes between the prefix and each row's own rest, so the prefix's
    positions are the same in every row; positions follow the mask, as `generate` derives them."""
    width = max(len(p) for p in prompts) - shared
    ids, masks = [], []
    for prompt in prompts:
        gap = width - (len(prompt) - shared)
        ids.append([*prompt[:shared], *[pad] * gap, *prompt[shared:]])
        masks.append([1] * shared + [0] * gap + [1] * (len(prompt) - shared))
    return ids, masks


class BatchingGenerator:
    """Serialises access to one model; each `generate` call may share a batch with concurrent calls."""

    def __init__(
        self,
        tokenizer: Any,
        model: Any,
        device: str,
        max_batch: int = 8,
        gather_s: float = 0.03,
        share_prefix: bool = True,
    ):
        self.tokenizer, self.model, self.device = tokenizer, model, device
        self.max_batch, self.gather_s, self.share_prefix = max_batch, gather_s, share_prefix
        self._pending: list[Request] = []
        self._cond = threading.Condition()
        self.batch_sizes: list[int] = []  # observable: how many requests each generate() served
        threading.Thread(target=self._serve, name="hf-batcher", daemon=True).start()

    def generate(self, prompt_ids: list[int], params: GenerationParams) -> Generated:
        return self.generate_many([prompt_ids], params)[0]

    def generate_many(self, prompts: list[list[int]], params: GenerationParams) -> list[Generated]:
        """Submit several prompts at once: up to `max_batch` of them share one batch (when nothing else waits)."""
        requests = [Request(list(ids), params) for ids in prompts]
        with self._cond:
            self._pending.extend(requests)
            self._cond.notify_all()
        return [r.future.result() for r in requests]

    def _serve(self) -> None:
        while True:
            batch = self._next_batch()
            try:
                results = self._generate_batch(batch)
            except BaseException as err:  # noqa: BLE001 - the caller's thread re-raises it
                for request in batch:
                    request.future.set_exception(err)
                continue
            for request, result in zip(batch, results):
                request.future.set_result(result)

    def _next_batch(self) -> list[Request]:
        with self._cond:
            while not self._pending:
                self._cond.wait()
            deadline = time.monotonic() + self.gather_s
            while len(self._pending) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            key = self._pending[0].params
            batch = [r for r in self._pending if r.params == key][: self.max_batch]
            self._pending = [r for r in self._pending if r not in batch]
        # In the order of their prompts, not of their arrival: which thread of a fan-out comes first varies from run
        # to run, and a row's place in a batch changes how its numbers round, so the same calls decoded differently.
        return sorted(batch, key=lambda request: request.prompt_ids)

    def _generate_batch(self, batch: list[Request]) -> list[Generated]:
        import torch

        started = time.perf_counter()
        params = batch[0].params
        pad = self.tokenizer.pad_token_id
        prompts = [r.prompt_ids for r in batch]
        shared = shared_prefix_length(prompts) if self.share_prefix and len(batch) > 1 else 0
        if shared < MIN_SHARED_PREFIX:
            shared = 0
        rows_ids, rows_mask = padded_rows(prompts, shared, pad)
        width = len(rows_ids[0])
        stats = StepStatistics(params.scored_ids)
        gen = generation_kwargs(params, stats, self.tokenizer, pad)
        with torch.inference_mode():
            if shared:  # one prompt pass for what every row starts with, its cache copied to every row
                # Only the cache is wanted: logits_to_keep=1 spares a [prefix, vocabulary] product (262k for Gemma).
                cache = self.model(
                    input_ids=torch.tensor([prompts[0][:shared]], device=self.device), use_cache=True, logits_to_keep=1
                ).cache
                cache.batch_repeat_interleave(len(batch))
                gen["cache"] = cache
            sequences = self.model.generate(
                input_ids=torch.tensor(rows_ids, device=self.device),
                attention_mask=torch.tensor(rows_mask, device=self.device),
                **gen,
            )
            new = sequences[:, width:]
            chosen, entropy = stats.finish(new)
        rows = [self._row(new[b].tolist(), chosen[b], entropy[b]) for b in range(len(batch))]
        for b, row in enumerate(rows):
            row.first_scores = scored(params.scored_ids, stats.first_scores[b] if stats.first_scores else None)
        return self._timed(batch, rows, started, stats.first_step_at)

    def _timed(
        self, batch: list[Request], rows: list[Generated], started: float, prefill_end: float | None
    ) -> list[Generated]:
        """The batch's rows with each request's queue wait and compute share (`apportion_compute`)."""
        finished = time.perf_counter()
        prefill_end = prefill_end or finished
        self.batch_sizes.append(len(batch))
        shares = apportion_compute(
            prefill_end - started,
            finished - prefill_end,
            [len(r.prompt_ids) for r in batch],
            [len(row.token_ids) for row in rows],
        )
        for request, row, share in zip(batch, rows, shares):
            row.queue_s, row.compute_s, row.batch_size = started - request.submitted_at, share, len(batch)
        return rows

    def _row(self, ids: list[int], logprobs: list[float], entropies: list[float]) -> Generated:
        return trimmed_completion(ids, logprobs, entropies, self.tokenizer, self.model.generation_config.eos_token_id)


def scored(ids: tuple[int, ...], logprobs: Sequence[float] | None) -> dict[int, float] | None:
    """`Generated.first_scores` from the first step's log-probabilities of `ids` (None when none were asked)."""
    return dict(zip(ids, (float(lp) for lp in logprobs))) if ids and logprobs is not None else None


def trimmed_completion(
    ids: list[int], logprobs: list[float], entropies: list[float], tokenizer: Any, eos_token_id: int | list[int] | None
) -> Generated:
    """One row of `generate`'s new tokens as a completion: up to and including its first end-of-sequence token,
    else without the padding a row that stopped early (stop string, budget) got from the longer rows of its
    batch; each kept token with its log-probability and the entropy of its step."""
    eos_ids = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    end = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), None)
    hit_eos = end is not None
    if end is None:
        end = len(ids)
        while end > 0 and ids[end - 1] == tokenizer.pad_token_id:
            end -= 1
    return Generated(
        token_ids=ids[:end],
        logprobs=[
            {"token": tokenizer.decode([t]), "logprob": lp, "entropy": h}
            for t, lp, h in zip(ids[:end], logprobs, entropies)
        ],
        hit_eos=hit_eos,
    )
