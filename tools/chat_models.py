"""Chat-model backends, all LangChain `BaseChatModel`s chosen by one string.

    load_chat_model("hf:google/gemma-3-270m")            transformers in-process (hub id, folder, or file.gguf)
    load_chat_model("offline:gemma3-270m")               the packaged offline default (hf backend)
    load_chat_model("llamacpp:gemma3-270m")              llama.cpp in-process on CPU (an offline model or file.gguf;
                                                          the `llamacpp` extra; see tools.llamacpp)
    load_chat_model("openai:Qwen/Qwen3-8B", base_url=…)  any OpenAI-compatible server (vllm serve, llama.cpp, ...)
                                                          (timeout_s, connect_timeout_s, max_retries, retry_backoff_s)
    load_chat_model("vllm:Qwen/Qwen3-8B")                in-process vLLM on a GPU
    load_chat_model("scripted:ermedrag.agents.scripted")          a scripted reply function, for graph-wiring tests only
                                                          (`?delay=0.5` makes each reply take that long,
                                                          `?vision=1` makes it accept images)

Every backend puts token usage in `AIMessage.usage_metadata`. The hf backend also reports, per generated
token, its log-probability and the entropy of the full next-token distribution in
`response_metadata["logprobs"]` (OpenAI's `{"content": [{"token", "logprob", "entropy"}]}` shape), which
the entropy metrics read; the openai backend passes the server's log-probs through when asked. The hf backend
also splits each call's time into `response_metadata["queue_s"]` (waiting for the shared model) and
`["compute_s"]` (its share of its batch's compute); other backends do not report them (see tools.agent_calls).

The openai: backend lives in `tools.openai_server`: it returns the text as the model wrote it with the stop string
that ended it (servers cut it off), holds the token limit and a deadline per attempt on the client, and raises every
failure of a model *server* as one `ModelServerError` with a one-line message naming the URL, what went wrong and
the setting to change. The in-process backends (hf, offline, llamacpp, vllm, scripted) are not servers.

Images: a human message may carry image references (`agents.base.with_images`: file paths, http(s) URLs, data
URIs). Which models see them is declared, and checked before any weights load (`require_image_support`):
  openai:   assumed to see images (the paper's specialists are GPT-4o-class); files are sent as base64 data URIs
            in `image_url` content blocks, URLs as they are. ERMEDRAG_OPENAI_VISION=0 declares the server's
            model text-only, so images are refused here instead of by the server (an HTTP 400).
  hf:       a model whose config has a vision tower (`vision_config`: LLaVA, Qwen2-VL, Gemma 3, Idefics3...)
            runs through its AutoProcessor (chat template with image entries, pixel_values to generate), one
            call at a time; files and data URIs only (this process never fetches a URL).
  offline:  text only (Gemma 3 270M). vllm: text only (serve a VLM with `vllm serve` and use openai:).
  scripted: only with `?vision=1` in the spec or `ACCEPTS_IMAGES = True` in its module.
A model that cannot see refuses images with `ImagesNotSupportedError` naming the model and the fix; an image is
never dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Sequence

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr
from ermedrag.agents.base import message_images, to_chat
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.env import env_flag
from ermedrag.tools.precision import checkpoint_dtype, inference_dtype
from ermedrag.tools.hf_batching import (BatchingGenerator, GenerationParams, Generated, StepStatistics,
                                        generation_kwargs, trimmed_completion)
from ermedrag.tools.images import ImagesNotSupportedError, as_pil, images_in, is_url
from ermedrag.tools.openai_server import (DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_MAX_RETRIES,  # noqa: F401 - re-exported
                                          DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_RETRY_BACKOFF_S, MAX_RETRY_BACKOFF_S,
                                          ModelServerError, ServerChatModel, ServerPolicy, check_sampling,
                                          is_retryable)

PROVIDERS = ("hf", "offline", "llamacpp", "openai", "vllm", "scripted")
DEFAULT_MODEL = "offline:gemma3-270m"


class ModelSpecError(ValueError):
    """A model string that names no known provider or is otherwise malformed."""


def parse_model_spec(spec: str) -> tuple[str, str]:
    provider, sep, name = (spec or "").partition(":")
    if not sep or not name.strip():
        raise ModelSpecError(f"model {spec!r} must look like 'provider:name' with provider one of {PROVIDERS}")
    if provider not in PROVIDERS:
        raise ModelSpecError(f"unknown model provider {provider!r} in {spec!r}; expected one of {PROVIDERS}")
    return provider, name.strip()


def load_chat_model(
    spec: str,
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    top_p: float = 1.0,
    seed: int | None = None,
    base_url: str | None = None,
    logprobs: bool = False,
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_retries: int = DEFAULT_MAX_RETRIES,
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
    delay_s: float = 0.0,
) -> BaseChatModel:
    """Build the chat model named by `spec` with the given sampling parameters (and, for openai: servers,
    the read/connect timeouts and the retries of each call)."""
    provider, name = parse_model_spec(spec)
    check_sampling(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    sampling = dict(temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p, seed=seed)
    if provider == "offline":
        from ermedrag.tools.offline_model import offline_model_dir

        return HFChatModel(model_path=str(offline_model_dir(name)), spec=spec, **sampling)
    if provider == "hf":
        return HFChatModel(model_path=name, spec=spec, **sampling)
    if provider == "llamacpp":
        return LlamaCppChatModel(model_path=name, spec=spec, **sampling)
    if provider == "openai":
        return _server_model(name, base_url, logprobs, ServerPolicy(timeout_s, connect_timeout_s, max_retries,
                                                                    retry_backoff_s), sampling)
    if provider == "vllm":
        return VLLMChatModel(model_path=name, spec=spec, **sampling)
    module_name, options = _scripted_options(spec, name)  # e.g. scripted:ermedrag.agents.scripted?delay=0.5
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelSpecError(f"model {spec!r}: cannot import the scripted module {module_name!r} ({err}); it must be "
                             "importable from here (e.g. run from the repository root with PYTHONPATH=.)") from None
    if not callable(getattr(module, "reply", None)):
        raise ModelSpecError(f"model {spec!r}: module {module_name!r} has no reply(messages) function")
    vision = options.get("vision", "1" if getattr(module, "ACCEPTS_IMAGES", False) else "0") == "1"
    return ScriptedChatModel(reply=module.reply, delay_s=float(options.get("delay", delay_s)), spec=spec,
                             accepts_images=vision)


SCRIPTED_OPTIONS = ("delay", "vision")


def _scripted_options(spec: str, name: str) -> tuple[str, dict[str, str]]:
    """A scripted spec's module and its `?key=value&...` options (delay: seconds, vision: 0 or 1)."""
    module_name, _, query = name.partition("?")
    options: dict[str, str] = {}
    for pair in query.split("&")[: len(SCRIPTED_OPTIONS) + 1] if query else []:
        key, _, value = pair.partition("=")
        if key not in SCRIPTED_OPTIONS or (key == "vision" and value not in ("0", "1")):
            raise ModelSpecError(f"scripted model {spec!r}: unknown option {pair!r}; use ?delay=SECONDS and/or "
                                 "&vision=0|1")
        options[key] = value
    return module_name, options


