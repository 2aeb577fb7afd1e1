"""The triage-copy bench's measurement with a scripted triage doctor: accuracy, copies and the kept rows."""

from __future__ import annotations

from types import SimpleNamespace

from benches.learning import triage_copy
from ermedrag.agents import triage
from ermedrag.evals.baselines import worked_example_answer

PANEL = "scripted:ermedrag.testing.scripted.panel"


def _question(qid: str, text: str, subject: str) -> SimpleNamespace:
    return SimpleNamespace(id=qid, question=text, options={"A": "x", "B": "y"}, benchmark="medmcqa", subject=subject)


def test_measure_scores_named_specialties_and_counts_copies():
    questions = [
        _question("q1", "Which stain? #triage=Pathologist", "Pathology"),  # right
        _question("q2", "Which rash? #triage=Surgeon", "Skin"),  # a listed specialty, wrong
        _question("q3", "Which lens? #triage=Cardiologist", "Ophthalmology"),  # names nothing listed
    ]
    figures, rows = triage_copy.measure(questions, SimpleNamespace(model=PANEL, concurrency=2))
    assert [r["named"] for r in rows] == ["Pathologist", "Surgeon", None]
    assert (figures["accuracy"]["hits"], figures["named_a_specialty"]["hits"]) == (1, 2)
    examples = [
        worked_example_answer(triage.triage_messages(q.question, q.options, triage.SPECIALTIES)) for q in questions
    ]
    assert [r["example"] for r in rows] == examples and all(e not in triage.SPECIALTIES for e in examples)
    assert figures["copy_rate"]["hits"] == sum(r["answer"] == e for r, e in zip(rows, examples))
    assert figures["baselines"]["copy_example"]["hits"] == 0 and figures["baselines"]["keyword"]["n"] == 3
    assert figures["beats_every_baseline"] is False  # 1 of 3 is inside every baseline's interval
