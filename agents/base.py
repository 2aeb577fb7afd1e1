"""What every agent's prompt shares: bounded input fields and the message layout. No I/O here: the call itself
is `ermedrag.tools.agent_calls.call_agent`."""

from __future__ import annotations

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

MAX_INPUT_CHARS = 8_000  # one field of a prompt (question, snippet); longer input is cut, never rejected


def clip(text: str, limit: int = MAX_INPUT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + " …"


def chat_messages(system: str, user: str, example: tuple[str, str] | None = None) -> list[BaseMessage]:
    """System prompt, an optional worked example as a previous turn (small models copy its shape), the input."""
    shot = [HumanMessage(content=example[0]), AIMessage(content=example[1])] if example else []
    return [SystemMessage(content=system), *shot, HumanMessage(content=user)]
