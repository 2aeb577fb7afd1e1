"""A script whose answering agents name the first option by its text, not its letter (as a respondent warm-started on
reference replies does: `training.evidence_export.reference_answer`), on a backend that scores option letters like
`citer`'s. Never for results."""

from __future__ import annotations

import re

from langchain_core.messages import BaseMessage

from ermedrag.testing import scripted
from ermedrag.testing.scripted.citer import token_logprobs  # noqa: F401  (the backend scores letters)

FIRST_OPTION_TEXT = re.compile(r"^[A-Z]\. (.+)$", re.MULTILINE)


def reply(messages: list[BaseMessage]) -> str:
    user = messages[-1].text
    if user.startswith("Question: ") and "\nSnippet: " in user:
        return scripted.reply(messages)  # the extractor
    option = FIRST_OPTION_TEXT.search(user.partition("\nQuestion: ")[2] or user)
    return f"<think>Evidence [1] says so.</think><answer>{option.group(1) if option else 'unknown'}</answer>"
