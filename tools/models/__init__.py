"""Chat-model backends, all LangChain `BaseChatModel`s chosen by one string, one module per backend.

    load_chat_model("hf:google/gemma-3-270m")            transformers in-process (hub id, folder, or file.gguf)
    load_chat_model("offline:gemma3-270m")               the packaged offline model (hf backend)
    load_chat_model("llamacpp:gemma3-270m")              llama.cpp in-process on CPU (an offline model or file.gguf;
                                                          the `llamacpp` extra; see tools.llamacpp)
    default_model()                                      the default: the offline model on llama.cpp where it is
                                                          installed, else on transformers
    load_chat_model("openai:Qwen/Qwen3-8B", base_url=…)  any OpenAI-compatible server (vllm serve, llama.cpp, ...)
                                                          (timeout_s, connect_timeout_s, max_retries, retry_backoff_s)
    load_chat_model("vllm:Qwen/Qwen3-8B")                in-process vLLM on a GPU
    load_chat_model("scripted:ermedrag.testing.scripted")          a scripted reply function, for graph-wiring tests only
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

import importlib
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel

from ermedrag.tools import settings
from ermedrag.tools.settings import default_model
from ermedrag.tools.images import ImagesNotSupportedError
from ermedrag.tools.model_server import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_RETRY_BACKOFF_S,
    ServerChatModel,
    ServerPolicy,
    check_sampling,
)
from ermedrag.tools.models.base import (
    IMAGE_FIX,
    OPENAI_VISION_ENV,
    PROVIDERS,
    ModelSpecError,
    image_support_problem,
    model_name,
    openai_accepts_images,
    parse_model_spec,
    require_image_support,
    scripted_options,
)
from ermedrag.tools.models.hf import HFChatModel
from ermedrag.tools.models.llamacpp import LlamaCppChatModel
from ermedrag.tools.models.scripted import ScriptedChatModel
from ermedrag.tools.models.vllm import VLLMChatModel

__all__ = [
    "default_model",
    "PROVIDERS",
    "ImagesNotSupportedError",
    "ModelSpecError",
    "image_support_problem",
    "load_chat_model",
    "model_name",
    "parse_model_spec",
    "require_image_support",
]


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
        from ermedrag.tools.models.offline import offline_model_dir

        return HFChatModel(model_path=str(offline_model_dir(name)), spec=spec, **sampling)
    if provider == "hf":
        return HFChatModel(model_path=name, spec=spec, **sampling)
    if provider == "llamacpp":
        return LlamaCppChatModel(model_path=name, spec=spec, **sampling)
    if provider == "openai":
        return _server_model(
            name, base_url, logprobs, ServerPolicy(timeout_s, connect_timeout_s, max_retries, retry_backoff_s), sampling
        )
    if provider == "vllm":
        return VLLMChatModel(model_path=name, spec=spec, **sampling)
    module_name, options = scripted_options(spec, name)  # e.g. scripted:ermedrag.testing.scripted?delay=0.5
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelSpecError(
            f"model {spec!r}: cannot import the scripted module {module_name!r} ({err}); it must be "
            "importable from here (e.g. run from the repository root with PYTHONPATH=.)"
        ) from None
    if not callable(getattr(module, "reply", None)):
        raise ModelSpecError(f"model {spec!r}: module {module_name!r} has no reply(messages) function")
    vision = options.get("vision", "1" if getattr(module, "ACCEPTS_IMAGES", False) else "0") == "1"
    return ScriptedChatModel(
        reply=module.reply,
        token_logprobs=getattr(module, "token_logprobs", None),
        delay_s=float(options.get("delay", delay_s)),
        spec=spec,
        accepts_images=vision,
    )


def server_tokenizer() -> str:
    """ERMEDRAG_SERVER_TOKENIZER, with `offline:NAME` as the offline model's folder (its tokenizer has the
    template); a tokenizer named there is loaded now, so that one that does not load fails before any call."""
    from ermedrag.tools.model_server.continuation import template_tokenizer

    source = settings.read("ERMEDRAG_SERVER_TOKENIZER")
    if source.startswith("offline:"):
        from ermedrag.tools.models.offline import offline_tokenizer_dir

        source = str(offline_tokenizer_dir(source.removeprefix("offline:")))
    if source:
        template_tokenizer(source, True)
    return source


def _server_model(
    name: str, base_url: str | None, logprobs: bool, policy: ServerPolicy, sampling: dict[str, Any]
) -> BaseChatModel:
    """`openai:NAME` at `base_url` (else OPENAI_BASE_URL), with the key from OPENAI_API_KEY (local servers take any)."""
    base_url = base_url or settings.read("OPENAI_BASE_URL")
    if not base_url:
        raise ModelSpecError(
            f"openai:{name} needs a server: pass base_url (e.g. http://127.0.0.1:8000/v1) or set OPENAI_BASE_URL"
        )
    if not base_url.lower().startswith(("http://", "https://")):
        raise ModelSpecError(f"openai:{name}: base URL {base_url!r} must start with http:// or https://")
    refusal = (
        None
        if openai_accepts_images()
        else (f"model openai:{name} cannot see images: it is declared text-only ({OPENAI_VISION_ENV}=0); {IMAGE_FIX}")
    )
    return ServerChatModel(
        model_name=name,
        base_url=base_url,
        api_key=settings.read("OPENAI_API_KEY"),
        spec=f"openai:{name}",
        logprobs=logprobs,
        policy=policy,
        image_refusal=refusal,
        tokenizer=server_tokenizer(),
        top_p=sampling["top_p"],
        temperature=sampling["temperature"],
        max_new_tokens=sampling["max_new_tokens"],
        seed=sampling["seed"],
    )
