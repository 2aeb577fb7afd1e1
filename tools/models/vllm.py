"""The vllm backend: vLLM in process, on a GPU (`vllm:NAME`, the `gpu` extra). Text only: serve a vision-language
model with `vllm serve` and use `openai:`."""

from __future__ import annotations

from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from ermedrag.agents.base import to_chat
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.images import images_in
from ermedrag.agents.base import continuation
from ermedrag.tools.models.base import require_image_support


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
        output = _vllm_engine(self.model_path).chat(
            to_chat(messages), params, use_tqdm=False, **continuation(messages)
        )[0]
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
