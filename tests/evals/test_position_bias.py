"""Position bias over result rows: the orders, the mapping back, the summary and its markdown section.

The rows are written here by hand (the runner's rows are checked end to end in tests/evals/test_eval_runner.py).
"""

from __future__ import annotations

import itertools

import pytest

from ermedrag.evals.metrics import original_order_rows
from ermedrag.evals.position_bias import (
    option_orders,
    original_key,
    position_bias_section,
    position_bias_summary,
    rotate_options,
    shown_key,
)

KEYS = ["A", "B", "C", "D"]


def test_rotation_moves_the_texts_and_keys_map_both_ways():
    options = {"A": "a", "B": "b", "C": "c", "D": "d"}
    assert rotate_options(options, 0) == options
    assert rotate_options(options, 1) == {"A": "b", "B": "c", "C": "d", "D": "a"}
    for order, original in itertools.product(range(4), KEYS):
        shown = shown_key(KEYS, original, order)
        assert rotate_options(options, order)[shown] == options[original]  # the same text stands there
        assert original_key(KEYS, shown, order) == original
    assert original_key(KEYS, None, 2) is None and original_key(KEYS, "E", 1) is None
    assert shown_key(KEYS, "E", 1) is None
    assert [option_orders(options, n) for n in (1, 3, 9)] == [1, 3, 4] and option_orders(None, 4) == 1


def _row(
    question: str,
    order: int,
    answer: str | None,
    gold: str = "A",
    *,
    orders: int = 2,
    sample: int = 0,
    config_key: str = "k1",
    system: str = "cot",
) -> dict:
    shown = shown_key(KEYS, answer, order)
    return {
        "config_key": config_key,
        "config": {"system": system, "model": "m"},
        "benchmark": "b",
        "question_id": question,
        "sample": sample,
        "order": order,
        "orders": orders,
        "gold": gold,
        "answer": answer,
        "correct": answer == gold,
        "answer_position": shown,
        "gold_position": shown_key(KEYS, gold, order),
    }


def test_no_summary_without_permuted_rows():
    rows = [_row("q1", 0, "A", orders=1), {"config_key": "old", "config": {}, "answer": "A", "correct": True}]
    assert position_bias_summary(rows) is None and position_bias_section(rows) == ""
    assert original_order_rows(rows + [_row("q1", 1, "A")]) == rows


def test_summary_counts_orders_consistency_and_positions():
    rows = [
        _row("q1", 0, "A"),
        _row("q1", 1, "A"),  # the same text in both orders: consistent
        _row("q2", 0, "A"),
        _row("q2", 1, "B"),  # changed its answer when the order changed
        _row("q3", 0, None),
        _row("q3", 1, None),  # never parsed: never consistent
        _row("q4", 0, "A"),  # order 1 missing (failed): left out of consistency
        _row("q1", 0, "C", config_key="k2", system="rag"),
        _row("q1", 1, "C", config_key="k2", system="rag"),
        _row("q9", 0, "A", orders=1, config_key="k3"),  # a configuration that was not permuted: no entry
    ]
    summary = position_bias_summary(rows)
    assert set(summary) == {"k1", "k2"}
    cot = summary["k1"]
    assert (cot["system"], cot["model"], cot["orders"]) == ("cot", "m", 2)
    assert [(o["order"], o["n"], o["correct"]) for o in cot["by_order"]] == [(0, 4, 3), (1, 3, 1)]
    assert cot["consistency"] == {"questions": 3, "consistent": 1, "rate": pytest.approx(1 / 3)}
    positions = cot["positions"]
    # Gold "A" stands at A in order 0 and at D in order 1; the answers stood at A, A, D, A, A (q2 order 1 'B' is A).
    assert positions["gold"] == {"A": 3, "D": 2} and positions["chosen"] == {"A": 4, "D": 1}
    assert positions["n"] == 5 and positions["unanswered"] == 2
    assert positions["total_variation"] == pytest.approx(0.5 * (1 + 1) / 5)
    assert positions["accuracy_by_gold_position"]["A"] == {"n": 4, "accuracy": 0.75}
    assert summary["k2"]["consistency"]["rate"] == 1.0


def test_samples_are_compared_order_by_order_separately():
    rows = [
        _row("q1", 0, "A", sample=0),
        _row("q1", 1, "A", sample=0),
        _row("q1", 0, "B", sample=1),
        _row("q1", 1, "A", sample=1),
    ]
    assert position_bias_summary(rows)["k1"]["consistency"] == {"questions": 2, "consistent": 1, "rate": 0.5}


def test_section_says_what_it_shows_and_what_it_cannot():
    rows = [_row("q1", 0, "A"), _row("q1", 1, "B"), _row("q2", 0, "A"), _row("q2", 1, "A")]
    text = position_bias_section(rows)
    assert "## Position bias" in text
    assert "| cot | m | 100.0 [34–100] (n=2) | 50.0 [9–91] (n=2) | 50.0 (n=2) | 0.250 |" in text
    assert "| cot | m | A | 3 | 2 | 100.0 (n=2) |" in text and "| cot | m | D | 1 | 2 | 50.0 (n=2) |" in text
    for caveat in ("only cyclic shifts", "sampling noise", "temperature > 0", "noise"):
        assert caveat in text
