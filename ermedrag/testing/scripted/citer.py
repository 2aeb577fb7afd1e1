"""A scripted model that cites its evidence (`scripted:ermedrag.testing.scripted.citer`), for the citation tests.
Never for results.

Every answering agent cites one item it was shown and one it was not, so a test can check both are handled:
- the respondent and the specialists: `[2]`, the snippet id of evidence line 1 in brackets, and `[9]`;
- the Med-R³ reasoner: searches once, then cites "document [1]" and "document [7]";
- the attending: "specialists 2 and 5".
The extractor gets the default script's triplet; every agent answers the first option, and where an answer starts the
option letters have the probabilities of `token_logprobs` (0.6, 0.3, then 0.1 shared).
"""

from __future__ import annotations

import re

from langchain_core.messages import BaseMessage

from ermedrag.agents import attending, reasoner
from ermedrag.testing import scripted

FIRST_LINE_ID = re.compile(r"^1\. \[([^\]\n]+)\]", re.MULTILINE)
FIRST_OPTION = re.compile(r"^([A-Z])\. ", re.MULTILINE)


def _first_option(messages: list[BaseMessage]) -> str:
    question = next(m.text for m in reversed(messages) if m.type == "human")
    option = FIRST_OPTION.search(question)
    return option.group(1) if option else "unknown"


def reply(messages: list[BaseMessage]) -> str:
    system = messages[0].text
    user = messages[-1].text
    if system == reasoner.SYSTEM_PROMPT:
        if messages[-1].type != "ai":
            return "<think>I should check. <search>first-line drug</search>"
        return f"Document [1] and document [7] say so.</think><answer>{_first_option(messages)}</answer>"
    if system == attending.ATTENDING_SYSTEM_PROMPT:
        return f"<think>Specialists 2 and 5 agree.</think><answer>{_first_option(messages)}</answer>"
    if user.startswith("Question: ") and "\nSnippet: " in user:
        return scripted.reply(messages)
    if messages[-1].type == "ai":  # answer extraction
        return f"{_first_option(messages)}</answer>"
    line_one = FIRST_LINE_ID.search(user.split("\nQuestion: ")[0])
    by_id = f" and [{line_one.group(1)}]" if line_one else ""
    return f"<think>Evidence [2]{by_id} and [9] agree.</think><answer>{_first_option(messages)}</answer>"


# The option letters' probabilities where an answer starts: the first option 0.6, the second 0.3, the rest share 0.1.
def token_logprobs(messages: list[BaseMessage], tokens) -> dict[str, float]:
    import math

    tokens = list(tokens)
    rest = max(1, len(tokens) - 2)
    shares = [0.6, 0.3] + [0.1 / rest] * rest
    return {token: math.log(share) for token, share in zip(tokens, shares)}
