"""Call an agent's chat model once and describe the call as a trace event (the I/O half of an agent)."""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage

from ermedrag.tools.chat_models import continuation_kwargs, model_name
from ermedrag.tools.traces import TraceEvent

Parsed = TypeVar("Parsed")


def call_agent(
    model: BaseChatModel,
    messages: list[BaseMessage],
    parse: Callable[[str], Parsed],
    *,
    agent: str,
    node: str,
    run_id: str,
    sampling: dict[str, Any],
    gold: str | None = None,
    stop: list[str] | None = None,
    inputs: dict[str, Any] | None = None,
) -> tuple[Parsed, TraceEvent]:
    """Invoke `model` once, parse its completion (parsers never raise) and describe the call as an event."""
    started = time.perf_counter()
    reply = model.invoke(messages, stop=stop, **continuation_kwargs(model, messages))
    latency = time.perf_counter() - started
    completion = reply.text
    # The stop string that ended generation is not part of the reply (OpenAI semantics); put it back so the
    # parser sees a closed tag. Backends that do not report it (OpenAI servers) leave it to the parser.
    matched_stop = reply.response_metadata.get("stop_sequence")
    if matched_stop and stop and matched_stop in stop:
        completion += matched_stop
    parsed = parse(completion)
    event = TraceEvent(
        run_id=run_id,
        node=node,
        agent=agent,
        model=sampling.get("model") or model_name(model),
        sampling=sampling,
        messages=[{"role": m.type, "content": m.text} for m in messages],
        completion=completion,
        parsed=parsed,
        usage=dict(reply.usage_metadata) if reply.usage_metadata else None,
        logprobs=(reply.response_metadata.get("logprobs") or {}).get("content"),
        latency_s=latency,
        gold=gold,
        inputs=inputs,
    )
    return parsed, event
