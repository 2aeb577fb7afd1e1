"""Conformal answer sets and selective answering, from the answers' option probabilities (`agents.confidence`).

Split conformal prediction (Vovk et al.; for multiple-choice LLM answers, Kumar et al. 2023, "Conformal Prediction
with Large Language Models for Multi-Choice Question Answering"). On a calibration set of answered questions, the
nonconformity of a question is one minus the probability the model gave its gold option (LAC, Sadinle et al.
2019). For an error rate α the threshold is the ⌈(n+1)(1−α)⌉-th smallest of the n scores; a new question's answer
set is every option whose one-minus-probability is at most the threshold. If the calibration and test questions
are exchangeable, the set holds the right option with probability at least 1 − α (over both draws); that is a
marginal guarantee (on average over questions, not for each one). A weak model gets large sets: that is the
honest statement of how little its answers say, not a defect of the method. An empty set (possible with LAC) is
given the most probable option, which only raises coverage.

A calibration belongs to one configuration (graph, prompts, settings: `evals.rows.EvalConfig`): it is stored with
it and refused for another (`Calibration.check`).

Selective answering: an answer whose confidence (the chosen option's probability) is below a threshold is
withheld (`abstention`). `risk_coverage` gives, for answers ranked by confidence, the error rate among the most
confident share of them, for every share; AURC (area under that curve) summarises it, beside the random-
abstention baseline (withholding answers at random keeps the error rate: AURC equals it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION_VERSION = 1
SCORE = "lac: 1 - p(gold option), p from the option letters' log-probabilities where the answer is written"


def nonconformity(probs: Mapping[str, float], gold: str) -> float:
    return 1.0 - float(probs.get(gold, 0.0))


def conformal_threshold(scores: Sequence[float], alpha: float) -> float:
    """The ⌈(n+1)(1−α)⌉-th smallest score; infinity (every option in every set) when n is too small for α."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1 (exclusive), got {alpha}")
    n = len(scores)
    rank = math.ceil((n + 1) * (1 - alpha))
    if n == 0 or rank > n:
        return math.inf
    return sorted(scores)[rank - 1]


def answer_set(probs: Mapping[str, float], threshold: float) -> list[str]:
    """The options whose nonconformity is within `threshold`, most probable first; never empty."""
    ranked = sorted(probs, key=lambda key: -probs[key])
    kept = [key for key in ranked if 1.0 - probs[key] <= threshold + 1e-12]
    return kept or ranked[:1]


@dataclass(frozen=True)
class Calibration:
    """A fitted threshold and the configuration it belongs to."""

    system: str
    config_key: str
    settings: dict[str, Any]
    prompt_version: str
    alpha: float
    threshold: float
    n_calibration: int
    benchmarks: list[str]
    score: str = SCORE
    version: int = CALIBRATION_VERSION
    created_at: float = field(default_factory=time.time)

    def answer_set(self, probs: Mapping[str, float] | None) -> list[str] | None:
        return answer_set(probs, self.threshold) if probs else None

    def check(self, config: Any) -> None:
        """A ValueError naming what differs when `config` (an `EvalConfig`) is not the one this was fitted for."""
        if config.key() == self.config_key:
            return
        differs = [f"graph {self.system} (this run: {config.system})"] if config.system != self.system else []
        if config.prompt_version != self.prompt_version:
            differs.append(f"prompts {self.prompt_version} (this run: {config.prompt_version})")
        for name in sorted(set(self.settings) | set(config.settings)):
            if self.settings.get(name) != config.settings.get(name):
                differs.append(f"{name}={self.settings.get(name)!r} (this run: {config.settings.get(name)!r})")
        raise ValueError(
            f"this calibration was fitted for another configuration: {'; '.join(differs) or 'another sample count'}; "
            "fit one for this configuration with `ermedrag calibrate`"
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2, default=_json_number) + "\n")
        return path


def _json_number(value: Any) -> Any:
    return str(value)


def load_calibration(path: str | Path) -> Calibration:
    """A saved calibration, or a ValueError naming the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration file {path} does not exist (fit one with `ermedrag calibrate`)") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"calibration file {path} cannot be read: {err}") from None
    if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"calibration file {path} is not a version-{CALIBRATION_VERSION} ermedrag calibration")
    try:
        threshold = data["threshold"]
        data["threshold"] = math.inf if threshold in ("inf", "Infinity") else float(threshold)
        return Calibration(**data)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"calibration file {path} is missing or has a bad field: {err}") from None


def scored_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows of multiple-choice answers that carry option probabilities and a gold option among them."""
    return [
        r
        for r in rows
        if isinstance(r.get("option_probs"), Mapping) and r["option_probs"] and r.get("gold") in r["option_probs"]
    ]