# ---------------------------------------------------------------------------------------------- images


OPENAI_VISION_ENV = "ERMEDRAG_OPENAI_VISION"
VLM_CHOICES = ("hf:<a vision-language model's folder or hub id, e.g. Qwen/Qwen2-VL-2B-Instruct>, or openai:<model> on "
               "a server whose model takes images")
IMAGE_FIX = f"use a vision-language model ({VLM_CHOICES}), or send the question without images"


def openai_accepts_images() -> bool:
    """Whether openai: models are taken to see images: yes unless ERMEDRAG_OPENAI_VISION says false."""
    return env_flag(OPENAI_VISION_ENV, True)


@functools.lru_cache(maxsize=32)
def hf_accepts_images(model_path: str) -> bool:
    """Whether the transformers model at `model_path` is a vision-language model: its config (config.json
    only, no weights) has a vision tower. A GGUF file loads as a text-only model."""
    if model_path.endswith(".gguf"):
        return False
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None


def image_support_problem(spec: str, images: Sequence[str] = ()) -> str | None:
    """None when the model named by `spec` can take `images`, else why not (a phrase). Decided from what the
    model declares (its provider, config or spec), never by loading it."""
    provider, name = parse_model_spec(spec)
    if provider == "offline":
        return "it is a text-only model (the packaged Gemma 3 270M)"
    if provider == "llamacpp":
        return "the llamacpp: backend takes text only"
    if provider == "vllm":
        return ("the in-process vllm: backend takes text only (serve the model with `vllm serve` and use "
                f"openai:{name} with --base-url)")
    if provider == "openai":
        return None if openai_accepts_images() else f"it is declared text-only ({OPENAI_VISION_ENV}=0)"
    if provider == "scripted":
        module_name, options = _scripted_options(spec, name)
        declared = options.get("vision")
        if declared is None:
            declared = "1" if getattr(importlib.import_module(module_name), "ACCEPTS_IMAGES", False) else "0"
        return None if declared == "1" else "it is a scripted model that does not declare vision (add ?vision=1)"
    if not hf_accepts_images(name):
        return "it is a text-only model (its config has no vision tower)"
    urls = [ref for ref in images if is_url(ref)]
    if urls:
        return (f"the hf backend reads image files and data URIs, never URLs ({urls[0][:80]!r}): download the image "
                "and give its path")
    return None


