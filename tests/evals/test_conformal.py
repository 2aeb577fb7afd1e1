"""Conformal answer sets and selective answering (`evals.conformal`) and the option probabilities they read
(`agents.confidence`): the threshold's rank, coverage on exchangeable draws, sets never empty, the risk–coverage
curve against random abstention, and calibrations that refuse another configuration."""

from __future__ import annotations

import math
import random

import pytest

from ermedrag.agents.confidence import answer_prefix, answered_by_letter, confidence, option_probabilities
from ermedrag.evals.conformal import (
    Calibration,
    Selective,
    abstention,
    answer_set,
    conformal_threshold,
    coverage,
    fit,
    load_calibration,
    risk_coverage,
)
from ermedrag.evals.rows import EvalConfig

OPTIONS = {"A": "a", "B": "b", "C": "c", "D": "d"}


def test_option_probabilities_renormalise_over_the_options_and_bound_missing_letters():
    top = [
        {"token": " A", "logprob": math.log(0.5)},
        {"token": "b", "logprob": math.log(0.25)},
        {"token": "The", "logprob": math.log(0.2)},
        {"token": "C", "logprob": math.log(0.05)},
    ]
    probs = option_probabilities(top, OPTIONS)
    # D is missing: it gets the smallest listed log-probability (0.05) as its bound.
    assert probs == pytest.approx({"A": 0.5 / 0.85, "B": 0.25 / 0.85, "C": 0.05 / 0.85, "D": 0.05 / 0.85})
    assert confidence(probs, "B") == pytest.approx(0.25 / 0.85)
    assert option_probabilities([{"token": "The", "logprob": -1.0}], OPTIONS) is None
    assert option_probabilities([{"token": "A", "logprob": float("nan")}], OPTIONS) is None
    assert confidence(None, "A") is None and confidence(probs, None) is None


def test_the_answer_prefix_is_what_the_agent_wrote_up_to_its_answer():
    assert answer_prefix("<think>x</think><ANSWER>B</answer>", "x") == "<think>x</think><ANSWER>"
    assert answer_prefix("The answer is B", "The answer is B") == "<think>The answer is B</think><answer>"


def test_only_an_answer_written_as_a_letter_is_scored_by_the_letters():
    options = {"A": "Metformin", "B": "Insulin", "C": "Glipizide"}
    for written in ("B", " (b)", "B. Insulin", "B: Insulin", "B\n"):
        assert answered_by_letter(f"<think>x</think><answer>{written}</answer>", options), written
    assert answered_by_letter("<think>x</think><answer>B", options)  # cut at the stop string
    for written in ("Insulin", "insulin glargine", "E", "Both", ""):
        assert not answered_by_letter(f"<think>x</think><answer>{written}</answer>", options), written
    assert answered_by_letter("no answer tag: extraction writes the letter", options)


def test_threshold_is_the_finite_sample_quantile():
    scores = [0.1 * i for i in range(1, 10)]  # n = 9
    assert conformal_threshold(scores, 0.2) == pytest.approx(0.8)  # ceil(10 * 0.8) = 8th smallest
    assert conformal_threshold(scores, 0.05) == math.inf  # ceil(10 * 0.95) = 10 > n: every option
    with pytest.raises(ValueError, match="alpha"):
        conformal_threshold(scores, 1.0)


def test_sets_are_never_empty_and_ranked():
    probs = {"A": 0.2, "B": 0.7, "C": 0.1}
    assert answer_set(probs, 0.85) == ["B", "A"]
    assert answer_set(probs, 0.0) == ["B"]  # empty under LAC: the most probable option is kept


def _draw(rng: random.Random, n: int) -> list[dict]:
    """Questions whose model is right with the probability it states (calibrated by construction)."""
    rows = []
    for _ in range(n):
        weights = [rng.random() ** 3 for _ in OPTIONS]
        total = sum(weights)
        probs = dict(zip(OPTIONS, (w / total for w in weights)))
        gold = rng.choices(list(OPTIONS), weights=list(probs.values()))[0]
        rows.append({"option_probs": probs, "gold": gold, "benchmark": "sim"})
    return rows


