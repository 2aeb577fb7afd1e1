"""The scripted backend: a module's `reply(messages)` as a chat model (`scripted:MODULE?delay=S&vision=0|1`), for
graph-wiring tests only, never for results (the reply modules live in `ermedrag.testing.scripted`)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Sequence

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict, PrivateAttr

from ermedrag.tools.images import ImagesNotSupportedError, images_in
from ermedrag.tools.models.base import IMAGE_FIX, cut_at_stop


class ScriptedChatModel(BaseChatModel):
    """Replies with `reply(messages)` after `delay_s`. For graph-wiring tests only, never for results."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    reply: Callable[[list[BaseMessage]], str]
    # The module's `token_logprobs(messages, tokens) -> {token: logprob}`: the first token's log-probabilities of the
    # tokens a call asks to score (`score_tokens`), as the in-process backends give them. None: scores nothing.
    token_logprobs: Callable[[list[BaseMessage], Sequence[str]], dict[str, float]] | None = None
    delay_s: float = 0.0
    spec: str = "scripted"
    accepts_images: bool = False  # declared by the spec (`?vision=1`) or the module (`ACCEPTS_IMAGES = True`)
    calls: int = 0
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @property
    def _llm_type(self) -> str:
        return "ermedrag-scripted"

    def scores_answer_tokens(self) -> bool:
        return self.token_logprobs is not None

    def _result(
        self, messages: list[BaseMessage], stop: list[str] | None, score_tokens: Sequence[str] = ()
    ) -> ChatResult:
        if images_in(messages) and not self.accepts_images:
            raise ImagesNotSupportedError(
                f"model {self.spec} cannot see images: it is a scripted model that does "
                f"not declare vision (add ?vision=1); {IMAGE_FIX}"
            )
        with self._lock:
            self.calls += 1
        text, matched = cut_at_stop(self.reply(messages), stop)
        prompt_words = sum(len(m.text.split()) for m in messages)
        usage = {
            "input_tokens": prompt_words,
            "output_tokens": len(text.split()),
            "total_tokens": prompt_words + len(text.split()),
        }
        metadata = {"model_name": self.spec, "finish_reason": "stop", "stop_sequence": matched}
        if score_tokens and self.token_logprobs is not None:
            top = [{"token": t, "logprob": lp} for t, lp in self.token_logprobs(messages, score_tokens).items()]
            metadata["logprobs"] = {"content": [{"token": text[:1], "logprob": 0.0, "top_logprobs": top}]}
        return ChatResult(
            generations=[
                ChatGeneration(message=AIMessage(content=text, usage_metadata=usage, response_metadata=metadata))
            ]
        )

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        time.sleep(self.delay_s)
        return self._result(messages, stop, kwargs.get("score_tokens") or ())

    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        await asyncio.sleep(self.delay_s)
        return self._result(messages, stop, kwargs.get("score_tokens") or ())