def require_image_support(spec: str, images: Sequence[str], who: str = "", setting: str = "") -> None:
    """Raise `ImagesNotSupportedError` (naming `who`, the model, and the `setting` that changes it) unless
    `spec`'s model takes `images`."""
    if not images:
        return
    problem = image_support_problem(spec, images)
    if problem:
        fix = (f"set {setting} to a vision-language model ({VLM_CHOICES}), or send the question without images"
               if setting else IMAGE_FIX)
        raise ImagesNotSupportedError(f"{who}model {spec} cannot see images: {problem}; {fix}")


def _server_model(name: str, base_url: str | None, logprobs: bool, policy: ServerPolicy,
                  sampling: dict[str, Any]) -> BaseChatModel:
    """`openai:NAME` at `base_url` (else OPENAI_BASE_URL), with the key from OPENAI_API_KEY (local servers take any)."""
    base_url = base_url or os.environ.get("OPENAI_BASE_URL")
    if not base_url:
        raise ModelSpecError(
            f"openai:{name} needs a server: pass base_url (e.g. http://127.0.0.1:8000/v1) or set OPENAI_BASE_URL")
    if not base_url.lower().startswith(("http://", "https://")):
        raise ModelSpecError(f"openai:{name}: base URL {base_url!r} must start with http:// or https://")
    refusal = None if openai_accepts_images() else (f"model openai:{name} cannot see images: it is declared "
                                                    f"text-only ({OPENAI_VISION_ENV}=0); {IMAGE_FIX}")
    return ServerChatModel(model_name=name, base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                           spec=f"openai:{name}", logprobs=logprobs, policy=policy, image_refusal=refusal,
                           top_p=sampling["top_p"], temperature=sampling["temperature"],
                           max_new_tokens=sampling["max_new_tokens"], seed=sampling["seed"])


def model_name(model: BaseChatModel) -> str:
    """The spec string a model was built from (for traces)."""
    return getattr(model, "spec", None) or getattr(model, "model_name", None) or type(model).__name__


# -------------------------------------------------------------------------------------------------- hf


def continuation(messages: list[BaseMessage]) -> dict[str, bool]:
    """Chat-template flags: a conversation ending in an assistant message is continued, not answered anew
    (Med-R³ resumes its own turn after the search results are inserted)."""
    if messages and messages[-1].type == "ai":
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}


def _model_label(model_path: str) -> str:
    """How the user named the model: `offline:NAME` for the packaged model's converted folder, else `hf:PATH`."""
    from ermedrag.tools.offline_model import OFFLINE_MODELS, cache_home

    path = Path(model_path)
    if path.parent == cache_home() / "models" and path.name in OFFLINE_MODELS:
        return f"offline:{path.name}"
    return f"hf:{model_path}"


