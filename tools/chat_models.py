"""Chat-model backends, all LangChain `BaseChatModel`s chosen by one string.

    load_chat_model("hf:google/gemma-3-270m")            transformers in-process (hub id, folder, or file.gguf)
    load_chat_model("offline:gemma3-270m")               the packaged offline default (hf backend)
    load_chat_model("openai:Qwen/Qwen3-8B", base_url=…)  any OpenAI-compatible server (vllm serve, llama.cpp, ...)
    load_chat_model("vllm:Qwen/Qwen3-8B")                in-process vLLM on a GPU
    load_chat_model("scripted:ermedrag.agents.scripted")          a scripted reply function, for graph-wiring tests only
                                                          (`?delay=0.5` makes each reply take that long)

Every backend puts token usage in `AIMessage.usage_metadata`. The hf backend also reports, per generated
token, its log-probability and the entropy of the full next-token distribution in
`response_metadata["logprobs"]` (OpenAI's `{"content": [{"token", "logprob", "entropy"}]}` shape), which
the entropy metrics read; the openai backend passes the server's log-probs through when asked.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.hf_batching import BatchingGenerator, GenerationParams

PROVIDERS = ("hf", "offline", "openai", "vllm", "scripted")
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
    timeout_s: float = 120.0,
    max_retries: int = 2,
    delay_s: float = 0.0,
) -> BaseChatModel:
    """Build the chat model named by `spec` with the given sampling parameters."""
    provider, name = parse_model_spec(spec)
    sampling = dict(temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p, seed=seed)
    if provider == "offline":
        from ermedrag.tools.offline_model import offline_model_dir

        return HFChatModel(model_path=str(offline_model_dir(name)), spec=spec, **sampling)
    if provider == "hf":
        return HFChatModel(model_path=name, spec=spec, **sampling)
    if provider == "openai":
        return _openai_chat_model(name, base_url, logprobs, timeout_s, max_retries, **sampling)
    if provider == "vllm":
        return VLLMChatModel(model_path=name, spec=spec, **sampling)
    module_name, _, delay = name.partition("?delay=")  # e.g. scripted:ermedrag.agents.scripted?delay=0.5
    module = importlib.import_module(module_name)
    return ScriptedChatModel(reply=module.reply, delay_s=float(delay) if delay else delay_s, spec=spec)


def model_name(model: BaseChatModel) -> str:
    """The spec string a model was built from (for traces)."""
    return getattr(model, "spec", None) or getattr(model, "model_name", None) or type(model).__name__


# ---------------------------------------------------------------------------------------------- openai


def _openai_chat_model(
    name: str,
    base_url: str | None,
    logprobs: bool,
    timeout_s: float,
    max_retries: int,
    *,
    temperature: float,
    max_new_tokens: int,
    top_p: float,
    seed: int | None,
) -> BaseChatModel:
    from langchain_openai import ChatOpenAI

    base_url = base_url or os.environ.get("OPENAI_BASE_URL")
    if not base_url:
        raise ModelSpecError(
            f"openai:{name} needs a server: pass base_url (e.g. http://127.0.0.1:8000/v1) or set OPENAI_BASE_URL"
        )
    # Local servers (vLLM, llama.cpp, transformers serve) accept any key; a real one comes from the env.
    api_key = os.environ.get("OPENAI_API_KEY", "EMPTY")
    kwargs: dict[str, Any] = dict(
        model=name,
        base_url=base_url,
        api_key=api_key,
        temperature=temperature,
        max_tokens=max_new_tokens,
        top_p=top_p,
        timeout=timeout_s,
        max_retries=max_retries,
        stream_usage=True,
    )
    if seed is not None:
        kwargs["seed"] = seed
    if logprobs:
        kwargs["logprobs"] = True
    return ChatOpenAI(**kwargs)


# -------------------------------------------------------------------------------------------------- hf


def continuation(messages: list[BaseMessage]) -> dict[str, bool]:
    """Chat-template flags: a conversation ending in an assistant message is continued, not answered anew
    (Med-R³ resumes its own turn after the search results are inserted)."""
    if messages and messages[-1].type == "ai":
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}


def continuation_kwargs(model: BaseChatModel, messages: list[BaseMessage]) -> dict[str, Any]:
    """Per-call arguments that make `model` continue a final assistant message: vLLM's OpenAI server
    takes the chat-template flags in the request body; in-process backends read the messages themselves."""
    flags = continuation(messages)
    if flags["add_generation_prompt"] or type(model).__name__ != "ChatOpenAI":
        return {}
    return {"extra_body": flags}


def _chat_dicts(messages: list[BaseMessage]) -> list[dict[str, str]]:
    roles = {"human": "user", "ai": "assistant", "system": "system"}
    return [{"role": roles.get(m.type, "user"), "content": m.text} for m in messages]


@shared_resource(maxsize=4)
def load_hf_model(model_path: str, device: str = "cpu") -> tuple[Any, Any]:
    """Load (tokenizer, model) once per process. `model_path` is a hub id, a folder, or a .gguf file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = os.environ.get("ERMEDRAG_TORCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    kwargs: dict[str, Any] = {}
    source = model_path
    if model_path.endswith(".gguf"):
        source, kwargs["gguf_file"] = str(Path(model_path).parent), Path(model_path).name
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model


@shared_resource(maxsize=4)
def hf_generator(model_path: str, device: str = "cpu") -> BatchingGenerator:
    """The one batching generator per loaded model; concurrent callers share its batches."""
    tokenizer, model = load_hf_model(model_path, device)
    return BatchingGenerator(tokenizer, model, device, max_batch=int(os.environ.get("ERMEDRAG_HF_MAX_BATCH", 8)))


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

    @property
    def _llm_type(self) -> str:
        return "ermedrag-hf"

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        generator = hf_generator(self.model_path, self.device)
        prompt_ids = generator.tokenizer.apply_chat_template(
            _chat_dicts(messages), tokenize=True, return_dict=False, **continuation(messages))
        params = GenerationParams(
            max_new_tokens=kwargs.get("max_new_tokens", self.max_new_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(stop or ()),
        )
        out = generator.generate(list(prompt_ids), params)
        text, matched_stop = _cut_at_stop(generator.tokenizer.decode(out.token_ids, skip_special_tokens=True), stop)
        n_prompt, n_new = len(prompt_ids), len(out.token_ids)
        metadata = {
            "model_name": self.spec or self.model_path,
            "finish_reason": "stop" if (out.hit_eos or matched_stop) else "length",
            "stop_sequence": matched_stop,
            "logprobs": {"content": out.logprobs},
        }
        usage = {"input_tokens": n_prompt, "output_tokens": n_new, "total_tokens": n_prompt + n_new}
        message = AIMessage(content=text, usage_metadata=usage, response_metadata=metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])


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
        output = _vllm_engine(self.model_path).chat(_chat_dicts(messages), params, use_tqdm=False,
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
    calls: int = 0
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @property
    def _llm_type(self) -> str:
        return "ermedrag-scripted"

    def _result(self, messages: list[BaseMessage], stop: list[str] | None) -> ChatResult:
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
