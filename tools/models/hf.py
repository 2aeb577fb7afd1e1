"""The hf backend: a transformers causal LM (or vision-language model) in process, on CPU or GPU.

`hf:ID_OR_PATH` (a hub id, a folder, or a .gguf file) and `offline:NAME` (the packaged model's converted folder).
Concurrent calls share batches (`tools.models.hf_batching`); per generated token the reply reports its
log-probability and the entropy of the full next-token distribution (`response_metadata["logprobs"]`) and splits
each call's time into `queue_s` and `compute_s`. A model whose config has a vision tower runs through its
AutoProcessor, one call at a time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import time
from pathlib import Path
from dataclasses import replace
from typing import Any, ClassVar, Iterator, Sequence

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict, Field

from ermedrag.agents.base import message_images, to_chat
from ermedrag.tools.cache import shared_resource
from ermedrag.tools import settings
from ermedrag.tools.images import as_pil, images_in
from ermedrag.tools.machine import checkpoint_dtype, inference_dtype
from ermedrag.agents.base import continuation
from ermedrag.tools.models.base import cut_at_stop, hf_accepts_images, require_image_support
from ermedrag.tools.models.tokenizer_cache import load_tokenizer
from ermedrag.tools.models.hf_batching import (
    BatchingGenerator,
    GenerationParams,
    Generated,
    StepStatistics,
    generation_kwargs,
    trimmed_completion,
)


def _model_label(model_path: str) -> str:
    """How the user named the model: `offline:NAME` for the packaged model's converted folder, else `hf:PATH`."""
    from ermedrag.tools.models.offline import OFFLINE_MODELS
    from ermedrag.tools.settings import cache_home

    path = Path(model_path)
    if path.parent == cache_home() / "models" and path.name in OFFLINE_MODELS:
        return f"offline:{path.name}"
    return f"hf:{model_path}"


_QUIET = threading.Lock()
_quiet_depth = 0
_was_enabled = True


@contextlib.contextmanager
def quiet_model_loading(gguf_file: bool = False) -> Iterator[None]:
    """No progress bars while weights load: transformers' "Loading weights" bar and the GGUF de-quantising
    one would interleave with the eval's own progress bar. Loads may run at once in several threads (a run's setup
    loads its models and its encoder in parallel): the bars stay off until the last of them ends, then the setting
    before the first is restored."""
    from transformers.utils import logging as hf_logging

    global _quiet_depth, _was_enabled
    with _QUIET:
        if _quiet_depth == 0:
            _was_enabled = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
        _quiet_depth += 1
    gguf, gguf_tqdm = None, None
    if gguf_file:  # its bar comes straight from tqdm, not through transformers' switch
        gguf = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        gguf_tqdm = gguf.__dict__.get("tqdm")
        if gguf_tqdm is not None:
            gguf.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf is not None and gguf_tqdm is not None:
            gguf.tqdm = gguf_tqdm
        with _QUIET:
            _quiet_depth -= 1
            if _quiet_depth == 0 and _was_enabled:
                hf_logging.enable_progress_bar()


MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def return_large_blocks_to_the_os() -> bool:
    """Make glibc serve every allocation of 1 MiB or more with its own mapping, returned to the OS when freed.

    By default glibc raises that threshold as large blocks are freed, and then keeps them in per-thread arenas:
    generation runs in the batching thread, whose arena kept ~500 MB of freed step buffers (logits are
    [batch, vocab] floats, 8 MB for Gemma) after one batch on top of what the main thread's arena held from
    loading. A fixed threshold costs a page fault per fresh page of a big buffer: noise beside a forward pass.
    False where the C library is not glibc (the setting does not exist there)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES))


@shared_resource(maxsize=4)
def load_hf_model(model_path: str, device: str = "cpu") -> tuple[Any, Any]:
    """Load (tokenizer, model) once per process. `model_path` is a hub id, a folder, or a .gguf file.

    Says so in one line on stderr (once per process and model: the result is cached), without progress bars."""
    kwargs: dict[str, Any] = {}
    source = model_path
    if model_path.endswith(".gguf"):
        source, kwargs["gguf_file"] = str(Path(model_path).parent), Path(model_path).name
    dtype = _prepare_loading("model", model_path, device, stored_dtype=None if kwargs else checkpoint_dtype(source))
    with quiet_model_loading(gguf_file="gguf_file" in kwargs):
        from transformers import AutoModelForCausalLM

        # The model first: the tokenizer's load then fits in what the model's load freed (-250 MB peak for Gemma).
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(device).eval()
        tokenizer = load_tokenizer(source, **kwargs)
    _give_pad_token(tokenizer)
    return tokenizer, model


def apply_torch_threads() -> None:
    """torch's intra-op thread count from ERMEDRAG_TORCH_THREADS, when it is set (else torch's own choice)."""
    import torch

    threads = settings.read("ERMEDRAG_TORCH_THREADS")
    if threads:
        torch.set_num_threads(threads)


def _prepare_loading(kind: str, model_path: str, device: str, stored_dtype: str | None) -> Any:
    """What every weight load does first: torch's thread count (ERMEDRAG_TORCH_THREADS), one line on stderr
    naming the model, device, dtype and threads, and glibc set to return freed blocks. Returns the dtype
    (`inference_dtype`)."""
    import torch

    apply_torch_threads()
    dtype = inference_dtype(device, stored_dtype)
    label = _model_label(model_path)
    where = f" ({model_path})" if label != f"hf:{model_path}" else ""
    threads_used = torch.get_num_threads()
    print(
        f"loading {kind} {label}{where} on {device} ({str(dtype).removeprefix('torch.')}, "
        f"{threads_used} torch thread{'s' if threads_used != 1 else ''}) …",
        file=sys.stderr,
        flush=True,
    )
    return_large_blocks_to_the_os()
    return dtype


def _give_pad_token(tokenizer: Any) -> None:
    """Batches (and `generate`) need a pad token; a model without one pads with its end-of-sequence token."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


