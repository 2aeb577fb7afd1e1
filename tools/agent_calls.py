"""Call an agent's chat model once and describe the call as a trace event (the I/O half of an agent)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, TypeVar

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage

from ermedrag.tools.models import model_name
from ermedrag.tools.images import recorded_message
from ermedrag.tools.records.traces import TraceEvent

Parsed = TypeVar("Parsed")


def stop_sequence(reply: Any, stop: list[str] | None) -> str | None:
    """The stop string (one of `stop`) that ended a reply, as its backend reports it; None for any other end."""
    matched = (getattr(reply, "response_metadata", None) or {}).get("stop_sequence")
    return matched if isinstance(matched, str) and stop and matched in stop else None


def text_with_stop(reply: Any, stop: list[str] | None) -> str:
    """A reply's text with the stop string that ended it put back: backends cut it off (OpenAI semantics) and say
    which one in `response_metadata["stop_sequence"]` (the openai: backend finds it on the client, whatever the
    server does), and a parser needs the closed tag or list."""
    return reply.text + (stop_sequence(reply, stop) or "")


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
    invoke_kwargs: dict[str, Any] | None = None,
) -> tuple[Parsed, TraceEvent]:
    """Invoke `model` once (with `invoke_kwargs`, e.g. `score_tokens`), parse its completion (parsers never raise) and describe the call as an event.

    The event's `latency_s` is the call's wall time. `queue_s` (waiting for the model) and `compute_s` (the
    call's own compute) come from the backend when it can tell them apart (hf: its batching generator).
    Others cannot: an OpenAI-compatible server's own queue is invisible to its client, so there `compute_s` is
    the call's wall time and `queue_s` is None (unknown, not zero)."""
    started = time.perf_counter()
    reply = model.invoke(messages, stop=stop, **(invoke_kwargs or {}))
    latency = time.perf_counter() - started
    completion = text_with_stop(reply, stop)
    parsed = parse(completion)
    queue_s, compute_s = call_timing(reply.response_metadata, latency)
    event = TraceEvent(
        run_id=run_id,
        node=node,
        agent=agent,
        model=sampling.get("model") or model_name(model),
        sampling=sampling,
        messages=[recorded_message(m) for m in messages],  # images as references and hashes, never pixels
        completion=completion,
        parsed=parsed,
        usage=dict(reply.usage_metadata) if reply.usage_metadata else None,
        logprobs=(reply.response_metadata.get("logprobs") or {}).get("content"),
        latency_s=latency,
        queue_s=queue_s,
        compute_s=compute_s,
        gold=gold,
        inputs=inputs,
        finish_reason=_short_str(reply.response_metadata.get("finish_reason")),
        stop_sequence=stop_sequence(reply, stop),
    )
    return parsed, event


def call_timing(metadata: dict[str, Any], wall_s: float) -> tuple[float | None, float]:
    """(queue_s, compute_s) of one call from its reply's metadata; (None, wall_s) when the backend has no split."""
    compute_s = _seconds(metadata.get("compute_s"))
    if compute_s is None:
        return None, wall_s
    return _seconds(metadata.get("queue_s")), compute_s


def _seconds(value: Any) -> float | None:
    """A finite, non-negative number of seconds, or None (metadata is the backend's; never trust its types)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _short_str(value: Any) -> str | None:
    return value[:40] if isinstance(value, str) else None
