"""A scripted reply function for graph-wiring tests and the Studio smoke test (`scripted:ermedrag.testing.scripted`).

It answers each agent in that agent's format without any model: the extractor gets one triplet made from
the snippet's first words, the respondent always picks the first option. Never use it for results.
"""

from __future__ import annotations

import json
import re

from langchain_core.messages import BaseMessage


SCRIPTED_SEARCHES = 2


def reply(messages: list[BaseMessage]) -> str:
    if "<search>query</search>" in messages[0].text:  # the Med-R³ reasoner
        return _reasoner_reply(messages)
    prompt = messages[-1].text
    snippet = re.search(r"^Snippet: (.*)$", prompt, re.MULTILINE)
    if snippet:
        words = snippet.group(1).split()
        return json.dumps(
            [{"condition": " ".join(words[:4]), "relation": "states", "conclusion": " ".join(words[4:12])}]
        )
    option = re.search(r"^([A-Z])\. ", prompt, re.MULTILINE)
    return f"<think>Scripted reasoning.</think><answer>{option.group(1) if option else 'unknown'}</answer>"


def _reasoner_reply(messages: list[BaseMessage]) -> str:
    """Search twice (one query per step), then answer the first option."""
    transcript = messages[-1].text if messages[-1].type == "ai" else ""
    done = transcript.count("<document>")
    if done < SCRIPTED_SEARCHES:
        question = next(m.text for m in reversed(messages) if m.type == "human")
        words = question.removeprefix("Question: ").split()
        opening = "<think>" if not transcript else ""
        return f"{opening}I should check the evidence. <search>{' '.join(words[done * 3 : done * 3 + 6])}</search>"
    option = re.search(r"^([A-Z])\. ", next(m.text for m in reversed(messages) if m.type == "human"), re.MULTILINE)
    return f"The documents settle it.</think><answer>{option.group(1) if option else 'unknown'}</answer>"
