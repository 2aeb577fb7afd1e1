"""What every agent's prompt shares: bounded input fields, the message layout, and the one mapping between
LangChain messages and chat-format dicts. No I/O here: the call itself is `ermedrag.tools.agent_calls.call_agent`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

MAX_INPUT_CHARS = 8_000  # one field of a prompt (question, snippet); longer input is cut, never rejected


def clip(text: str, limit: int = MAX_INPUT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + " …"


def is_word_char(char: str) -> bool:
    """Whether `char` is what regex `\\w` matches (a letter, a digit or `_`): word boundaries without regex."""
    return char.isalnum() or char == "_"


def word_boundary(text: str, index: int) -> bool:
    """Whether `\\b` holds at `index` of `text` (a word character on exactly one side)."""
    before = index > 0 and is_word_char(text[index - 1])
    after = index < len(text) and is_word_char(text[index])
    return before != after


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


# Images travel in a message as OpenAI-style content blocks holding the *reference* (a file path, an http(s)
# URL or a data URI: `tools.images`), placed before the text of the turn that asks about them. Each backend turns
# a reference into what its model reads (a data URI for a server, pixels for an in-process model); `message.text`
# stays the text alone, so every text reader (parsers, scripted models, token counts) is unchanged.
IMAGE_BLOCK_TYPE = "image_url"
MAX_IMAGE_BLOCKS = 64  # what `message_images` reads of one message's content list


def image_block(reference: str) -> dict[str, Any]:
    return {"type": IMAGE_BLOCK_TYPE, "image_url": {"url": reference}}


def with_images(messages: list[BaseMessage], images: Iterable[str]) -> list[BaseMessage]:
    """`messages` with `images` attached to the last human turn (the case itself, not a worked example's)."""
    blocks = [image_block(ref) for ref in images]
    if not blocks:
        return messages
    last = max((i for i, m in enumerate(messages) if m.type == "human"), default=None)
    if last is None:
        raise ValueError("images need a human turn to attach to")
    text_block = {"type": "text", "text": messages[last].text}
    return [*messages[:last], HumanMessage(content=[*blocks, text_block]), *messages[last + 1 :]]


def message_images(message: BaseMessage) -> list[str]:
    """The image references of a message's content blocks, in order (none for plain-text content)."""
    content = message.content
    if not isinstance(content, list):
        return []
    found = (block_image_url(block) for block in content[:MAX_IMAGE_BLOCKS])
    return [url for url in found if url is not None]


def block_image_url(block: Any) -> str | None:
    """The image reference of one content block (`{"type": "image_url", "image_url": {"url": ...}}`, or the
    older `"image_url": "..."` form); None for any other block."""
    if not isinstance(block, dict) or block.get("type") != IMAGE_BLOCK_TYPE:
        return None
    url = block.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) else None


# The one mapping between LangChain's message types (also the roles traces record) and the chat roles of
# TRL datasets and chat templates.
CHAT_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_MESSAGE_TYPES = {
    "system": SystemMessage,
    "human": HumanMessage,
    "ai": AIMessage,
    "user": HumanMessage,
    "assistant": AIMessage,
}


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


def continuation(messages: Sequence[BaseMessage]) -> dict[str, bool]:
    """Chat-template flags: a conversation ending in an assistant message is continued, not answered anew
    (Med-R³ resumes its own turn after the search results are inserted)."""
    if messages and messages[-1].type == "ai":
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": True}


def _chat_role(role: str) -> str:
    if role in CHAT_ROLES:
        return CHAT_ROLES[role]
    return role if role in CHAT_ROLES.values() else "user"


def to_langchain(messages: Iterable[Mapping[str, Any]]) -> list[BaseMessage]:
    """Recorded or chat-format `{"role", "content"}` dicts as LangChain messages, exactly as they were sent
    (an unknown role becomes a human message)."""
    return [_MESSAGE_TYPES.get(m["role"], HumanMessage)(content=m["content"]) for m in messages]
