"""In-process llama.cpp for GGUF models (llama-cpp-python): `llamacpp:gemma3-270m` or `llamacpp:PATH.gguf`.

Why a second CPU backend: llama.cpp runs the GGUF's quantised weights with its own kernels, where transformers
de-quantises them to bfloat16 matrices; on the offline model it decodes 2.7x faster and writes 2.1x the tokens per
second of float32 transformers, 1.9x bfloat16's, with a slower prompt pass (benches/results/cpu_inference.json).
It is an extra built from source (`make llamacpp`). Attention models only (Gemma, Llama, Qwen, ...): recurrent and
hybrid ones cannot keep part of a sequence's state, which the kept prefix needs.

What stays the hf backend's, so that traces and training data look alike whichever backend recorded them:
- token ids: prompts are tokenised, chat-templated and decoded by the model's transformers tokenizer (for the
  offline model, its converted folder's; for another GGUF, transformers' reading of the file); llama.cpp only
  runs the forward passes;
- per-token statistics: each step's logits (one [vocab] row) give the chosen token's log-probability and the
  entropy of the model's own distribution (`step_statistics`, float32 as the hf backend's); temperature and top-p
  only choose the token;
- stops: the end-of-turn tokens of the model's generation config (and llama.cpp's end-of-generation tokens),
  the caller's stop strings, the token budget.

Concurrent calls batch as on the hf backend (tools.hf_batching: calls arriving within a few milliseconds with
the same sampling settings): a batch's prompts are llama.cpp sequences of one context decoded together, the
prefix they share (an extractor fan-out's instructions and question) read once and stored once, a finished
sequence leaving the batch at its end. The first sequence keeps what it shares with the previous batch's first
prompt. llama.cpp rounds a pass of many tokens differently from a pass of one, so a kept prefix moves the
log-probabilities that follow it (by up to ~0.15 nats on the offline model) and a near-tie may then flip, and a
prompt's tokens may differ with the batch it shares, as on the hf backend; the same lone prompt with the same seed
right after itself repeats its tokens. The sliding-window layers (Gemma 3) keep a full-size cache, so
that a prefix can be kept at all.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ermedrag.tools import settings
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.models.hf import HFChatModel
from ermedrag.tools.models.tokenizer_cache import load_tokenizer
from ermedrag.tools.models.hf_batching import (
    BatchingGenerator,
    scored,
    GenerationParams,
    Generated,
    Request,
    shared_prefix_length,
    trimmed_completion,
)

THREADS_ENV = "ERMEDRAG_LLAMACPP_THREADS"
CONTEXT_ENV = "ERMEDRAG_LLAMACPP_CTX"
DEFAULT_CONTEXT_TOKENS = settings.default(CONTEXT_ENV)  # shared by the sequences of a batch
MAX_BATCH_ENV = "ERMEDRAG_LLAMACPP_MAX_BATCH"
PREFILL_CHUNK = 256  # tokens per llama.cpp pass while reading prompts (its compute buffer grows with it)
TOP_P_CANDIDATES = 2048  # nucleus sampling sorts only the likeliest tokens, unless they hold less than top_p
INSTALL_HINT = (
    "make llamacpp (builds llama-cpp-python from source for this CPU: a C++ compiler and cmake; a plain "
    "pip install 'ermedrag[llamacpp]' may build llama.cpp's AMX kernels, which crashed on AMX Xeons)"
)


class ContextTooSmallError(ValueError):
    """A prompt plus its token budget does not fit the llama.cpp context."""


def step_statistics(logits: np.ndarray) -> tuple[float, float]:
    """(log-normaliser, entropy) of one step's next-token distribution from its raw float32 logits, in one pass
    of exp over the vocabulary: a token's log-probability is its logit minus the log-normaliser."""
    peak = float(logits.max())
    shifted = logits - np.float32(peak)
    weights = np.exp(shifted)
    total = float(weights.sum(dtype=np.float64))
    log_total = float(np.log(total))
    entropy = log_total - float(np.dot(weights, shifted)) / total  # -Σ p log p with p = weights / total
    return peak + log_total, entropy


