"""Citation precision and recall against gold evidence (`evals.report.evidence.citation_scores`)."""

from __future__ import annotations

from ermedrag.evals.report.evidence import citation_scores, evidence_summary
from ermedrag.tools.data.gold_evidence import GoldEvidence

GOLD = GoldEvidence(prefix="pubmed-42-")


def test_precision_over_cited_shown_items_and_recall_over_gold_shown():
    row = {
        "citations": [
            {"number": 1, "shown": True, "doc_id": "pubmed-42-0"},
            {"number": 2, "shown": True, "doc_id": "pubmed-7-0"},
            {"number": 9, "shown": False, "doc_id": None},
        ],
        "evidence_doc_ids": ["pubmed-42-0", "pubmed-42-1", "pubmed-7-0"],
    }
    assert citation_scores(row, GOLD) == (0.5, 0.5)
    assert citation_scores({"citations": [], "evidence_doc_ids": ["pubmed-7-0"]}, GOLD) == (None, None)


def test_summary_scores_pubmedqa_rows_and_skips_benchmarks_without_gold():
    rows = [
        {
            "config_key": "k",
            "benchmark": "pubmedqa",
            "question_id": "pubmedqa-42",
            "citations": [{"number": 1, "shown": True, "doc_id": "pubmed-42-0"}],
            "evidence_doc_ids": ["pubmed-42-0"],
            "confidence": 0.9,
            "correct": True,
        },
        {
            "config_key": "k",
            "benchmark": "medqa",
            "question_id": "q1",
            "citations": [],
            "confidence": 0.2,
            "correct": False,
        },
    ]
    s = evidence_summary(rows)["configurations"]["k"]
    assert (s["citation_precision"], s["n_citation_precision"], s["citation_recall"]) == (1.0, 1, 1.0)
    assert s["cites_shown_rate"] == 0.5 and s["risk_coverage"]["aurc"] == 0.25
