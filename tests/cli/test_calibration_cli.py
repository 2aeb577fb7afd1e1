"""Conformal sets and abstention through the command line: eval the calibration questions, `ermedrag calibrate`,
then `ask` and `eval` with the calibration (and refused with another configuration's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_cli import ermedrag

CITER = "scripted:ermedrag.testing.scripted.citer"


def _questions(path: Path, n: int) -> Path:
    """n questions whose gold option is the first (the citer's 0.6), second (0.3) or third (0.1) in turn."""
    rows = [
        {
            "id": f"q{i}",
            "question": f"Question number {i}: which option?",
            "options": {"A": "first", "B": "second", "C": "third"},
            "answer": "ABC"[i % 3],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_calibrate_then_ask_and_eval_with_answer_sets(tmp_path: Path) -> None:
    traces = tmp_path / "traces.sqlite"
    questions = _questions(tmp_path / "q.jsonl", 12)
    run = ermedrag(
        "eval",
        "--system",
        "cot",
        "--bench",
        str(questions),
        "--model",
        CITER,
        "--out",
        str(tmp_path / "cal"),
        trace_db=traces,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "cal" / "results.jsonl").read_text().splitlines()]
    assert all(r["option_probs"] == pytest.approx({"A": 0.6, "B": 0.3, "C": 0.1}) for r in rows)

    # alpha=0.4: nonconformity 0.4, 0.7 or 0.9 in thirds; ceil(13 * 0.6) = 8th smallest of 12 is 0.7: {A, B}.
    fitted = ermedrag(
        "calibrate", str(tmp_path / "cal"), "--alpha", "0.4", "-o", str(tmp_path / "c.json"), trace_db=traces
    )
    assert fitted.returncode == 0, fitted.stderr
    assert "calibrated cot on 12 questions" in fitted.stdout and "average 2.00 options" in fitted.stdout
    assert json.loads((tmp_path / "c.json").read_text())["threshold"] == pytest.approx(0.7)

    asked = ermedrag(
        "ask",
        "Which option?",
        "-o",
        "A=first",
        "-o",
        "B=second",
        "-o",
        "C=third",
        "--graph",
        "cot",
        "--model",
        CITER,
        "--calibration",
        str(tmp_path / "c.json"),
        "--abstain-below",
        "0.7",
        trace_db=traces,
    )
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert "Answer set (60% conformal): A, B" in asked.stdout
    assert "Confidence: 0.600" in asked.stdout
    assert "ABSTAINED: confidence 0.600 is below the threshold 0.7 (the withheld answer: A)" in asked.stdout

    evaluated = ermedrag(
        "eval",
        "--system",
        "cot",
        "--bench",
        str(_questions(tmp_path / "t.jsonl", 3)),
        "--model",
        CITER,
        "--out",
        str(tmp_path / "test"),
        "--calibration",
        str(tmp_path / "c.json"),
        trace_db=traces,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    test_rows = [json.loads(line) for line in (tmp_path / "test" / "results.jsonl").read_text().splitlines()]
    assert [r["answer_set"] for r in test_rows] == [["A", "B"]] * 3

    other = ermedrag(
        "ask",
        "Which option?",
        "-o",
        "A=first",
        "-o",
        "B=second",
        "--graph",
        "cot",
        "--model",
        CITER,
        "--temperature",
        "0.5",
        "--calibration",
        str(tmp_path / "c.json"),
        trace_db=traces,
    )
    assert other.returncode == 2
    assert other.stderr.strip() == (
        "error: this calibration was fitted for another configuration: temperature=0.0 (this run: 0.5); fit one "
        "for this configuration with `ermedrag calibrate`"
    )


def test_report_shows_citations_and_risk_coverage(tmp_path: Path) -> None:
    from ermedrag.evals.report import write_report

    traces = tmp_path / "traces.sqlite"
    questions = _questions(tmp_path / "q.jsonl", 6)
    for system in ("cot", "vanilla_rag"):
        run = ermedrag(
            "eval",
            "--system",
            system,
            "--bench",
            str(questions),
            "--model",
            CITER,
            "--out",
            str(tmp_path / "r"),
            "--abstain-below",
            "0.5",
            trace_db=traces,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    written = write_report([str(tmp_path / "r")], tmp_path / "r")
    text = Path(written["report"]).read_text()
    section = text[text.index("## Evidence and uncertainty") :]
    # vanilla_rag cites [2] and the first line's id (shown) and [9] (not shown): both rates 1; cot was shown
    # nothing, so it only cites what it was not shown. Every answer is A at 0.6, right a third of the time: a
    # confidence that ranks nothing, so AURC equals random abstention's (ties share their errors).
    assert "| cot | 0.000 | 1.000 | – (0) | – (0) | 0.667 | 0.667 | 6 |" in section
    assert "| vanilla_rag | 1.000 | 1.000 | – (0) | – (0) | 0.667 | 0.667 | 6 |" in section
    assert "answered 1.000 of 6 questions" in section
    assert any(p.endswith("risk_coverage.png") for p in written["plots"])
