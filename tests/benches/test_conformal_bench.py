"""The conformal bench's arithmetic: disjoint splits, and coverage on questions whose gold is known."""

from __future__ import annotations

import random

from benches.conformal import figures, split


def _rows(n: int, seed: int) -> list[dict]:
    """Answers of a model that gives its gold option probability 0.7 two times in three, else 0.1."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        gold = rng.choice("ABCD")
        p_gold = 0.7 if rng.random() < 2 / 3 else 0.1
        rest = (1 - p_gold) / 3
        probs = {key: (p_gold if key == gold else rest) for key in "ABCD"}
        answer = max(probs, key=probs.get)
        rows.append(
            {
                "question_id": f"q{i}",
                "gold": gold,
                "option_probs": probs,
                "confidence": probs[answer],
                "answer": answer,
                "correct": answer == gold,
            }
        )
    return rows


def test_calibration_and_test_questions_are_disjoint_and_cover_all():
    rows = _rows(50, 0)
    calibration, test = split(rows, 20, seed=3)
    ids = [r["question_id"] for r in calibration + test]
    assert len(calibration) == 20 and len(set(ids)) == 50


def test_sets_cover_at_the_asked_rate_and_shrink_as_alpha_grows():
    strict, loose = figures(_rows(1200, 1), [0.1, 0.4], n_calibration=400, seed=0, splits=20)
    assert strict["n_test"] == 800 and strict["coverage_holds"] and loose["coverage_holds"]
    # a third of the gold options have p = 0.1: at α = 0.1 the threshold must let them in (every option of
    # those questions); at α = 0.4 only the 0.7 options are needed, and their sets are singletons
    assert strict["mean_set_size"] > loose["mean_set_size"] and loose["singleton_rate"] > 0.9
    assert abs(strict["modal_answer_share"] - 0.25) < 0.05


def _graded_rows(n: int, seed: int) -> list[dict]:
    """Answers whose gold option's probability is spread evenly over (0, 1): every split fits another threshold."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        gold, p_gold = rng.choice("ABCD"), rng.random()
        probs = {key: (p_gold if key == gold else (1 - p_gold) / 3) for key in "ABCD"}
        rows.append({"question_id": f"q{i}", "gold": gold, "option_probs": probs, "confidence": max(probs.values())})
    return rows


def test_coverage_is_judged_over_random_splits_and_the_seeded_split_is_kept_apart():
    """200 + 200 questions: one split's coverage wanders around 1 - α; the mean over splits is what is guaranteed."""
    (row,) = figures(_graded_rows(400, 2), [0.2], n_calibration=200, seed=0, splits=50)
    spread = row["over_splits"]
    assert spread["splits"] == 50 and 0.005 < spread["coverage"]["sd"] < 0.1
    assert abs(spread["coverage"]["mean"] - 0.8) < 0.03 and row["coverage_holds"]
    (alone,) = figures(_graded_rows(400, 2), [0.2], n_calibration=200, seed=0, splits=1)
    assert row["coverage"] == alone["coverage"] == alone["over_splits"]["coverage"]["mean"]
