"""A scripted reply function for graph-wiring tests and the Studio smoke test (`scripted:agents.scripted`).

It answers each agent in that agent's format without any model: the extractor gets one triplet made from
the snippet's first words, the respondent always picks the first option. Never use it for results.
"""

from __future__ import annotations

import json
import re

from langchain_core.messages import BaseMessage


def reply(messages: list[BaseMessage]) -> str:
    prompt = messages[-1].text
    snippet = re.search(r"^Snippet: (.*)$", prompt, re.MULTILINE)
    if snippet:
        words = snippet.group(1).split()
        return json.dumps([{"condition": " ".join(words[:4]), "relation": "states", "conclusion": " ".join(words[4:12])}])
    option = re.search(r"^([A-Z])\. ", prompt, re.MULTILINE)
    return f"<think>Scripted reasoning.</think><answer>{option.group(1) if option else 'unknown'}</answer>"