@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_coverage_holds_on_exchangeable_draws(alpha):
    rng = random.Random(7)
    covered = []
    for _ in range(200):
        calibration, test = _draw(rng, 200), _draw(rng, 200)
        threshold = conformal_threshold([1 - r["option_probs"][r["gold"]] for r in calibration], alpha)
        covered.append(coverage(test, threshold)["coverage"])
    mean = sum(covered) / len(covered)
    # The guarantee is marginal (over calibration draws): the mean over 200 draws sits within its noise of 1 - α.
    assert 1 - alpha - 0.01 <= mean <= 1 - alpha + 0.03


def test_risk_coverage_ranks_by_confidence_and_averages_ties():
    rows = [
        {"confidence": 0.9, "correct": True},
        {"confidence": 0.8, "correct": True},
        {"confidence": 0.3, "correct": False},
        {"confidence": 0.3, "correct": True},
        {"confidence": None, "correct": False},  # no confidence: not ranked
    ]
    curve = risk_coverage(rows)
    assert curve["n"] == 4 and curve["random_aurc"] == pytest.approx(0.25)
    assert curve["risk"] == pytest.approx([0.0, 0.0, 0.5 / 3, 0.25])
    assert curve["aurc"] < curve["random_aurc"]
    assert risk_coverage([{"confidence": None}]) is None


def test_abstention_says_why():
    assert abstention(0.8, 0.5) is None and abstention(0.8, None) is None
    assert "0.300 is below the threshold 0.5" in abstention(0.3, 0.5)
    assert "no confidence" in abstention(None, 0.5)
    with pytest.raises(ValueError, match="abstain-below"):
        Selective(abstain_below=1.5)


def _config(system="cot", **settings):
    return EvalConfig.for_graph(system, {"respondent_model": "scripted:ermedrag.testing.scripted", **settings})


def test_a_calibration_is_saved_with_its_configuration_and_refused_for_another(tmp_path):
    config = _config()
    rows = _draw(random.Random(1), 50)
    calibration = fit(rows, 0.1, {**config.record(), "config_key": config.key()})
    path = calibration.save(tmp_path / "calibration.json")
    loaded = load_calibration(path)
    assert loaded == calibration
    loaded.check(config)
    with pytest.raises(ValueError, match="temperature=0.0 \\(this run: 0.7\\)"):
        loaded.check(_config(temperature=0.7))
    with pytest.raises(ValueError, match="graph cot \\(this run: vanilla_rag\\)"):
        loaded.check(_config("vanilla_rag"))
    fields = Selective(loaded, 0.5).fields({"A": 0.9, "B": 0.1}, 0.9)
    assert fields["answer_set_alpha"] == 0.1 and fields["answer_set"][0] == "A" and fields["abstained"] is False


def test_too_few_questions_give_every_option_and_survive_a_round_trip(tmp_path):
    config = _config()
    calibration = fit(_draw(random.Random(2), 5), 0.05, {**config.record(), "config_key": config.key()})
    assert calibration.threshold == math.inf
    loaded = load_calibration(calibration.save(tmp_path / "c.json"))
    assert loaded.threshold == math.inf and len(loaded.answer_set({"A": 0.9, "B": 0.05, "C": 0.05})) == 3


@pytest.mark.parametrize(
    "content, message", [("", "cannot be read"), ("{}", "not a version-1"), (None, "does not exist")]
)
def test_bad_calibration_files_are_named(tmp_path, content, message):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_calibration(path)


def test_fitting_without_scored_answers_says_what_is_missing():
    with pytest.raises(ValueError, match="no answered multiple-choice questions with option probabilities"):
        fit([{"gold": "A", "option_probs": None}], 0.1, {"system": "cot", "config_key": "k"})


def test_calibration_dataclass_keeps_its_fields():
    c = Calibration("cot", "k", {}, "respondent@2", 0.1, 0.5, 10, ["medqa"])
    assert c.answer_set(None) is None and c.answer_set({"A": 0.6, "B": 0.4}) == ["A"]  # 1 - 0.4 > 0.5
