"""What every agent's prompt shares: bounded input fields, the message layout, and the one mapping between
LangChain messages and chat-format dicts. No I/O here: the call itself is `ermedrag.tools.agent_calls.call_agent`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

MAX_INPUT_CHARS = 8_000  # one field of a prompt (question, snippet); longer input is cut, never rejected


def clip(text: str, limit: int = MAX_INPUT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + " …"


def fold_case(text: str) -> str:
    """`text` lower-cased with its length kept, so a position found in it is the same position in `text`.

    Literal search in the folded text (`str.find`, a pattern with a literal prefix) is how the parsers match
    tags case-insensitively in linear time: an IGNORECASE pattern tries every position. The three letters
    that IGNORECASE also matches to ASCII letters (`İ` `ı` → i, `ſ` → s) fold to them; `İ` is also the one
    character whose `lower()` is two characters long."""
    return text.replace("\u0130", "i").replace("\u0131", "i").replace("\u017f", "s").lower()


def chat_messages(system: str, user: str, example: tuple[str, str] | None = None) -> list[BaseMessage]:
    """System prompt, an optional worked example as a previous turn (small models copy its shape), the input."""
    shot = [HumanMessage(content=example[0]), AIMessage(content=example[1])] if example else []
    return [SystemMessage(content=system), *shot, HumanMessage(content=user)]


# The one mapping between LangChain's message types (also the roles traces record) and the chat roles of
# TRL datasets and chat templates.
CHAT_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_MESSAGE_TYPES = {"system": SystemMessage, "human": HumanMessage, "ai": AIMessage,
                  "user": HumanMessage, "assistant": AIMessage}


def to_chat(messages: Iterable[BaseMessage | Mapping[str, Any]]) -> list[dict[str, str]]:
    """Messages in the chat format (`{"role": system|user|assistant, "content"}`): LangChain messages, or
    recorded `{"role", "content"}` dicts (roles as recorded, system/human/ai, or already chat roles). Any
    other role becomes `user`."""
    chat = []
    for message in messages:
        if isinstance(message, BaseMessage):
            role, content = message.type, message.text
        else:
            role, content = message["role"], message["content"]
        chat.append({"role": _chat_role(role), "content": content})
    return chat


def _chat_role(role: str) -> str:
    if role in CHAT_ROLES:
        return CHAT_ROLES[role]
    return role if role in CHAT_ROLES.values() else "user"


def to_langchain(messages: Iterable[Mapping[str, Any]]) -> list[BaseMessage]:
    """Recorded or chat-format `{"role", "content"}` dicts as LangChain messages, exactly as they were sent
    (an unknown role becomes a human message)."""
    return [_MESSAGE_TYPES.get(m["role"], HumanMessage)(content=m["content"]) for m in messages]
