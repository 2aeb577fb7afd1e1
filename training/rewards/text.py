"""What a reward reads from a completion: its text, the part the model itself wrote, a dataset column, and
content tokens for overlap scores. Model output is untrusted: nothing here raises on any completion.

A completion is a string (standard dataset) or a list of messages (conversational: the last assistant
message is read). The model's own text is the rollout's `model_text` column when the rollout returned one
(`training.rollouts`: what the model sampled, without the documents the search loop inserted); otherwise
the completion's text without those inserted documents (a `\\n<document>\\n…\\n</document>\\n` block right
after `</search>`). A completion without a search is its own text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Protocol

from ermedrag.agents import reasoner

logger = logging.getLogger(__name__)

MAX_TEXT_CHARS = 200_000  # longer model output is cut before any scanning (bounded work)


class RewardFunc(Protocol):
    """TRL's reward-function signature; `__name__` names its curves (`rewards/<__name__>/mean`)."""

    __name__: str

    def __call__(self, completions: list, **kwargs: Any) -> list[float | None]: ...


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is; for a list of messages (TRL's conversational format) the
    content of the last assistant message (content given as a list of parts: its text parts joined).
    Anything else gives "" rather than an error."""
    try:
        if completion is None:
            return ""
        if isinstance(completion, str):
            return completion
        if isinstance(completion, dict):
            return _content_text(completion.get("content"))
        if isinstance(completion, (list, tuple)):
            messages = [m for m in completion if isinstance(m, dict)]
            for message in reversed(messages):
                if message.get("role") == "assistant":
                    return _content_text(message.get("content"))
            return _content_text(messages[-1].get("content")) if messages else ""
    except Exception:  # a malformed message must not stop training
        logger.debug("unreadable completion of type %s", type(completion).__name__, exc_info=True)
    return ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        return "".join(str(part.get("text") or "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def column(kwargs: Mapping[str, Any], name: str, index: int) -> Any:
    """Row `index` of a dataset column (or rollout field) passed by the trainer, or None when absent or short."""
    values = kwargs.get(name)
    if values is None or isinstance(values, (str, bytes, dict)):
        return None
    try:
        return values[index] if index < len(values) else None
    except Exception:
        return None


def strip_environment_documents(transcript: str) -> str:
    """The transcript without the document blocks the search loop inserted (right after `</search>`)."""
    return reasoner.INSERTED_DOCUMENT.sub("", transcript)


def own_text(completion: Any, kwargs: Mapping[str, Any], index: int) -> str:
    """What the model itself wrote in completion `index` (see the module docstring)."""
    given = column(kwargs, "model_text", index)
    return given if isinstance(given, str) else strip_environment_documents(completion_text(completion))


def answer_source(completion: Any, kwargs: Mapping[str, Any], index: int) -> str:
    """The text an answer is read from: the rollout's `answer_text` (the model's segments and the system's
    answer-forcing prompt, never a document) when given, else `own_text`."""
    given = column(kwargs, "answer_text", index)
    return given if isinstance(given, str) else own_text(completion, kwargs, index)


STOP_WORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before being below
    between both but by can could did do does doing down during each either few for from further had has have
    having he her here hers him his how however i if in into is it its itself just may me might more most
    much must my no nor not of off on once only or other our out over own same she should so some such than
    that the their them then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would yet you your
    answer following likely patient patients question shown which""".split()
)

_TOKEN = re.compile(r"[^\W_]+")
_SUFFIXES = (
    ("ies", "y"),
    ("ments", ""),
    ("ment", ""),
    ("ing", ""),
    ("edly", ""),
    ("ed", ""),
    ("ly", ""),
    ("es", ""),
    ("s", ""),
)


def stem(token: str) -> str:
    """Strip one common English suffix, then a final "e" (so cause/causes/caused/causing agree)."""
    if len(token) <= 3 or token.isdigit():
        return token
    for suffix, replacement in _SUFFIXES:
        if token.endswith(suffix) and len(token) - len(suffix) >= 3:
            if suffix == "s" and token.endswith(("ss", "us", "is")):
                break
            token = token[: -len(suffix)] + replacement
            break
    return token[:-1] if len(token) > 3 and token.endswith("e") else token


def content_tokens(text: Any) -> list[str]:
    """Lowercased, stemmed alphanumeric tokens without stop words, in order (repeats kept)."""
    words = _TOKEN.findall(str(text or "")[:MAX_TEXT_CHARS].lower())
    return [stem(w) for w in words if w not in STOP_WORDS]
