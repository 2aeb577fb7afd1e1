"""Micro-batching for an in-process transformers model.

Graph branches call the model from several threads at once (the extractor fan-out). Running those as
separate `generate()` calls makes them fight over the same cores; gathering requests that arrive within a
few milliseconds into one left-padded batch makes them share every decoding step instead.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerationParams:
    """Requests batch together only when these are equal."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Generated:
    token_ids: list[int]
    logprobs: list[dict[str, Any]]
    hit_eos: bool


@dataclass
class _Request:
    prompt_ids: list[int]
    params: GenerationParams
    future: Future = field(default_factory=Future)


class BatchingGenerator:
    """Serialises access to one model; each `generate` call may share a batch with concurrent calls."""

    def __init__(self, tokenizer: Any, model: Any, device: str, max_batch: int = 8, gather_s: float = 0.03):
        self.tokenizer, self.model, self.device = tokenizer, model, device
        self.max_batch, self.gather_s = max_batch, gather_s
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self.batch_sizes: list[int] = []  # observable: how many requests each generate() served
        threading.Thread(target=self._serve, name="hf-batcher", daemon=True).start()

    def generate(self, prompt_ids: list[int], params: GenerationParams) -> Generated:
        request = _Request(prompt_ids, params)
        with self._cond:
            self._pending.append(request)
            self._cond.notify_all()
        return request.future.result()

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

    def _next_batch(self) -> list[_Request]:
        with self._cond:
            while not self._pending:
                self._cond.wait()
            deadline = time.monotonic() + self.gather_s
            while len(self._pending) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            key = self._pending[0].params
            batch = [r for r in self._pending if r.params == key][: self.max_batch]
            self._pending = [r for r in self._pending if r not in batch]
        return batch

    def _generate_batch(self, batch: list[_Request]) -> list[Generated]:
        import torch

        params = batch[0].params
        pad = self.tokenizer.pad_token_id
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        attention = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        gen: dict[str, Any] = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.temperature > 0,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=pad,
        )
        if params.temperature > 0:
            gen.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        if params.stop:
            gen.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention.to(self.device), **gen)
        self.batch_sizes.append(len(batch))
        new = out.sequences[:, width:]
        # Per-step statistics, one step at a time: stacking [batch, steps, vocab] logits costs gigabytes.
        chosen, entropy = [], []
        for step, logits in enumerate(out.logits):
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen.append(logp.gather(1, new[:, step:step + 1]).squeeze(1))
            entropy.append(-(logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(-1))
        chosen_t = torch.stack(chosen, dim=1).tolist() if chosen else [[] for _ in batch]
        entropy_t = torch.stack(entropy, dim=1).tolist() if entropy else [[] for _ in batch]
        return [self._row(new[b].tolist(), chosen_t[b], entropy_t[b]) for b in range(len(batch))]

    def _row(self, ids: list[int], logprobs: list[float], entropies: list[float]) -> Generated:
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        end = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), None)
        hit_eos = end is not None
        if end is None:  # finished by a stop string or the budget: rows that stopped early are padded
            end = len(ids)
            while end > 0 and ids[end - 1] == self.tokenizer.pad_token_id:
                end -= 1
        return Generated(
            token_ids=ids[:end],
            logprobs=[{"token": self.tokenizer.decode([t]), "logprob": lp, "entropy": h}
                      for t, lp, h in zip(ids[:end], logprobs, entropies)],
            hit_eos=hit_eos,
        )