def choose_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else a sample of the distribution at `temperature`, cut to its top-p nucleus."""
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    probabilities = np.exp(scaled - scaled.max())
    probabilities /= probabilities.sum()
    if top_p >= 1.0:
        return int(rng.choice(probabilities.size, p=probabilities))
    order = (
        np.argpartition(-probabilities, TOP_P_CANDIDATES)[:TOP_P_CANDIDATES]
        if probabilities.size > TOP_P_CANDIDATES
        else np.arange(probabilities.size)
    )
    if probabilities[order].sum() < top_p:  # a flat distribution: the nucleus reaches past the candidates
        order = np.arange(probabilities.size)
    order = order[np.argsort(-probabilities[order], kind="stable")]
    nucleus = order[: int(np.searchsorted(np.cumsum(probabilities[order]), top_p)) + 1]
    weights = probabilities[nucleus]
    return int(rng.choice(nucleus, p=weights / weights.sum()))


def common_prefix_length(cached: list[int], prompt: list[int]) -> int:
    """Tokens of the KV cache that `prompt` can keep: their common prefix, leaving the prompt at least its last
    token to evaluate (its logits choose the first new token)."""
    limit = min(len(cached), len(prompt) - 1)
    length = 0
    while length < limit and cached[length] == prompt[length]:
        length += 1
    return length


def cpu_threads() -> int:
    """llama.cpp's thread count: ERMEDRAG_LLAMACPP_THREADS, else every core this process may use
    (llama-cpp-python's own default is half of them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return settings.read(THREADS_ENV) or cores


class LlamaCppEngine:
    """A GGUF model in llama.cpp and one context of `max_batch` sequences over one KV cache (unified: a prefix
    copied to several sequences is stored once), driven through llama.cpp's C API."""

    def __init__(self, gguf: Path, threads: int, context_tokens: int, max_batch: int):
        import llama_cpp

        llama_cpp.llama_backend_init()
        model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not model:
            raise ValueError(f"llama.cpp could not load {gguf} (not a GGUF model it supports?)")
        if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
            llama_cpp.llama_model_free(model)
            raise ValueError(
                f"{gguf} is a recurrent or hybrid model: the llamacpp: backend runs attention models only "
                "(serve it with llama.cpp's server and use openai: instead)"
            )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = context_tokens, max_batch
        params.n_batch = params.n_ubatch = PREFILL_CHUNK
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified, params.swa_full = True, True  # shared prefixes; sliding-window layers keep them too
        context = llama_cpp.llama_init_from_model(model, params)
        if not context:
            llama_cpp.llama_model_free(model)
            raise ValueError(f"llama.cpp could not make a context of {context_tokens} tokens for {gguf}")
        batch = llama_cpp.llama_batch_init(PREFILL_CHUNK, 0, 1)
        # Freed with the engine; never at exit, where the batching thread may still be inside a decode.
        self._freed = weakref.finalize(self, _free, model, context, batch)
        self._freed.atexit = False
        self.context, self.batch, self.max_batch = context, batch, max_batch
        self.context_tokens = llama_cpp.llama_n_ctx(context)
        self.memory = llama_cpp.llama_get_memory(context)
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def evaluate(self, entries: list[tuple[int, int, int]], logits: bool = False) -> list[np.ndarray]:
        """Put (token, position, sequence) entries through the model, in chunks; with `logits`, the next-token
        logits after each entry (views into llama.cpp's buffer, valid until the next call)."""
        import llama_cpp

        if logits and len(entries) > PREFILL_CHUNK:
            raise ValueError(f"logits for {len(entries)} entries at once: at most {PREFILL_CHUNK}")
        for start in range(0, len(entries), PREFILL_CHUNK):
            chunk = entries[start : start + PREFILL_CHUNK]
            for i, (token, position, sequence) in enumerate(chunk):
                self.batch.token[i], self.batch.pos[i] = token, position
                self.batch.n_seq_id[i], self.batch.seq_id[i][0], self.batch.logits[i] = 1, sequence, logits
            self.batch.n_tokens = len(chunk)
            status = llama_cpp.llama_decode(self.context, self.batch)
            if status != 0:
                raise RuntimeError(
                    f"llama.cpp could not evaluate {len(chunk)} tokens (llama_decode returned {status}"
                    f"{': the KV cache is full' if status == 1 else ''})"
                )
        if not logits:
            return []
        return [
            np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.context, i), shape=(self.n_vocab,))
            for i in range(len(entries))
        ]

    def keep(self, sequence: int, length: int) -> bool:
        """Drop `sequence`'s cache past its first `length` positions (all of it with 0); False if llama.cpp could
        not."""
        import llama_cpp

        return bool(llama_cpp.llama_memory_seq_rm(self.memory, sequence, length, -1))

    def share(self, source: int, target: int) -> None:
        """Give `target` the cache of `source` (the same cells: nothing is copied)."""
        import llama_cpp

        llama_cpp.llama_memory_seq_cp(self.memory, source, target, -1, -1)


