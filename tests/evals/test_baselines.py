"""Trivial baselines beside every accuracy: what a constant answer, the first option or a copied example score."""

from __future__ import annotations

import pytest

from ermedrag.agents import respondent, triage
from ermedrag.agents.base import to_chat
from ermedrag.evals.baselines import (
    beats_baselines,
    modal_share,
    paired_change,
    share,
    trivial_baselines,
    worked_example_answer,
)


def test_the_worked_example_answer_is_read_from_messages_or_chat_rows():
    options = {"A": "Insulin", "B": "Metformin", "C": "Diet"}
    messages = respondent.build_messages("Which drug first?", options, "")
    example = worked_example_answer(messages)
    assert example in options and worked_example_answer(to_chat(messages)) == example
    shown = worked_example_answer(triage.triage_messages("A rash?", None, triage.SPECIALTIES))
    assert shown in triage.TRIAGE_EXAMPLES and shown not in triage.SPECIALTIES
    assert worked_example_answer(triage.triage_messages("Any?", None, tuple(triage.TRIAGE_EXAMPLES))) is None


def test_baselines_on_a_set_whose_golds_lean_one_way():
    golds = ["A", "A", "A", "B"]
    options = [["A", "B"], ["A", "B"], ["A", "B", "C"], ["A", "B", "C", "D"]]
    prompts = [[{"role": "system", "content": "s"}, {"role": "assistant", "content": f"<answer>{g}</answer>"},
                {"role": "user", "content": "q"}] for g in ("A", "B", "B", "B")]  # fmt: skip
    baselines = trivial_baselines(golds, options, prompts)
    assert baselines["chance"] == pytest.approx((0.5 + 0.5 + 1 / 3 + 0.25) / 4, abs=1e-4)
    assert (baselines["majority"]["hits"], baselines["first_option"]["hits"], baselines["copy_example"]["hits"]) == (
        3,
        3,
        2,
    )
    assert "copy_example" not in trivial_baselines(golds, options)  # no prompts, no example to copy
    assert modal_share(["A", "A", None, "B"]) == 0.5 and modal_share([]) is None


def test_a_gain_counts_only_above_the_strongest_baselines_interval():
    baselines = {"chance": 0.25, "majority": share(25, 48)}  # always-yes on 25 of 48
    assert baselines["majority"]["ci95"][0] < 0.521 < baselines["majority"]["ci95"][1]
    assert not beats_baselines(0.521, baselines) and not beats_baselines(0.6, baselines)
    assert beats_baselines(0.7, baselines) and not beats_baselines(None, baselines)


def test_questions_without_a_gold_answer_favour_no_constant_and_answers_compare_by_name():
    golds = [None, None, None, "B"]
    baselines = trivial_baselines(golds, [["A", "B"]] * 4)
    assert baselines["majority"]["hits"] == 1 and baselines["first_option"]["hits"] == 0  # None is no answer
    prompts = [[{"role": "system", "content": "s"}, {"role": "assistant", "content": "<answer>radiologist </answer>"},
                {"role": "user", "content": "q"}]]  # fmt: skip
    assert trivial_baselines(["Radiologist"], [["Radiologist"]], prompts)["copy_example"]["hits"] == 1


def test_balanced_positions_put_each_gold_at_every_position_equally_often():
    from collections import Counter

    from ermedrag.evals.baselines import balanced_positions
    from ermedrag.tools.data.benchmarks import Question

    questions = [
        Question(id=f"q{i}", question="?", options={k: f"t{i}{k}" for k in "ABCD"}, answer="A", benchmark="x")
        for i in range(8)
    ]
    balanced = balanced_positions(questions)
    assert Counter(q.answer for q in balanced) == {"A": 2, "B": 2, "C": 2, "D": 2}
    for before, after in zip(questions, balanced):
        assert after.options[after.answer] == before.options[before.answer]  # the same gold text
        assert sorted(after.options.values()) == sorted(before.options.values())
        assert list(after.options) == list("ABCD")
    assert (
        trivial_baselines([q.answer for q in balanced], [list(q.options) for q in balanced])["majority"]["rate"] == 0.25
    )


def test_balanced_by_answer_takes_each_gold_in_turn_and_only_what_exists():
    from collections import Counter

    from ermedrag.evals.baselines import balanced_by_answer
    from ermedrag.tools.data.benchmarks import Question

    golds = "AAAAAAABBBC"
    questions = [
        Question(id=f"q{i}", question="?", options={"A": "yes", "B": "no", "C": "maybe"}, answer=g, benchmark="x")
        for i, g in enumerate(golds)
    ]
    six = balanced_by_answer(questions, 6)
    assert Counter(q.answer for q in six) == {"A": 3, "B": 2, "C": 1}  # one C exists: its turns go to the others
    three = balanced_by_answer(questions, 3)
    assert [q.answer for q in three] == ["A", "B", "C"] and three[0].id == "q0"  # the first of each, in order
    assert len(balanced_by_answer(questions, 50)) == len(questions)


def test_paired_change_counts_discordant_questions_and_tests_them_exactly() -> None:
    before = [True, True, False, False, True]
    after = [True, False, True, True, True]
    change = paired_change(before, after)
    assert (change["right_before"], change["right_after"]) == (3, 4)
    assert (change["right_before_only"], change["right_after_only"]) == (1, 2)
    assert change["mcnemar_p"] == 1.0  # 1 against 2: a coin does that most of the time
    lopsided = paired_change([False] * 10, [True] * 10)
    assert lopsided["mcnemar_p"] == round(2 / 2**10, 4)  # all ten one way
    assert paired_change([], [])["mcnemar_p"] == 1.0  # nothing discordant, nothing shown
    with pytest.raises(ValueError, match="3 and 2"):
        paired_change([True] * 3, [True] * 2)
