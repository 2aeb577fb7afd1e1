"""What every chat-model backend shares: model strings (`provider:name`), which models see images (declared, checked
before any weights load), the chat-template flags that continue a final assistant turn, and OpenAI's stop semantics
for the in-process backends."""

from __future__ import annotations

import functools
import importlib
from typing import Sequence

from langchain_core.language_models.chat_models import BaseChatModel

from ermedrag.tools import settings
from ermedrag.tools.images import ImagesNotSupportedError, is_url

PROVIDERS = ("hf", "offline", "llamacpp", "openai", "vllm", "scripted")


class ModelSpecError(ValueError):
    """A model string that names no known provider or is otherwise malformed."""


def parse_model_spec(spec: str) -> tuple[str, str]:
    provider, sep, name = (spec or "").partition(":")
    if not sep or not name.strip():
        raise ModelSpecError(f"model {spec!r} must look like 'provider:name' with provider one of {PROVIDERS}")
    if provider not in PROVIDERS:
        raise ModelSpecError(f"unknown model provider {provider!r} in {spec!r}; expected one of {PROVIDERS}")
    return provider, name.strip()


SCRIPTED_OPTIONS = ("delay", "vision")


def scripted_options(spec: str, name: str) -> tuple[str, dict[str, str]]:
    """A scripted spec's module and its `?key=value&...` options (delay: seconds, vision: 0 or 1)."""
    module_name, _, query = name.partition("?")
    options: dict[str, str] = {}
    for pair in query.split("&")[: len(SCRIPTED_OPTIONS) + 1] if query else []:
        key, _, value = pair.partition("=")
        if key not in SCRIPTED_OPTIONS or (key == "vision" and value not in ("0", "1")):
            raise ModelSpecError(
                f"scripted model {spec!r}: unknown option {pair!r}; use ?delay=SECONDS and/or &vision=0|1"
            )
        options[key] = value
    return module_name, options


# ---------------------------------------------------------------------------------------------- images


OPENAI_VISION_ENV = "ERMEDRAG_OPENAI_VISION"
VLM_CHOICES = (
    "hf:<a vision-language model's folder or hub id, e.g. Qwen/Qwen2-VL-2B-Instruct>, or openai:<model> on "
    "a server whose model takes images"
)
IMAGE_FIX = f"use a vision-language model ({VLM_CHOICES}), or send the question without images"


def openai_accepts_images() -> bool:
    """Whether openai: models are taken to see images: yes unless ERMEDRAG_OPENAI_VISION says false."""
    return settings.read(OPENAI_VISION_ENV)


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
        return (
            "the in-process vllm: backend takes text only (serve the model with `vllm serve` and use "
            f"openai:{name} with --base-url)"
        )
    if provider == "openai":
        return None if openai_accepts_images() else f"it is declared text-only ({OPENAI_VISION_ENV}=0)"
    if provider == "scripted":
        module_name, options = scripted_options(spec, name)
        declared = options.get("vision")
        if declared is None:
            declared = "1" if getattr(importlib.import_module(module_name), "ACCEPTS_IMAGES", False) else "0"
        return None if declared == "1" else "it is a scripted model that does not declare vision (add ?vision=1)"
    if not hf_accepts_images(name):
        return "it is a text-only model (its config has no vision tower)"
    urls = [ref for ref in images if is_url(ref)]
    if urls:
        return (
            f"the hf backend reads image files and data URIs, never URLs ({urls[0][:80]!r}): download the image "
            "and give its path"
        )
    return None


def require_image_support(spec: str, images: Sequence[str], who: str = "", setting: str = "") -> None:
    """Raise `ImagesNotSupportedError` (naming `who`, the model, and the `setting` that changes it) unless
    `spec`'s model takes `images`."""
    if not images:
        return
    problem = image_support_problem(spec, images)
    if problem:
        fix = (
            f"set {setting} to a vision-language model ({VLM_CHOICES}), or send the question without images"
            if setting
            else IMAGE_FIX
        )
        raise ImagesNotSupportedError(f"{who}model {spec} cannot see images: {problem}; {fix}")


def model_name(model: BaseChatModel) -> str:
    """The spec string a model was built from (for traces)."""
    return getattr(model, "spec", None) or getattr(model, "model_name", None) or type(model).__name__


def cut_at_stop(text: str, stop: list[str] | None) -> tuple[str, str | None]:
    """OpenAI semantics: the completion ends before the first stop string, which is not included."""
    hits = [(text.find(s), s) for s in stop or [] if s and s in text]
    if not hits:
        return text, None
    index, matched = min(hits)
    return text[:index], matched