@contextlib.contextmanager
def quiet_model_loading(gguf_file: bool = False) -> Iterator[None]:
    """No progress bars while weights load: transformers' "Loading weights" bar and the GGUF de-quantising
    one would interleave with the eval's own progress bar. The previous setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
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
        if was_enabled:
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
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # The model first: the tokenizer's load then fits in what the model's load freed (-250 MB peak for Gemma).
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    _give_pad_token(tokenizer)
    return tokenizer, model


def _prepare_loading(kind: str, model_path: str, device: str, stored_dtype: str | None) -> Any:
    """What every weight load does first: torch's thread count (ERMEDRAG_TORCH_THREADS), one line on stderr
    naming the model, device, dtype and threads, and glibc set to return freed blocks. Returns the dtype
    (`inference_dtype`)."""
    import torch

    threads = os.environ.get("ERMEDRAG_TORCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    dtype = inference_dtype(device, stored_dtype)
    label = _model_label(model_path)
    where = f" ({model_path})" if label != f"hf:{model_path}" else ""
    threads_used = torch.get_num_threads()
    print(f"loading {kind} {label}{where} on {device} ({str(dtype).removeprefix('torch.')}, "
          f"{threads_used} torch thread{'s' if threads_used != 1 else ''}) …", file=sys.stderr, flush=True)
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
    return BatchingGenerator(tokenizer, model, device, max_batch=int(os.environ.get("ERMEDRAG_HF_MAX_BATCH", 8)),
                             share_prefix=env_flag("ERMEDRAG_HF_SHARE_PREFIX", True))


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

    def generate(self, conversation: list[dict[str, Any]], flags: dict[str, bool], params: GenerationParams
                 ) -> tuple[Generated, dict[str, Any]]:
        """The completion of `conversation` (processor chat-template format: content lists of text and image
        entries) and what the model was given (prompt tokens, image count, pixel_values shape, image tokens)."""
        import torch

        submitted = time.perf_counter()
        with self._lock:
            started = time.perf_counter()
            inputs = self.processor.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                        return_tensors="pt", **flags)
            inputs = inputs.to(self.device, dtype=self.model.dtype)  # casts only the floating tensors (pixels)
            stats = StepStatistics()
            gen = generation_kwargs(params, stats, self.tokenizer, self.tokenizer.pad_token_id)
            with torch.inference_mode():
                sequences = self.model.generate(**inputs, **gen)
            width = inputs["input_ids"].shape[1]
            new = sequences[:, width:]
            chosen, entropy = stats.finish(new)
            finished = time.perf_counter()
        generated = trimmed_completion(new[0].tolist(), chosen[0], entropy[0], self.tokenizer,
                                       self.model.generation_config.eos_token_id)
        generated.queue_s, generated.compute_s = started - submitted, finished - started
        return generated, self._seen(inputs, conversation)

    def _seen(self, inputs: Any, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """What reached the model: observable in the reply's metadata (and the tests)."""
        image_token = getattr(self.model.config, "image_token_id", None)
        if image_token is None:
            image_token = getattr(self.model.config, "image_token_index", None)
        ids = inputs["input_ids"]
        pixels = inputs.get("pixel_values")
        return {"prompt_tokens": int(ids.shape[1]),
                "images": sum(1 for m in conversation for c in m["content"] if c["type"] == "image"),
                "pixel_values_shape": list(pixels.shape) if pixels is not None else None,
                "image_tokens": int((ids == image_token).sum()) if image_token is not None else None}


