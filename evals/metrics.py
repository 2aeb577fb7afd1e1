"""Metrics over result rows (one row per question and sample, as the runner writes them).

Definitions (natural logarithms, so entropies are in nats):
- accuracy: fraction of rows whose parsed answer equals the gold option; an unparsed answer counts as wrong.
  The 95% interval is Wilson's score interval.
- invalid rate: fraction of rows whose answer could not be parsed into one of the options.
- answer entropy: for a question answered n > 1 times (sampling, temperature > 0), H = -Σ_a p(a) ln p(a)
  over the distribution of its n answers (an unparsed answer is its own outcome); averaged over questions.
  0 means the system always gives the same answer.
- token entropy: for each respondent completion, the mean over its generated tokens of the entropy of the
  model's full next-token distribution; averaged over rows. Only backends that return full distributions
  (hf) provide it; others report None.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # Rounding can put a bound a hair past p (6/6 gave 0.9999999999999999 < 1.0): the interval always holds p
    # and stays inside [0, 1], so error bars derived from it are never negative.
    return (min(max(0.0, centre - half), p), max(min(1.0, centre + half), p))


def answer_entropy(answers: Iterable[str | None]) -> float:
    counts = Counter(a if a is not None else "∅" for a in answers)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values()) if total else 0.0


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, interval, invalid rate, tokens, latency per stage and both entropies for a set of rows."""
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    low, high = wilson_interval(correct, n)
    by_question: dict[tuple[str, str], list[str | None]] = defaultdict(list)
    for r in rows:
        by_question[(r["benchmark"], r["question_id"])].append(r["answer"])
    sampled = [answers for answers in by_question.values() if len(answers) > 1]
    stages: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        for stage, seconds in (r.get("timings") or {}).items():
            stages[stage].append(seconds)
    return {
        "n": n,
        "questions": len(by_question),
        "accuracy": correct / n if n else None,
        "ci95": [low, high],
        "invalid_rate": sum(not r["ok"] for r in rows) / n if n else None,
        "well_formed_rate": sum(bool(r.get("well_formed")) for r in rows) / n if n else None,
        "mean_output_tokens": _mean([r.get("output_tokens", 0) for r in rows]),
        "mean_seconds": _mean([r.get("seconds", 0.0) for r in rows]),
        "stage_seconds": {stage: _mean(values) for stage, values in sorted(stages.items())},
        "answer_entropy": _mean([answer_entropy(a) for a in sampled]),
        "token_entropy": _mean([r["token_entropy"] for r in rows if r.get("token_entropy") is not None]),
    }


def group_summaries(rows: list[dict[str, Any]], *keys: str) -> dict[tuple, dict[str, Any]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[tuple(_field(r, k) for k in keys)].append(r)
    return {key: summarise(group) for key, group in sorted(groups.items())}


def _field(row: dict[str, Any], key: str) -> Any:
    if key in ("system", "model"):
        return row["config"][key]
    return row.get(key)