def _free(model: Any, context: Any, batch: Any) -> None:
    import llama_cpp

    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(context)
    llama_cpp.llama_model_free(model)


class LlamaCppGenerator(BatchingGenerator):
    """The hf backend's batching generator (concurrent calls gathered into batches, each call's queue wait and
    compute share) over a llama.cpp engine: a batch's rows are llama.cpp sequences decoded together, their shared
    prompt prefix evaluated once and stored once, a finished row leaving the batch at once."""

    def __init__(self, engine: LlamaCppEngine, tokenizer: Any, eos_ids: set[int]):
        self.engine, self.eos_ids = engine, eos_ids
        self._cached: list[int] = []  # the tokens whose keys and values sequence 0 holds
        super().__init__(tokenizer, model=engine, device="cpu", max_batch=engine.max_batch)

    def forget_cache(self) -> None:
        """Read the next prompt whole (a benchmark's timed call, a test's reference)."""
        self._cached = []

    def generate_many(self, prompts: list[list[int]], params: GenerationParams) -> list[Generated]:
        for prompt in prompts:  # before queueing: the caller gets the error, not its batch
            if len(prompt) + params.max_new_tokens > self.engine.context_tokens:
                raise ContextTooSmallError(
                    f"prompt of {len(prompt)} tokens + {params.max_new_tokens} new tokens exceeds the llama.cpp "
                    f"context of {self.engine.context_tokens} tokens: set {CONTEXT_ENV} higher, or shorten the prompt"
                )
        return super().generate_many(prompts, params)

    def _generate_batch(self, batch: list[Request]) -> list[Generated]:
        rows: list[Generated] = []
        for group in self._fitting_groups(batch):
            started = time.perf_counter()
            try:
                decoded, prefill_end, first_scores = self._decode([r.prompt_ids for r in group], group[0].params)
            except BaseException:
                self._cached = []  # what sequence 0 holds is unknown now: the next batch reads its prompt whole
                raise
            generated = [trimmed_completion(*row, self.tokenizer, list(self.eos_ids)) for row in decoded]
            for row, first in zip(generated, first_scores):
                row.first_scores = scored(group[0].params.scored_ids, first)
            rows += self._timed(group, generated, started, prefill_end)
        return rows

    def _fitting_groups(self, batch: list[Request]) -> list[list[Request]]:
        """The batch in groups whose prompts and token budgets fit the context together (in order)."""
        groups: list[list[Request]] = [[]]
        used = 0
        for request in batch:
            need = len(request.prompt_ids) + request.params.max_new_tokens
            if groups[-1] and used + need > self.engine.context_tokens:
                groups.append([])
                used = 0
            groups[-1].append(request)
            used += need
        return groups

    def _decode(
        self, prompts: list[list[int]], params: GenerationParams
    ) -> tuple[list[tuple[list[int], list[float], list[float]]], float, list[list[float] | None]]:
        """Each prompt's new tokens with their log-probabilities and entropies, when the prompts were read, and each
        prompt's first-step log-probabilities of `params.scored_ids`.

        Sequence 0 keeps what it shares with the previous batch's first prompt; the prefix every prompt shares is
        evaluated on it and shared with the others; each prompt's rest follows on its own sequence. Every prompt's
        last token goes in the first decoding step, so a lone prompt's first logits come from the same
        single-token pass whatever was kept (a batched pass rounds differently): a seed repeats its sample."""
        engine = self.engine
        # Any common prefix is shared (the hf backend's MIN_SHARED_PREFIX weighs padding, which sequences have not).
        shared = shared_prefix_length(prompts) if len(prompts) > 1 else len(prompts[0]) - 1
        kept = min(common_prefix_length(self._cached, prompts[0]), shared)
        for sequence in range(1, engine.max_batch):
            engine.keep(sequence, 0)
        if not engine.keep(0, kept):
            engine.keep(0, 0)
            kept = 0
        self._cached = prompts[0][:kept]
        engine.evaluate([(prompts[0][position], position, 0) for position in range(kept, shared)])
        for sequence in range(1, len(prompts)):
            engine.share(0, sequence)
        engine.evaluate(
            [
                (prompt[position], position, sequence)
                for sequence, prompt in enumerate(prompts)
                for position in range(shared, len(prompt) - 1)
            ]
        )
        self._cached = prompts[0][:-1]
        rng = np.random.default_rng(params.seed)
        longest_stop = max((len(s.encode()) for s in params.stop), default=0)  # bytes: a token holds at least one
        rows: list[tuple[list[int], list[float], list[float]]] = [([], [], []) for _ in prompts]
        first_scores: list[list[float] | None] = [None] * len(prompts)
        steps = [(prompt[-1], len(prompt) - 1, sequence) for sequence, prompt in enumerate(prompts)]
        prefill_end = None
        while steps:
            logits_rows = engine.evaluate(steps, logits=True)
            prefill_end = prefill_end or time.perf_counter()
            next_steps = []
            for (_, position, sequence), logits in zip(steps, logits_rows):
                ids, logprobs, entropies = rows[sequence]
                log_normaliser, entropy = step_statistics(logits)
                if not ids and params.scored_ids:
                    first_scores[sequence] = [float(logits[t]) - log_normaliser for t in params.scored_ids]
                token = choose_token(logits, params.temperature, params.top_p, rng)
                ids.append(token)
                logprobs.append(float(logits[token]) - log_normaliser)
                entropies.append(entropy)
                done = (
                    token in self.eos_ids
                    or len(ids) >= params.max_new_tokens
                    or self._stopped(ids, params.stop, longest_stop)
                )
                if not done:
                    next_steps.append((token, position + 1, sequence))
            if steps[0][2] == 0:  # sequence 0 took its step: its cache holds that token
                self._cached.append(steps[0][0])
            steps = next_steps
        return rows, prefill_end or time.perf_counter(), first_scores

    def _stopped(self, ids: list[int], stop: tuple[str, ...], longest_stop: int) -> bool:
        """Whether a stop string ends the text so far. Only the tail is decoded, as many tokens as the longest
        stop string has bytes and a margin: a stop it missed would cost time, never text, since the reply is cut
        at its first stop string afterwards."""
        if not stop:
            return False
        tail = self.tokenizer.decode(ids[-(longest_stop + 4) :], skip_special_tokens=True)
        return any(s and s in tail for s in stop)


