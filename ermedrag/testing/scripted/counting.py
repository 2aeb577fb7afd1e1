"""The scripted replies of `ermedrag.testing.scripted`, counted across processes and paced, for the kill tests.

    scripted:ermedrag.testing.scripted.counting

SCRIPTED_COUNTING_CALLS   a file that gets one line per finished call, `agent<TAB>question<TAB>snippet` (the
                      snippet empty for the respondent), appended as the call returns: the
                      calls of a killed process and of its resume add up in one file.
SCRIPTED_COUNTING_STEP_S  pacing: the nth extractor call that a process starts for a question takes n steps, the
                      respondent one step, so a fan-out finishes one extraction at a time and a kill can land
                      between two of them.
SCRIPTED_COUNTING_FAIL    a file: while it exists, the respondent fails like a model server error would.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

from langchain_core.messages import BaseMessage

from ermedrag.testing import scripted

_started_extractions: dict[str, int] = {}  # question → extractions started for it in this process
_lock = threading.Lock()


class ScriptedServerError(RuntimeError):
    """What a failing model server raises."""


def reply(messages: list[BaseMessage]) -> str:
    prompt = messages[-1].text
    snippet = re.search(r"^Snippet: (.*)$", prompt, re.MULTILINE)
    question = re.search(r"^Question: (.*)$", prompt, re.MULTILINE)
    about = [question.group(1)[:100] if question else "", snippet.group(1)[:100] if snippet else ""]
    agent = "extractor" if snippet else "respondent"
    step_s = float(os.environ.get("SCRIPTED_COUNTING_STEP_S", "0"))
    if snippet:
        with _lock:
            arrival = _started_extractions[about[0]] = _started_extractions.get(about[0], 0) + 1
        time.sleep(step_s * arrival)
    else:
        time.sleep(step_s)
        failing = os.environ.get("SCRIPTED_COUNTING_FAIL")
        if failing and Path(failing).exists():
            raise ScriptedServerError("scripted server error: 503 Service Unavailable")
    text = scripted.reply(messages)
    calls = os.environ.get("SCRIPTED_COUNTING_CALLS")
    if calls:
        with _lock, open(calls, "a", encoding="utf-8") as handle:
            handle.write("\t".join([agent, *about]) + "\n")
    return text
