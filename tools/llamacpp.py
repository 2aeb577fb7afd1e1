"""In-process llama.cpp for GGUF models (llama-cpp-python): `llamacpp:gemma3-270m` or `llamacpp:PATH.gguf`.

Why a second CPU backend: llama.cpp runs the GGUF's quantised weights with its own kernels, where transformers
de-quantises them to bfloat16 matrices; on the offline model single-stream decoding is several times faster
(benches/results/cpu_inference.json). It is an extra (`pip install 'ermedrag[llamacpp]'`, built from source).

What stays the hf backend's, so that traces and training data look alike whichever backend recorded them:
- token ids: prompts are tokenised, chat-templated and decoded by the model's transformers tokenizer (for the
  offline model, its converted folder's; for another GGUF, transformers' reading of the file); llama.cpp only
  runs the forward passes;
- per-token statistics: each step's logits (one [vocab] row) give the chosen token's log-probability and the
  entropy of the model's own distribution (`step_statistics`, float32 as the hf backend's); temperature and top-p
  only choose the token;
- stops: the end-of-turn tokens of the model's generation config (and llama.cpp's end-of-generation tokens),
  the caller's stop strings, the token budget.

One context serves one call at a time (a lock). A call keeps the KV cache of the longest prefix it shares with
the previous call, so an extractor fan-out reads its instructions and question once; the sliding-window
layers (Gemma 3) keep a full-size cache so that a prefix can be kept at all. The same prompt with the same seed
gives the same tokens whatever the previous call was; after a kept prefix the log-probabilities may differ in
the last digits (llama.cpp rounds a batched pass differently from single-token ones).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ermedrag.tools.cache import shared_resource
from ermedrag.tools.hf_batching import GenerationParams, Generated, trimmed_completion

THREADS_ENV = "ERMEDRAG_LLAMACPP_THREADS"
CONTEXT_ENV = "ERMEDRAG_LLAMACPP_CTX"
DEFAULT_CONTEXT_TOKENS = 8192
TOP_P_CANDIDATES = 2048  # nucleus sampling sorts only the likeliest tokens, unless they hold less than top_p
INSTALL_HINT = "pip install 'ermedrag[llamacpp]' (builds llama.cpp from source: a C++ compiler and cmake)"


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
    probabilities = np.exp(scaled - np.logaddexp.reduce(scaled))
    if top_p >= 1.0:
        return int(rng.choice(probabilities.size, p=probabilities / probabilities.sum()))
    order = np.argpartition(-probabilities, TOP_P_CANDIDATES)[:TOP_P_CANDIDATES] \
        if probabilities.size > TOP_P_CANDIDATES else np.arange(probabilities.size)
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
    configured = os.environ.get(THREADS_ENV)
    if configured:
        return int(configured)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LlamaCppGenerator:
    """One llama.cpp context and its tokenizer; `generate` has the hf batching generator's signature."""

    def __init__(self, llama: Any, tokenizer: Any, eos_ids: set[int]):
        self.llama, self.tokenizer, self.eos_ids = llama, tokenizer, eos_ids
        self.n_vocab = llama.n_vocab()
        self._cached: list[int] = []  # the tokens whose keys and values the context holds
        self._lock = threading.Lock()

    def generate(self, prompt_ids: list[int], params: GenerationParams) -> Generated:
        submitted = time.perf_counter()
        budget = self.llama.n_ctx()
        if len(prompt_ids) + params.max_new_tokens > budget:
            raise ContextTooSmallError(
                f"prompt of {len(prompt_ids)} tokens + {params.max_new_tokens} new tokens exceeds the llama.cpp "
                f"context of {budget} tokens: set {CONTEXT_ENV} higher, or shorten the prompt")
        with self._lock:
            started = time.perf_counter()
            ids, logprobs, entropies = self._decode(list(prompt_ids), params)
            finished = time.perf_counter()
        generated = trimmed_completion(ids, logprobs, entropies, self.tokenizer, list(self.eos_ids))
        generated.queue_s, generated.compute_s = started - submitted, finished - started
        return generated

    def _decode(self, prompt: list[int], params: GenerationParams) -> tuple[list[int], list[float], list[float]]:
        kept = common_prefix_length(self._cached, prompt)
        self.llama.n_tokens = kept  # `eval` drops the cache past n_tokens before it evaluates
        self._cached = prompt[:kept]
        # The last prompt token alone: its logits then come from the same single-token pass whether or not the rest
        # was kept from the previous call (a batched pass rounds differently), so a seed repeats its sample.
        if len(prompt) - 1 > kept:
            self._eval(prompt[kept:-1])
        self._eval(prompt[-1:])
        rng = np.random.default_rng(params.seed)
        longest_stop = max((len(s) for s in params.stop), default=0)
        ids: list[int] = []
        logprobs: list[float] = []
        entropies: list[float] = []
        while len(ids) < params.max_new_tokens:
            logits = self._last_logits()
            log_normaliser, entropy = step_statistics(logits)
            token = choose_token(logits, params.temperature, params.top_p, rng)
            ids.append(token)
            logprobs.append(float(logits[token]) - log_normaliser)
            entropies.append(entropy)
            if token in self.eos_ids or self._stopped(ids, params.stop, longest_stop):
                break
            if len(ids) < params.max_new_tokens:
                self._eval([token])
        return ids, logprobs, entropies

    def _eval(self, tokens: list[int]) -> None:
        self.llama.eval(tokens)
        self._cached.extend(tokens)

    def _last_logits(self) -> np.ndarray:
        import llama_cpp

        pointer = llama_cpp.llama_get_logits_ith(self.llama.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def _stopped(self, ids: list[int], stop: tuple[str, ...], longest_stop: int) -> bool:
        """Whether a stop string ends the text so far. Only the tail is decoded (a token is at least one
        character, apart from byte pieces, hence the margin): a stop it missed would cost time, never text,
        since the reply is cut at its first stop string afterwards."""
        if not stop:
            return False
        tail = self.tokenizer.decode(ids[-(longest_stop + 4):], skip_special_tokens=True)
        return any(s and s in tail for s in stop)


def gguf_and_tokenizer_source(name: str) -> tuple[Path, str, dict[str, Any]]:
    """The GGUF file of `name` (a packaged offline model or a .gguf path) and where its transformers tokenizer
    loads from (a folder, with `gguf_file` for a GGUF's own)."""
    from ermedrag.tools.offline_model import OFFLINE_MODELS, offline_gguf, offline_model_dir

    if name in OFFLINE_MODELS:
        return offline_gguf(name), str(offline_model_dir(name)), {}
    path = Path(name).expanduser()
    if path.suffix != ".gguf":
        raise ValueError(f"llamacpp: model {name!r} must be a .gguf file or one of the offline models {OFFLINE_MODELS}")
    if not path.is_file():
        raise FileNotFoundError(f"llamacpp: model file {path} does not exist")
    return path, str(path.parent), {"gguf_file": path.name}


@shared_resource(maxsize=2)
def llamacpp_generator(name: str) -> LlamaCppGenerator:
    """Load the GGUF model `name` into one llama.cpp context (once per process), with its tokenizer."""
    gguf, tokenizer_source, tokenizer_kwargs = gguf_and_tokenizer_source(name)  # a wrong name fails first
    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise ImportError(f"the llamacpp: backend needs llama-cpp-python: {INSTALL_HINT}") from err
    from transformers import AutoTokenizer, GenerationConfig

    threads = cpu_threads()
    context = int(os.environ.get(CONTEXT_ENV, DEFAULT_CONTEXT_TOKENS))
    print(f"loading model llamacpp:{name} ({gguf}) on cpu ({threads} llama.cpp threads, context {context}) …",
          file=sys.stderr, flush=True)
    llama = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                  swa_full=True, logits_all=False, verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **tokenizer_kwargs)
    return LlamaCppGenerator(llama, tokenizer, end_of_generation_ids(llama, tokenizer_source, tokenizer_kwargs,
                                                                     GenerationConfig))


def end_of_generation_ids(llama: Any, source: str, tokenizer_kwargs: dict[str, Any], generation_config: Any) -> set[int]:
    """The tokens that end a reply: the generation config's end-of-sequence ids (<end_of_turn> for the offline
    model) and the ones llama.cpp's vocabulary marks as end of generation."""
    import llama_cpp

    try:
        configured = generation_config.from_pretrained(source, **tokenizer_kwargs).eos_token_id
    except (OSError, ValueError):  # a GGUF or folder without a generation config
        configured = None
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    ids.update(t for t in (llama_cpp.llama_vocab_eos(vocab), llama_cpp.llama_vocab_eot(vocab)) if t >= 0)
    return ids
