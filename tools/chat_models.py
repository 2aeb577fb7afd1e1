"""Chat-model backends, all LangChain `BaseChatModel`s chosen by one string.

    load_chat_model("hf:google/gemma-3-270m")            transformers in-process (hub id, folder, or file.gguf)
    load_chat_model("offline:gemma3-270m")               the packaged offline default (hf backend)
    load_chat_model("openai:Qwen/Qwen3-8B", base_url=…)  any OpenAI-compatible server (vllm serve, llama.cpp, ...)
    load_chat_model("vllm:Qwen/Qwen3-8B")                in-process vLLM on a GPU
    load_chat_model("scripted:agents.scripted")          a scripted reply function, for graph-wiring tests only

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
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr

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
        from tools.offline_model import offline_model_dir

        return HFChatModel(model_path=str(offline_model_dir(name)), spec=spec, **sampling)
    if provider == "hf":
        return HFChatModel(model_path=name, spec=spec, **sampling)
    if provider == "openai":
        return _openai_chat_model(name, base_url, logprobs, timeout_s, max_retries, **sampling)
    if provider == "vllm":
        return VLLMChatModel(model_path=name, spec=spec, **sampling)
    module = importlib.import_module(name)
    return ScriptedChatModel(reply=module.reply, delay_s=delay_s, spec=spec)


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


def _chat_dicts(messages: list[BaseMessage]) -> list[dict[str, str]]:
    roles = {"human": "user", "ai": "assistant", "system": "system"}
    return [{"role": roles.get(m.type, "user"), "content": m.text} for m in messages]


@lru_cache(maxsize=4)
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


def _logprob_entries(tokenizer: Any, token_ids: list[int], step_logits: list[Any]) -> list[dict[str, Any]]:
    import torch

    entries = []
    for token_id, logits in zip(token_ids, step_logits):
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        entropy = float(-(logp.exp() * logp).sum())
        entries.append({"token": tokenizer.decode([token_id]), "logprob": float(logp[token_id]), "entropy": entropy})
    return entries


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
        import torch

        tokenizer, model = load_hf_model(self.model_path, self.device)
        inputs = tokenizer.apply_chat_template(
            _chat_dicts(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(self.device)
        prompt_len = inputs["input_ids"].shape[1]
        temperature = kwargs.get("temperature", self.temperature)
        gen: dict[str, Any] = dict(
            max_new_tokens=kwargs.get("max_new_tokens", self.max_new_tokens),
            do_sample=temperature > 0,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=tokenizer.pad_token_id,
        )
        if temperature > 0:
            gen.update(temperature=temperature, top_p=self.top_p, top_k=0)
        if stop:
            gen.update(stop_strings=list(stop), tokenizer=tokenizer)
        if self.seed is not None:
            torch.manual_seed(self.seed)
        with torch.inference_mode():
            out = model.generate(**inputs, **gen)
        new_ids = out.sequences[0, prompt_len:].tolist()
        eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                  else [model.generation_config.eos_token_id])
        finished = bool(new_ids) and new_ids[-1] in eos
        text, matched_stop = _cut_at_stop(tokenizer.decode(new_ids, skip_special_tokens=True), stop)
        usage = {"input_tokens": prompt_len, "output_tokens": len(new_ids), "total_tokens": prompt_len + len(new_ids)}
        finish = "stop" if (finished or matched_stop) else "length"
        metadata = {
            "model_name": self.spec or self.model_path,
            "finish_reason": finish,
            "stop_sequence": matched_stop,
            "logprobs": {"content": _logprob_entries(tokenizer, new_ids, list(out.logits))},
        }
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
        output = _vllm_engine(self.model_path).chat(_chat_dicts(messages), params, use_tqdm=False)[0]
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


@lru_cache(maxsize=1)
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
