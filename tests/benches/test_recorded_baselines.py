"""Baselines added to learning records made before the benches recorded their own (recorded_baselines.py)."""

from __future__ import annotations

from ermedrag.agents import respondent
from ermedrag.tools.data.benchmarks import Question
from tests.benches.test_learning_bench import bench_module


def _questions() -> list[Question]:
    return [
        Question(
            id=f"q{i}",
            question=f"Question {i}?",
            options={"A": "yes", "B": "no", "C": "maybe"},
            answer=gold,
            benchmark="pubmedqa_train",
        )
        for i, gold in enumerate("AAABBC")
    ]


def test_copy_example_counts_the_questions_whose_rotated_example_answer_is_the_gold() -> None:
    bench = bench_module("recorded_baselines")
    questions = _questions()
    block = bench.question_baselines(questions, "toy")
    copies = sum(respondent.example_options(q.question, q.options)[1] == q.answer for q in questions)
    assert block["copy_example"]["hits"] == copies and block["copy_example"]["n"] == 6
    assert block["majority"]["hits"] == 3 and block["chance"] == round(1 / 3, 4)
    assert "not kept" in block["modal_answer_share"]


def test_verdicts_name_each_accuracy_and_only_one_above_every_interval_beats() -> None:
    bench = bench_module("recorded_baselines")
    block = bench.question_baselines(_questions(), "toy")
    summary = {"accuracy": {"before": 0.5, "after": {"values": [0.5, 1.0]}}}
    assert bench.verdicts(bench.seed_accuracies(summary), block) == {
        "before": False,
        "after seed 0": False,
        "after seed 1": True,
    }