def gguf_and_tokenizer_source(name: str) -> tuple[Path, str, dict[str, Any]]:
    """The GGUF file of `name` (a packaged offline model or a .gguf path) and where its transformers tokenizer
    loads from (a folder, with `gguf_file` for a GGUF's own)."""
    from ermedrag.tools.models.offline import OFFLINE_MODELS, offline_gguf, offline_tokenizer_dir

    if name in OFFLINE_MODELS:
        return offline_gguf(name), str(offline_tokenizer_dir(name)), {}
    path = Path(name).expanduser()
    if path.suffix != ".gguf":
        raise ValueError(f"llamacpp: model {name!r} must be a .gguf file or one of the offline models {OFFLINE_MODELS}")
    if not path.is_file():
        raise FileNotFoundError(f"llamacpp: model file {path} does not exist")
    return path, str(path.parent), {"gguf_file": path.name}


@shared_resource(maxsize=2)
def llamacpp_generator(name: str) -> LlamaCppGenerator:
    """Load the GGUF model `name` into llama.cpp (once per process), with its transformers tokenizer."""
    gguf, tokenizer_source, tokenizer_kwargs = gguf_and_tokenizer_source(name)  # a wrong name fails first
    if importlib.util.find_spec("llama_cpp") is None:
        raise ImportError(f"the llamacpp: backend needs llama-cpp-python: {INSTALL_HINT}")
    load_llama_cpp_with_passive_threads()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load log, through its logger
    threads = cpu_threads()
    context = settings.read(CONTEXT_ENV)
    max_batch = settings.read(MAX_BATCH_ENV)
    print(
        f"loading model llamacpp:{name} ({gguf}) on cpu ({threads} llama.cpp threads, context {context}, "
        f"batches of {max_batch}) …",
        file=sys.stderr,
        flush=True,
    )
    engine = LlamaCppEngine(gguf, threads, context, max_batch)
    tokenizer = load_tokenizer(tokenizer_source, **tokenizer_kwargs)
    return LlamaCppGenerator(engine, tokenizer, end_of_generation_ids(engine, tokenizer_source, tokenizer_kwargs))


