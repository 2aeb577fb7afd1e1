"""Citations end to end with a scripted model that cites one item it was shown and one it was not: every graph
resolves the first to its evidence and provenance and flags the second; the trace and `ask` show them."""

from __future__ import annotations

import pytest

from ermedrag.views import render_run, render_trace
from ermedrag.graphs.baselines import cot, vanilla_rag
from ermedrag.graphs.er_medrag import graph as er_medrag
from ermedrag.graphs.med_r3 import graph as med_r3
from ermedrag.graphs.mmedagent.graph import graph as mmedagent
from ermedrag.tools.records.traces import TraceStore

CITER = "scripted:ermedrag.testing.scripted.citer"
QUESTION = {
    "question": "Which drug is first-line for type 2 diabetes with normal kidney function?",
    "options": {"A": "Metformin", "B": "Insulin glargine", "C": "Glipizide"},
}


def _context(tmp_path, **extra):
    return {"extractor_model": CITER, "respondent_model": CITER, "trace_db": str(tmp_path / "t.sqlite"), **extra}


def _cited(state):
    return [(c["number"], c["shown"], c["kind"]) for c in state["answer"]["citations"]]


def test_er_medrag_cites_triplets_with_their_snippets_provenance(tmp_path):
    state = er_medrag.invoke(QUESTION, context=_context(tmp_path))
    triplet_snippets = [s["id"] for s in state["snippets"]]  # one triplet per snippet, in retrieval order
    # "[2]", the bracketed snippet id of line 1, "[9]" (4 triplets shown).
    assert _cited(state) == [(2, True, "triplet"), (1, True, "triplet"), (9, False, None)]
    second = state["answer"]["citations"][0]
    snippet = state["snippets"][1]
    assert second["snippet_id"] == triplet_snippets[1]
    assert (second["doc_id"], second["source"], second["start"], second["end"]) == (
        snippet["doc_id"],
        snippet["source"],
        snippet["start"],
        snippet["end"],
    )
    run = TraceStore(_context(tmp_path)["trace_db"]).run(state["run_id"])
    assert run["answer"]["citations"] == state["answer"]["citations"]
    shown = render_trace(run, [], [])
    assert "Cited evidence (3):" in shown and "[9] NOT SHOWN" in shown
    printed = render_run(state, 1.0)
    assert f"doc {snippet['doc_id']} chars {snippet['start']}-{snippet['end']}" in printed


def test_vanilla_rag_cites_snippets_and_cot_has_nothing_to_cite(tmp_path):
    rag = vanilla_rag.invoke(QUESTION, context=_context(tmp_path))
    assert _cited(rag) == [(2, True, "snippet"), (1, True, "snippet"), (9, False, None)]
    assert rag["answer"]["citations"][0]["text"].startswith(rag["snippets"][1]["text"][:50].split()[0])
    alone = cot.invoke(QUESTION, context=_context(tmp_path))
    # No evidence was shown: every number it cites is flagged (the example's line is not evidence).
    assert all(not c["shown"] for c in alone["answer"]["citations"])


def test_med_r3_numbers_documents_across_searches(tmp_path):
    state = med_r3.invoke(QUESTION, context=_context(tmp_path, search_k=3))
    assert "\n1. [" in state["transcript"] and len(state["documents"]) == 3
    assert _cited(state) == [(1, True, "document"), (7, False, None)]
    assert state["answer"]["citations"][0]["snippet_id"] == state["searches"][0]["snippet_ids"][0]


def test_mmedagent_attending_cites_specialists(tmp_path):
    state = mmedagent.invoke(QUESTION, context=_context(tmp_path, specialist_retrieval=True, n_specialists=3))
    assert _cited(state) == [(2, True, "opinion"), (5, False, None)]
    assert state["answer"]["citations"][0]["title"] == f"Specialist 2 ({state['specialty']})"
    specialist_calls = [
        e
        for e in TraceStore(_context(tmp_path)["trace_db"]).events(run_id=state["run_id"])
        if e["agent"] == "specialist"
    ]
    assert len(specialist_calls) == 3


def test_answers_carry_option_probabilities_where_the_backend_scores_them(tmp_path):
    for graph in (cot, vanilla_rag, er_medrag, med_r3):
        state = graph.invoke(QUESTION, context=_context(tmp_path))
        answer = state["answer"]
        assert answer["option_probs"] == pytest.approx({"A": 0.6, "B": 0.3, "C": 0.1}), graph.name
        assert answer["confidence"] == pytest.approx(0.6) and answer["confidence_source"] == "option_logprobs"
        scorer = [
            e
            for e in TraceStore(_context(tmp_path)["trace_db"]).events(run_id=state["run_id"])
            if e["agent"] == "answer_scorer"
        ]
        assert len(scorer) == 1 and scorer[0]["messages"][-1]["content"].lower().endswith("<answer>")
    off = cot.invoke(QUESTION, context=_context(tmp_path, answer_scores=False))
    assert "option_probs" not in off["answer"]
    free_text = cot.invoke({"question": QUESTION["question"]}, context=_context(tmp_path))
    assert "option_probs" not in free_text["answer"]


def test_an_answer_named_by_its_text_gets_no_letter_probabilities(tmp_path):
    """The letters' probabilities where the answer starts describe a choice among letters; an agent that wrote the
    option's text chose among words, so its answer says why it has no confidence instead of a wrong one."""
    texter = "scripted:ermedrag.testing.scripted.text_answer"
    context = {**_context(tmp_path), "extractor_model": texter, "respondent_model": texter}
    for graph in (cot, er_medrag):
        answer = graph.invoke(QUESTION, context=context)["answer"]
        assert answer["answer"] == "A" and answer["option_probs"] is None and answer["confidence"] is None
        assert answer["confidence_source"].startswith("none: the answer names its option by its text"), graph.name