@shared_resource(maxsize=4)
def hf_generator(model_path: str, device: str = "cpu") -> BatchingGenerator:
    """The one batching generator per loaded model; concurrent callers share its batches."""
    tokenizer, model = load_hf_model(model_path, device)
    return BatchingGenerator(
        tokenizer,
        model,
        device,
        max_batch=settings.read("ERMEDRAG_HF_MAX_BATCH"),
        share_prefix=settings.read("ERMEDRAG_HF_SHARE_PREFIX"),
    )


@shared_resource(maxsize=2)
def load_hf_vision_model(model_path: str, device: str = "cpu") -> tuple[Any, Any]:
    """Load (processor, model) of a vision-language model once per process (AutoProcessor and
    AutoModelForImageTextToText), saying so on stderr like `load_hf_model`."""
    dtype = _prepare_loading("vision-language model", model_path, device, stored_dtype=checkpoint_dtype(model_path))
    with quiet_model_loading():
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype).to(device).eval()
        processor = AutoProcessor.from_pretrained(model_path)
    _give_pad_token(processor.tokenizer)
    return processor, model


@shared_resource(maxsize=2)
def hf_vision_generator(model_path: str, device: str = "cpu") -> VisionGenerator:
    processor, model = load_hf_vision_model(model_path, device)
    return VisionGenerator(processor, model, device)


