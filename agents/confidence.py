"""How sure an answer is: the model's probability of each option at the point where it writes its answer.

After its reasoning, an agent writes `<answer>` and then the option letter. The next-token log-probabilities of
the option letters there, renormalised over the options, are the answer's distribution (`option_probabilities`);
the probability of the chosen option is its `confidence`. This is the score conformal answer sets and selective
answering read (`evals.conformal`). The in-process backends (hf, llamacpp) give every letter's log-probability
exactly; an OpenAI-compatible server gives its top 20 tokens (`top_logprobs`), and an option letter missing from
them is given the smallest log-probability listed (an upper bound: its true mass is below it). No I/O here: the
graphs make the scoring call (`graphs.steps.with_confidence`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ermedrag.agents.base import fold_case

ANSWER_OPEN = "<answer>"
# What the agent wrote after `<answer>` starts with a letter: "B", "(B)", "B. text", "B</answer>".
LETTER_FIRST = re.compile(r"\s*+\(?([A-Za-z])(?:$|[\s.:)<-])")


def answer_prefix(completion: str, reasoning: str) -> str:
    """What the agent wrote up to and including its first `<answer>` (the point where it chose a letter); for a
    reply without one (an answer the system had to read back), its reasoning closed and `<answer>` opened."""
    text = completion or ""
    opened = fold_case(text).find(ANSWER_OPEN)
    if opened >= 0:
        return text[: opened + len(ANSWER_OPEN)]
    return f"<think>{reasoning}</think>{ANSWER_OPEN}"


def answered_by_letter(completion: str, options: Mapping[str, str]) -> bool:
    """Whether the agent's first `<answer>` in `completion` starts with an option letter: what the letters'
    probabilities there score. An agent that named its option by its text chose among words, not letters (a
    respondent warm-started on reference replies answers so: `training.evidence_export.reference_answer`). True without an
    `<answer>`: the scoring call then writes the letter itself."""
    text = completion or ""
    opened = fold_case(text).find(ANSWER_OPEN)
    if opened < 0:
        return True
    written = LETTER_FIRST.match(text, opened + len(ANSWER_OPEN))
    return bool(written) and written.group(1).upper() in {str(key).upper() for key in options}


def option_probabilities(
    top_logprobs: Sequence[Mapping[str, Any]] | None, options: Mapping[str, str]
) -> dict[str, float] | None:
    """Each option key's probability from the first answer token's `top_logprobs` (`{"token", "logprob"}`), over
    the options only; None when no option letter is among them. A token counts for a letter when, stripped of
    spaces, it is that letter (any case)."""
    seen: dict[str, float] = {}
    for entry in top_logprobs or ():
        token = str(entry.get("token", "")).strip().upper()
        logprob = entry.get("logprob")
        if token in options and isinstance(logprob, (int, float)) and math.isfinite(logprob):
            seen[token] = max(seen.get(token, -math.inf), float(logprob))
    if not seen:
        return None
    floor = min(float(e["logprob"]) for e in top_logprobs or () if _finite(e.get("logprob")))
    logprobs = {key: seen.get(key, floor) for key in options}
    peak = max(logprobs.values())
    weights = {key: math.exp(lp - peak) for key, lp in logprobs.items()}
    total = sum(weights.values())
    return {key: weight / total for key, weight in weights.items()}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def confidence(probs: Mapping[str, float] | None, answer: str | None) -> float | None:
    """The probability of the chosen option (None without probabilities or an answer)."""
    if not probs or answer is None:
        return None
    return float(probs.get(answer, 0.0))