def _processor_conversation(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """Messages in a processor's chat-template format: each turn a list of image entries (as pixels: the
    reference read here) then its text."""
    return [{"role": chat["role"],
             "content": [*({"type": "image", "image": as_pil(ref)} for ref in message_images(message)),
                         {"type": "text", "text": chat["content"]}]}
            for message, chat in zip(messages, to_chat(messages))]


def _cut_at_stop(text: str, stop: list[str] | None) -> tuple[str, str | None]:
    """OpenAI semantics: the completion ends before the first stop string, which is not included."""
    hits = [(text.find(s), s) for s in stop or [] if s and s in text]
    if not hits:
        return text, None
    index, matched = min(hits)
    return text[:index], matched


class HFChatModel(BaseChatModel):
    """A transformers causal LM behind the chat interface, on CPU or GPU."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    model_path: str
    spec: str = ""
    device: str = Field(default_factory=lambda: os.environ.get("ERMEDRAG_DEVICE", "cpu"))
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
            to_chat(messages), tokenize=True, return_dict=False, **continuation(messages))
        out = generator.generate(list(prompt_ids), params)
        return self._result(out, len(prompt_ids), generator.tokenizer, stop, {})

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

    def _result(self, out: Generated, n_prompt: int, tokenizer: Any, stop: list[str] | None,
                extra: dict[str, Any]) -> ChatResult:
        text, matched_stop = _cut_at_stop(tokenizer.decode(out.token_ids, skip_special_tokens=True), stop)
        n_new = len(out.token_ids)
        metadata = {
            "model_name": self.spec or self.model_path,
            "finish_reason": "stop" if (out.hit_eos or matched_stop) else "length",
            "stop_sequence": matched_stop,
            "logprobs": {"content": out.logprobs},
            # Waiting for the model vs this call's share of its batch's compute (tools.hf_batching).
            "queue_s": out.queue_s,
            "compute_s": out.compute_s,
            "batch_size": out.batch_size,
            **extra,
        }
        usage = {"input_tokens": n_prompt, "output_tokens": n_new, "total_tokens": n_prompt + n_new}
        message = AIMessage(content=text, usage_metadata=usage, response_metadata=metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])


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
        from ermedrag.tools.llamacpp import llamacpp_generator

        return llamacpp_generator(self.model_path)


# ------------------------------------------------------------------------------------------------ vllm


class VLLMChatModel(BaseChatModel):
    """In-process vLLM (GPU). The engine is built once per model path and shared."""

    model_path: str
    spec: str = ""
    temperature: float = 0.0
    max_new_tokens: int = 256
    top_p: float = 1.0
    seed: int | None = None

    @property
    def _llm_type(self) -> str:
        return "ermedrag-vllm"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        require_image_support(self.spec or f"vllm:{self.model_path}", images_in(messages))
        try:
            from vllm import SamplingParams
        except ImportError as err:
            raise ImportError("the vllm: backend needs vLLM on a GPU machine: pip install 'ermedrag[gpu]'") from err
        params = SamplingParams(
            temperature=kwargs.get("temperature", self.temperature),
            top_p=self.top_p,
            max_tokens=kwargs.get("max_new_tokens", self.max_new_tokens),
            seed=self.seed,
            stop=list(stop) if stop else None,
            logprobs=0,
        )
        output = _vllm_engine(self.model_path).chat(to_chat(messages), params, use_tqdm=False,
                                                    **continuation(messages))[0]
        choice = output.outputs[0]
        usage = {
            "input_tokens": len(output.prompt_token_ids),
            "output_tokens": len(choice.token_ids),
            "total_tokens": len(output.prompt_token_ids) + len(choice.token_ids),
        }
        logprobs = [
            {"token": step[tok].decoded_token, "logprob": step[tok].logprob}
            for tok, step in zip(choice.token_ids, choice.logprobs or [])
        ]
        metadata = {
            "model_name": self.spec,
            "finish_reason": choice.finish_reason,
            "stop_sequence": choice.stop_reason if isinstance(choice.stop_reason, str) else None,
            "logprobs": {"content": logprobs},
        }
        message = AIMessage(content=choice.text, usage_metadata=usage, response_metadata=metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])


@shared_resource(maxsize=1)
def _vllm_engine(model_path: str) -> Any:
    from vllm import LLM

    return LLM(model=model_path)


# -------------------------------------------------------------------------------------------- scripted


class ScriptedChatModel(BaseChatModel):
    """Replies with `reply(messages)` after `delay_s`. For graph-wiring tests only, never for results."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    reply: Callable[[list[BaseMessage]], str]
    delay_s: float = 0.0
    spec: str = "scripted"
    accepts_images: bool = False  # declared by the spec (`?vision=1`) or the module (`ACCEPTS_IMAGES = True`)
    calls: int = 0
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @property
    def _llm_type(self) -> str:
        return "ermedrag-scripted"

    def _result(self, messages: list[BaseMessage], stop: list[str] | None) -> ChatResult:
        if images_in(messages) and not self.accepts_images:
            raise ImagesNotSupportedError(f"model {self.spec} cannot see images: it is a scripted model that does "
                                          f"not declare vision (add ?vision=1); {IMAGE_FIX}")
        with self._lock:
            self.calls += 1
        text, matched = _cut_at_stop(self.reply(messages), stop)
        prompt_words = sum(len(m.text.split()) for m in messages)
        usage = {"input_tokens": prompt_words, "output_tokens": len(text.split()),
                 "total_tokens": prompt_words + len(text.split())}
        metadata = {"model_name": self.spec, "finish_reason": "stop", "stop_sequence": matched}
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text, usage_metadata=usage,
                                                                        response_metadata=metadata))])

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        time.sleep(self.delay_s)
        return self._result(messages, stop)

    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        await asyncio.sleep(self.delay_s)
        return self._result(messages, stop)