def fit(rows: Sequence[Mapping[str, Any]], alpha: float, config: Mapping[str, Any]) -> Calibration:
    """The calibration of one configuration (`config`: a result row's `config` record and `config_key`) on its
    scored rows; a ValueError when there are none."""
    usable = scored_rows(rows)
    if not usable:
        raise ValueError(
            "no answered multiple-choice questions with option probabilities to calibrate on (answers are scored "
            "by the hf and llamacpp backends and vLLM's server, with answer_scores on)"
        )
    threshold = conformal_threshold([nonconformity(r["option_probs"], r["gold"]) for r in usable], alpha)
    return Calibration(
        system=config["system"],
        config_key=config["config_key"],
        settings=dict(config.get("settings") or {}),
        prompt_version=config.get("prompt_version", ""),
        alpha=alpha,
        threshold=threshold,
        n_calibration=len(usable),
        benchmarks=sorted({str(r.get("benchmark")) for r in usable}),
    )


def coverage(rows: Sequence[Mapping[str, Any]], threshold: float) -> dict[str, float | int]:
    """How sets at `threshold` do on scored rows: the share holding the gold option, mean size, singleton share."""
    usable = scored_rows(rows)
    sets = [answer_set(r["option_probs"], threshold) for r in usable]
    n = len(sets)
    if not n:
        return {"n": 0, "coverage": math.nan, "mean_set_size": math.nan, "singleton_rate": math.nan}
    return {
        "n": n,
        "coverage": sum(r["gold"] in s for r, s in zip(usable, sets)) / n,
        "mean_set_size": sum(len(s) for s in sets) / n,
        "singleton_rate": sum(len(s) == 1 for s in sets) / n,
    }


@dataclass(frozen=True)
class Selective:
    """What an answer gets beside itself: its conformal set (`calibration`) and whether it is withheld
    (`abstain_below`: a confidence threshold). Neither changes the answer."""

    calibration: Calibration | None = None
    abstain_below: float | None = None

    def __post_init__(self) -> None:
        if self.abstain_below is not None and not 0 <= self.abstain_below <= 1:
            raise ValueError(f"--abstain-below {self.abstain_below}: expected a probability from 0 to 1")

    def fields(self, probs: Mapping[str, float] | None, confidence: float | None) -> dict[str, Any]:
        """The answer's `answer_set` (with the calibration's α) and `abstained` with its reason, as given."""
        fields: dict[str, Any] = {}
        if self.calibration is not None:
            fields["answer_set"] = self.calibration.answer_set(probs)
            fields["answer_set_alpha"] = self.calibration.alpha
        if self.abstain_below is not None:
            why = abstention(confidence, self.abstain_below)
            fields["abstained"], fields["abstain_reason"] = why is not None, why
        return fields


def abstention(confidence: float | None, below: float | None) -> str | None:
    """Why an answer is withheld (its confidence is below `below`, or unknown), or None to give it."""
    if below is None:
        return None
    if confidence is None:
        return f"no confidence for this answer (the backend gave no option probabilities); threshold {below:g}"
    if confidence < below:
        return f"confidence {confidence:.3f} is below the threshold {below:g}"
    return None


def risk_coverage(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The risk–coverage curve of answers ranked by confidence (most confident first): at each coverage k/n, the
    error rate of the k most confident answers; AURC (mean risk over k = 1..n), the random-abstention baseline
    (the overall error rate), and the curve itself. None without answers that carry a confidence."""
    scored = [
        (float(r["confidence"]), bool(r.get("correct")))
        for r in rows
        if isinstance(r.get("confidence"), (int, float)) and math.isfinite(r["confidence"])
    ]
    if not scored:
        return None
    scored.sort(key=lambda pair: -pair[0])
    # Answers of equal confidence cannot be ranked: within a tie, each position gets the tie's mean error.
    errors, risks, start = 0.0, [], 0
    while start < len(scored):
        end = start
        while end < len(scored) and scored[end][0] == scored[start][0]:
            end += 1
        tie_errors = sum(not correct for _, correct in scored[start:end])
        for j in range(1, end - start + 1):
            risks.append((errors + tie_errors * j / (end - start)) / (start + j))
        errors += tie_errors
        start = end
    n = len(scored)
    return {
        "n": n,
        "aurc": sum(risks) / n,
        "random_aurc": errors / n,
        "coverage": [k / n for k in range(1, n + 1)],
        "risk": risks,
    }