class VisionGenerator:
    """One vision-language model, one call at a time: a prompt's images become pixel_values of their own (and a
    processor-specific number of image tokens), so these calls are not micro-batched like token ids are."""

    def __init__(self, processor: Any, model: Any, device: str):
        self.processor, self.model, self.device = processor, model, device
        self.tokenizer = processor.tokenizer
        self._lock = threading.Lock()

    def generate(
        self, conversation: list[dict[str, Any]], flags: dict[str, bool], params: GenerationParams
    ) -> tuple[Generated, dict[str, Any]]:
        """The completion of `conversation` (processor chat-template format: content lists of text and image
        entries) and what the model was given (prompt tokens, image count, pixel_values shape, image tokens)."""
        import torch

        submitted = time.perf_counter()
        with self._lock:
            started = time.perf_counter()
            inputs = self.processor.apply_chat_template(
                conversation, tokenize=True, return_dict=True, return_tensors="pt", **flags
            )
            inputs = inputs.to(self.device, dtype=self.model.dtype)  # casts only the floating tensors (pixels)
            stats = StepStatistics()
            gen = generation_kwargs(params, stats, self.tokenizer, self.tokenizer.pad_token_id)
            with torch.inference_mode():
                sequences = self.model.generate(**inputs, **gen)
            width = inputs["input_ids"].shape[1]
            new = sequences[:, width:]
            chosen, entropy = stats.finish(new)
            finished = time.perf_counter()
        generated = trimmed_completion(
            new[0].tolist(), chosen[0], entropy[0], self.tokenizer, self.model.generation_config.eos_token_id
        )
        generated.queue_s, generated.compute_s = started - submitted, finished - started
        return generated, self._seen(inputs, conversation)

    def _seen(self, inputs: Any, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """What reached the model: observable in the reply's metadata (and the tests)."""
        image_token = getattr(self.model.config, "image_token_id", None)
        if image_token is None:
            image_token = getattr(self.model.config, "image_token_index", None)
        ids = inputs["input_ids"]
        pixels = inputs.get("pixel_values")
        return {
            "prompt_tokens": int(ids.shape[1]),
            "images": sum(1 for m in conversation for c in m["content"] if c["type"] == "image"),
            "pixel_values_shape": list(pixels.shape) if pixels is not None else None,
            "image_tokens": int((ids == image_token).sum()) if image_token is not None else None,
        }


def _processor_conversation(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """Messages in a processor's chat-template format: each turn a list of image entries (as pixels: the
    reference read here) then its text."""
    return [
        {
            "role": chat["role"],
            "content": [
                *({"type": "image", "image": as_pil(ref)} for ref in message_images(message)),
                {"type": "text", "text": chat["content"]},
            ],
        }
        for message, chat in zip(messages, to_chat(messages))
    ]


def single_token_ids(tokenizer: Any, texts: Sequence[str]) -> dict[str, int]:
    """The token id of each text that is one token on its own (an option letter), to score at the first step."""
    ids = {}
    for text in texts:
        encoded = tokenizer.encode(str(text), add_special_tokens=False)
        if len(encoded) == 1:
            ids[str(text)] = encoded[0]
    return ids


def with_top_logprobs(
    content: list[dict[str, Any]], scored: dict[str, int] | None, first_scores: dict[int, float] | None
) -> list[dict[str, Any]]:
    """The per-token log-probabilities, the first token's with `top_logprobs` for the scored texts (OpenAI's shape:
    what a server returns for `top_logprobs`, here exactly the tokens asked for)."""
    if not scored or not first_scores or not content:
        return content
    top = [{"token": text, "logprob": first_scores[i]} for text, i in scored.items() if i in first_scores]
    return [{**content[0], "top_logprobs": top}, *content[1:]]


class HFChatModel(BaseChatModel):
    """A transformers causal LM behind the chat interface, on CPU or GPU."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    model_path: str
    spec: str = ""
    device: str = Field(default_factory=lambda: settings.read("ERMEDRAG_DEVICE"))
    temperature: float = 0.0
    max_new_tokens: int = 256
    top_p: float = 1.0
    seed: int | None = None

    provider: ClassVar[str] = "hf"

    @property
    def _llm_type(self) -> str:
        return "ermedrag-hf"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        params = GenerationParams(
            max_new_tokens=kwargs.get("max_new_tokens", self.max_new_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(stop or ()),
        )
        images = images_in(messages)
        # Before any weights load: a text-only model refuses images (its config says so), never drops them.
        require_image_support(self.spec or f"{self.provider}:{self.model_path}", images)
        if images or self._is_vision_model():
            generator_v = hf_vision_generator(self.model_path, self.device)
            out, seen = generator_v.generate(_processor_conversation(messages), continuation(messages), params)
            return self._result(out, seen["prompt_tokens"], generator_v.tokenizer, stop, {"vision_inputs": seen})
        generator = self._text_generator()
        prompt_ids = generator.tokenizer.apply_chat_template(
            to_chat(messages), tokenize=True, return_dict=False, **continuation(messages)
        )
        scored = single_token_ids(generator.tokenizer, kwargs.get("score_tokens") or ())
        out = generator.generate(list(prompt_ids), replace(params, scored_ids=tuple(scored.values())))
        return self._result(out, len(prompt_ids), generator.tokenizer, stop, {}, scored)

    def scores_answer_tokens(self) -> bool:
        """Option letters are scored exactly at the first step (`score_tokens`); not through a vision processor."""
        return not self._is_vision_model()

    def warm_up(self) -> None:
        """Load the weights now (the eval does, before its progress bar), through the loader a call would use."""
        if self._is_vision_model():
            hf_vision_generator(self.model_path, self.device)
        else:
            self._text_generator()

    def _text_generator(self) -> Any:
        """What generates text-only calls: `generate(prompt_ids, params) -> Generated` and its `tokenizer`."""
        return hf_generator(self.model_path, self.device)

    def _is_vision_model(self) -> bool:
        """A vision-language model answers even text-only calls through its processor; a config that cannot be
        read here is left to the text loader, whose error names the model."""
        try:
            return hf_accepts_images(self.model_path)
        except Exception:  # noqa: BLE001 - see the docstring
            return False

    def _result(
        self,
        out: Generated,
        n_prompt: int,
        tokenizer: Any,
        stop: list[str] | None,
        extra: dict[str, Any],
        scored: dict[str, int] | None = None,
    ) -> ChatResult:
        text, matched_stop = cut_at_stop(tokenizer.decode(out.token_ids, skip_special_tokens=True), stop)
        n_new = len(out.token_ids)
        metadata = {
            "model_name": self.spec or self.model_path,
            "finish_reason": "stop" if (out.hit_eos or matched_stop) else "length",
            "stop_sequence": matched_stop,
            "logprobs": {"content": with_top_logprobs(out.logprobs, scored, out.first_scores)},
            # Waiting for the model vs this call's share of its batch's compute (tools.hf_batching).
            "queue_s": out.queue_s,
            "compute_s": out.compute_s,
            "batch_size": out.batch_size,
            **extra,
        }
        usage = {"input_tokens": n_prompt, "output_tokens": n_new, "total_tokens": n_prompt + n_new}
        message = AIMessage(content=text, usage_metadata=usage, response_metadata=metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])