def load_llama_cpp_with_passive_threads() -> None:
    """Import llama_cpp with OMP_WAIT_POLICY=PASSIVE unless the user set it, then restore the environment.

    llama.cpp's OpenMP threads spin between steps by default; beside other busy threads (another process, the
    encoder) that made decoding 4x slower here. OpenMP reads the setting once, when its library loads with
    llama.cpp's, so it is set only for that import: left in the environment, child processes' torch threads
    waited passively too and generated 1.6x slower."""
    passive = "llama_cpp" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ  # else nothing to decide
    if passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        importlib.import_module("llama_cpp")
    finally:
        if passive:
            del os.environ["OMP_WAIT_POLICY"]


def end_of_generation_ids(engine: LlamaCppEngine, source: str, tokenizer_kwargs: dict[str, Any]) -> set[int]:
    """The tokens that end a reply: the generation config's end-of-sequence ids (<end_of_turn> for the offline
    model) and the vocabulary's end-of-sequence and end-of-turn tokens."""
    import llama_cpp
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(source, **tokenizer_kwargs).eos_token_id
    except (OSError, ValueError):  # a GGUF or folder without a generation config
        configured = None
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    ids.update(t for t in (llama_cpp.llama_vocab_eos(engine.vocab), llama_cpp.llama_vocab_eot(engine.vocab)) if t >= 0)
    return ids


class LlamaCppChatModel(HFChatModel):
    """A GGUF model run by llama.cpp in-process (tools.llamacpp), text only, with the hf backend's tokenizer,
    per-token statistics and metadata; `model_path` is an offline model's name or a .gguf file."""

    provider: ClassVar[str] = "llamacpp"

    @property
    def _llm_type(self) -> str:
        return "ermedrag-llamacpp"

    def _is_vision_model(self) -> bool:
        return False

    def _text_generator(self) -> Any:
        return llamacpp_generator(self.model_path)
