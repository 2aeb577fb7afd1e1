"""MMedAgent-RL in `ermedrag eval`: rows carry triage correctness (gold specialty from the benchmark's metadata),
the curriculum bucket and the specialists' majority; the report's panel section compares attending and majority."""

from __future__ import annotations

import json

from ermedrag.evals.panel import panel_summary
from ermedrag.evals.report import write_report
from ermedrag.evals.runner import RESULTS, run_eval
from ermedrag.tools.records.jsonl import read_records

PANEL = "scripted:ermedrag.testing.scripted.panel"
QUESTIONS = [
    # MedMCQA subject Pathology → Pathologist: triage says Pathologist (right), all specialists right (easy)
    {
        "id": "q1",
        "question": "Granuloma type? #triage=Pathologist #answers=A,A,A",
        "subject": "Pathology",
        "options": {"A": "Caseating", "B": "Non-caseating"},
        "answer": "A",
    },
    # Radiology → Radiologist: triage says Surgeon (wrong); specialists 2 of 3 wrong (medium); attending follows
    {
        "id": "q2",
        "question": "Best first scan? #triage=Surgeon #answers=A,B,B",
        "subject": "Radiology",
        "options": {"A": "CT", "B": "MRI"},
        "answer": "A",
    },
    # Medicine maps to no specialty: unlabelled, never counted wrong; no specialist right (hard)
    {
        "id": "q3",
        "question": "First-line drug? #answers=B,B,B",
        "subject": "Medicine",
        "options": {"A": "Metformin", "B": "Insulin"},
        "answer": "A",
    },
]


def test_panel_rows_and_report(tmp_path):
    questions = tmp_path / "medmcqa_panel.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp_path / "out"
    run_eval(
        ["mmedagent"],
        [str(questions)],
        PANEL,
        out,
        trace_db=str(tmp_path / "t.sqlite"),
        progress=False,
        specialist_model=PANEL,
        triage_model=PANEL,
        attending_model=PANEL,
    )
    rows = {r["question_id"]: r for r in read_records(out / RESULTS)}
    assert rows["q1"]["gold_specialty"] == "Pathologist" and rows["q1"]["triage_correct"] is True
    assert rows["q2"]["gold_specialty"] == "Radiologist" and rows["q2"]["triage_correct"] is False
    assert rows["q3"]["gold_specialty"] is None and rows["q3"]["triage_correct"] is None
    assert [rows[q]["bucket"] for q in ("q1", "q2", "q3")] == ["easy", "medium", "hard"]
    assert rows["q2"]["majority"] == "B" and not rows["q2"]["majority_correct"] and rows["q2"]["followed_majority"]

    (summary,) = panel_summary(list(rows.values())).values()
    assert summary["triage"]["n"] == 2 and summary["triage"]["rate"] == 0.5 and summary["triage"]["unlabelled"] == 1
    assert summary["buckets"] == {"easy": 1, "medium": 1, "hard": 1, "unknown": 0}
    assert summary["majority_vote"]["rate"] == summary["attending"]["rate"] == 1 / 3

    written = write_report([str(out)], tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Panel (MMedAgent-RL)" in text and "50.0" in text and "| 1 / 1 / 1 |" in text
    recorded = json.loads((tmp_path / "report" / "summary.json").read_text())["panel"]
    assert list(recorded.values())[0]["triage"]["rate"] == 0.5 and written["rows"] == 3


def test_no_panel_rows_no_section():
    assert panel_summary([{"config_key": "k", "correct": True, "benchmark": "b", "question_id": "q"}]) is None


def test_a_fallback_to_the_gold_specialty_is_no_correct_triage(tmp_path):
    """Triage that names nothing listed (e.g. a copied worked example) falls back to the default specialty, the
    first listed (Pathologist); when that is the gold one it is luck, not triage."""
    question = {
        "id": "q4",
        "question": "Which stain? #triage=Cardiologist #answers=A,A,A",
        "subject": "Pathology",
        "options": {"A": "PAS", "B": "Gram"},
        "answer": "A",
    }
    questions = tmp_path / "medmcqa_fallback.jsonl"
    questions.write_text(json.dumps(question) + "\n")
    run_eval(
        ["mmedagent"], [str(questions)], PANEL, tmp_path / "out", trace_db=str(tmp_path / "t.sqlite"), progress=False
    )
    (row,) = read_records(tmp_path / "out" / RESULTS)
    assert (row["specialty"], row["gold_specialty"], row["triage_fell_back"]) == ("Pathologist",) * 2 + (True,)
    assert row["triage_correct"] is False
