"""Metrics over result rows (one row per question and sample, as the runner writes them).

Definitions (natural logarithms, so entropies are in nats):
- accuracy: fraction of rows whose parsed answer equals the gold option; an unparsed answer counts as wrong.
  The 95% interval is Wilson's score interval.
- invalid rate: fraction of rows whose answer could not be parsed into one of the options.
- extracted rate: fraction of rows whose answer came from the answer-extraction retry (None: not recorded).
- answer entropy: for one configuration answering one question (in one option order) n > 1 times (sampling,
  temperature > 0), H = -Σ_a p(a) ln p(a) over the distribution of its n answers (an unparsed answer is its own
  outcome); averaged over questions. 0 means the configuration always gives the same answer. With one sample
  per question it is undefined: None, with the reason in `answer_entropy_note` (never 0).
- token entropy: for each respondent completion, the mean over its generated tokens of the entropy of the
  model's full next-token distribution; averaged over rows. Only backends that return full distributions
  (hf, offline) provide it; others report None.
- latency, mean per answered question (rows that recorded the field; None when none did): `seconds` is the
  run's wall time; stage seconds are the graph nodes' wall times (including time spent waiting for a batch);
  model seconds are the model's own compute over the run's calls (apportioned across a batch by a batched
  backend); wait seconds are the time those calls queued before computing.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping

NEEDS_SAMPLES = "needs --samples > 1"


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


def number(value: Any) -> float | None:
    """A finite number from a result field, None for anything else (a bool, a string, NaN, a missing field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def option_order(row: Mapping[str, Any]) -> int:
    """The option permutation a row answered (0 = the original order; older rows have no field)."""
    value = number(row.get("order"))
    return int(value) if value is not None else 0


def original_order_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of questions asked as given (order 0, or rows written before orders existed): what the main
    tables count, so that `--permute-options` never weighs a question N times (permuted rows belong to the
    position-bias section)."""
    return [r for r in rows if option_order(r) == 0]


def question_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """One configuration's view of one question: the samples answer entropy is computed over."""
    return (row.get("config_key"), row.get("benchmark"), row.get("question_id"), option_order(row))


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _entropy(rows: list[dict[str, Any]]) -> tuple[float | None, str | None]:
    by_question: dict[tuple[Any, ...], list[str | None]] = defaultdict(list)
    for r in rows:
        by_question[question_key(r)].append(r.get("answer"))
    sampled = [answers for answers in by_question.values() if len(answers) > 1]
    if sampled:
        return _mean(answer_entropy(a) for a in sampled), None
    return None, NEEDS_SAMPLES


def _rate(rows: list[dict[str, Any]], field: str) -> float | None:
    recorded = [bool(r[field]) for r in rows if field in r]
    return sum(recorded) / len(recorded) if recorded else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, interval, rates, tokens, latency and both entropies for a set of rows (of one configuration:
    pooling configurations mixes their answer distributions)."""
    n = len(rows)
    correct = sum(bool(r.get("correct")) for r in rows)
    low, high = wilson_interval(correct, n)
    stages: dict[str, list[float | None]] = defaultdict(list)
    for r in rows:
        timings = r.get("timings")
        for stage, seconds in timings.items() if isinstance(timings, dict) else ():
            stages[str(stage)].append(number(seconds))
    entropy, entropy_note = _entropy(rows)
    token_entropies = [number(r.get("token_entropy")) for r in rows]
    return {
        "n": n,
        "questions": len({(r.get("benchmark"), r.get("question_id")) for r in rows}),
        "accuracy": correct / n if n else None,
        "ci95": [low, high],
        "invalid_rate": sum(not r.get("ok") for r in rows) / n if n else None,
        "well_formed_rate": sum(bool(r.get("well_formed")) for r in rows) / n if n else None,
        "extracted_rate": _rate(rows, "extracted"),
        "mean_output_tokens": _mean(number(r.get("output_tokens")) for r in rows),
        "mean_seconds": _mean(number(r.get("seconds")) for r in rows),
        "mean_model_seconds": _mean(number(r.get("model_seconds")) for r in rows),
        "mean_wait_seconds": _mean(number(r.get("wait_seconds")) for r in rows),
        "stage_seconds": {stage: _mean(values) for stage, values in sorted(stages.items())},
        "answer_entropy": entropy,
        "answer_entropy_note": entropy_note,
        "token_entropy": _mean(token_entropies),
        "token_entropy_n": sum(v is not None for v in token_entropies),
    }
