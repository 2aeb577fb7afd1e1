"""Every retrieval of every graph is a retrieval event of its run; the trace store keeps older databases.

The graphs run with the scripted chat models on the starter index (Med-R³ on a tiny index of its own where the
gold evidence must be known).
"""

from __future__ import annotations

import gzip
import json
import sqlite3
from pathlib import Path

import pytest

from ermedrag.evals import rag_quality as rq
from ermedrag.evals.rows import respondent_stats
from ermedrag.graphs.baselines import cot, vanilla_rag
from ermedrag.graphs.er_medrag import graph as er_medrag
from ermedrag.graphs.med_r3 import graph as med_r3
from ermedrag.tools.data import gold_evidence as ge
from ermedrag.tools.retrieval.encoder import DEFAULT_ENCODER
from ermedrag.tools.retrieval.index import open_index
from ermedrag.tools.retrieval.search import (
    COARSE_K,
    DEFAULT_CONFIG,
    SNIPPETS_K,
    retrieval_settings,
    search,
    coarse_k_for,
)
from ermedrag.tools.data.starter_kb import starter_index_dir
from ermedrag.tools.records.traces import RetrievalEvent, TraceEvent, TraceStore
from tests.conftest import SCRIPTED

QUESTION = {
    "question": "Which drug is first-line for type 2 diabetes in adults?",
    "options": {"A": "Metformin", "B": "Insulin"},
    "gold": "A",
}
SEARCH_K = 2


def snippet_ids(retrieval: dict) -> list[str]:
    return [s["id"] for s in retrieval["snippets"]]


@pytest.mark.parametrize("graph", [er_medrag, vanilla_rag], ids=["er_medrag", "vanilla_rag"])
def test_rag_graphs_record_their_retrieval(scripted_context, graph):
    state = graph.invoke(QUESTION, context=scripted_context)
    store = TraceStore(scripted_context["trace_db"])
    (retrieval,) = store.retrievals(state["run_id"])
    assert (retrieval["node"], retrieval["query"], retrieval["seq"]) == ("retrieve", QUESTION["question"], 0)
    assert snippet_ids(retrieval) == [s["id"] for s in state["snippets"]]
    assert [(s["doc_id"], s["chunk_id"], s["score"], s["scores"]) for s in retrieval["snippets"]] == [
        (s["doc_id"], s["chunk_id"], s["score"], s["scores"]) for s in state["snippets"]
    ]
    assert retrieval["settings"] == retrieval_settings(SNIPPETS_K, COARSE_K, DEFAULT_CONFIG)
    assert retrieval["settings"]["fine_policy"] == "per_chunk" and retrieval["settings"]["reranker"] is None
    assert retrieval["index_info"] == {
        "directory": str(starter_index_dir()),
        "encoder": DEFAULT_ENCODER,
        "chunks": open_index(starter_index_dir()).size,
    }
    assert 0 < retrieval["latency_s"] == state["timings"]["retrieve_s"]
    # The model calls are recorded as before: no retrieval among them.
    assert "retriever" not in {e["agent"] for e in store.events(run_id=state["run_id"])}
    assert store.runs()[0]["n_retrievals"] == 1


def test_cot_records_no_retrieval(scripted_context):
    state = cot.invoke(QUESTION, context=scripted_context)
    store = TraceStore(scripted_context["trace_db"])
    assert store.retrievals(state["run_id"]) == [] and store.runs()[0]["n_retrievals"] == 0
    assert rq.retrieved_ids(store, state["run_id"]) == []


def _med_r3_context(tmp_path: Path, model: str = SCRIPTED, **extra) -> dict:
    return {"respondent_model": model, "trace_db": str(tmp_path / "t.sqlite"), "search_k": SEARCH_K, **extra}


def test_med_r3_records_each_search(tmp_path):
    context = _med_r3_context(tmp_path)
    state = med_r3.invoke(QUESTION, context=context)
    retrievals = TraceStore(context["trace_db"]).retrievals(state["run_id"])
    assert len(retrievals) == len(state["searches"]) == 2
    assert [r["node"] for r in retrievals] == ["search", "search"] and [r["seq"] for r in retrievals] == [0, 1]
    assert [(r["query"], snippet_ids(r)) for r in retrievals] == [
        (s["query"], s["snippet_ids"]) for s in state["searches"]
    ]
    settings = retrieval_settings(SEARCH_K, coarse_k_for(SEARCH_K, COARSE_K), DEFAULT_CONFIG)
    assert all(r["settings"] == settings for r in retrievals)
    # The graph's search is the training rollout's `tools.retrieval.search`.
    index = open_index(starter_index_dir())
    assert [snippet_ids(r) for r in retrievals] == [
        [s["id"] for s in search(index, r["query"], k=SEARCH_K, coarse_k=COARSE_K)] for r in retrievals
    ]


def test_med_r3_records_only_the_searches_it_runs(tmp_path):
    context = _med_r3_context(tmp_path, "scripted:ermedrag.testing.scripted.searcher", max_searches=3)
    state = med_r3.invoke(QUESTION, context=context)
    retrievals = TraceStore(context["trace_db"]).retrievals(state["run_id"])
    assert [r["query"] for r in retrievals] == [s["query"] for s in state["searches"]] and len(retrievals) == 3


def test_rag_quality_scores_a_med_r3_run(tmp_path):
    """Med-R³ on a tiny index whose passages are PubMedQA abstracts: context precision and recall of its searches."""
    from ermedrag.tools.retrieval.corpus import Document
    from ermedrag.tools.retrieval.index import build_index

    passages = {
        "pubmed-111-0": "Metformin is the first-line drug for type 2 diabetes in adults.",
        "pubmed-111-1": "Adults with type 2 diabetes start metformin unless kidney function is poor.",
        "pubmed-222-0": "Insulin is used in type 1 diabetes and in pregnancy.",
        "pubmed-333-0": "Warfarin needs INR monitoring.",
    }
    build_index([Document(id=i, title="t", text=t) for i, t in passages.items()], tmp_path / "index", progress=False)
    corpora = tmp_path / "corpora"
    corpora.mkdir()
    with gzip.open(corpora / ge.PUBMEDQA_CORPUS, "wt") as handle:
        for passage_id, text in passages.items():
            handle.write(
                json.dumps({"id": passage_id, "title": "t", "text": text, "pmid": passage_id.split("-")[1]}) + "\n"
            )
    context = _med_r3_context(tmp_path, index_dir=str(tmp_path / "index"))
    state = med_r3.invoke(QUESTION, context=context)
    results = tmp_path / rq.RESULTS
    results.write_text(
        json.dumps(
            {
                "config": {"system": "med_r3", "model": SCRIPTED},
                "benchmark": "pubmedqa",
                "question_id": "pubmedqa-111",
                "run_id": state["run_id"],
            }
        )
        + "\n"
    )

    report = rq.rag_quality(results, context["trace_db"], corpus_dir=corpora)

    retrieved = list(dict.fromkeys(ge.doc_id(i) for s in state["searches"] for i in s["snippet_ids"]))
    assert rq.retrieved_ids(context["trace_db"], state["run_id"]) == retrieved
    gold = {"pubmed-111-0", "pubmed-111-1"}
    (group,) = report["groups"]
    assert (group["system"], group["benchmark"], group["n"], group["n_recall"]) == ("med_r3", "pubmedqa", 1, 1)
    assert group["context_precision"] == pytest.approx(len(gold & set(retrieved)) / len(retrieved))
    assert group["context_recall"] == pytest.approx(len(gold & set(retrieved)) / len(gold))
    assert group["context_recall"] > 0


def _old_store(path: Path) -> None:
    """A trace database as written before events kept their inputs and before retrievals were recorded."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE runs (run_id TEXT PRIMARY KEY, graph TEXT NOT NULL, question TEXT NOT NULL, gold TEXT,
                           answer TEXT, created_at REAL NOT NULL, finished_at REAL);
        CREATE TABLE events (event_id TEXT PRIMARY KEY, run_id TEXT NOT NULL, seq INTEGER NOT NULL,
                             node TEXT NOT NULL, agent TEXT NOT NULL, model TEXT NOT NULL, sampling TEXT NOT NULL,
                             messages TEXT NOT NULL, completion TEXT NOT NULL, parsed TEXT, usage TEXT,
                             logprobs TEXT, latency_s REAL NOT NULL, gold TEXT, created_at REAL NOT NULL);
        INSERT INTO runs VALUES ('old', 'er_medrag', '{"question": "q"}', 'A', '{"answer": "A"}', 1.0, 2.0);
        INSERT INTO events VALUES ('e0', 'old', 0, 'respond', 'respondent', 'm', '{}', '[]', 'done', 'null',
                                   '{"output_tokens": 7}', 'null', 0.5, 'A', 1.5);
    """)
    db.commit()
    db.close()


def test_an_older_store_opens_and_keeps_its_events(tmp_path):
    path = tmp_path / "old.sqlite"
    _old_store(path)
    store = TraceStore(path)
    (event,) = store.events(run_id="old")
    assert (event["agent"], event["completion"], event["usage"], event["inputs"]) == (
        "respondent",
        "done",
        {"output_tokens": 7},
        None,
    )
    assert store.retrievals("old") == [] and store.runs()[0]["n_retrievals"] == 0
    store.add_retrieval(
        RetrievalEvent(run_id="old", node="retrieve", query="q", snippets=[], settings={}, index_info={}, latency_s=0.1)
    )
    assert [r["query"] for r in TraceStore(path).retrievals("old")] == ["q"]


def test_retrievals_leave_model_call_readers_alone(tmp_path):
    """Exporters read events by agent and the runner sums token usage over events: retrievals are in neither."""
    store = TraceStore(tmp_path / "t.sqlite")
    store.start_run("r", "er_medrag", {"question": "q"}, "A")
    store.add_retrieval(
        RetrievalEvent(
            run_id="r",
            node="retrieve",
            query="q",
            latency_s=0.2,
            settings={"k": 1},
            index_info={},
            snippets=[{"id": "d@0-1", "doc_id": "d", "chunk_id": "d#0-9", "score": 1.0, "scores": {}}],
        )
    )
    store.add_event(
        TraceEvent(
            run_id="r",
            node="extract",
            agent="extractor",
            model="m",
            sampling={},
            messages=[],
            completion="[]",
            parsed=None,
            usage={"output_tokens": 3},
            logprobs=None,
            latency_s=0.1,
        )
    )
    store.add_event(
        TraceEvent(
            run_id="r",
            node="respond",
            agent="respondent",
            model="m",
            sampling={},
            messages=[],
            completion="A",
            parsed=None,
            usage={"output_tokens": 4},
            logprobs=None,
            latency_s=0.1,
        )
    )
    assert [e["seq"] for e in store.events(run_id="r")] == [0, 1]
    assert [e["agent"] for e in store.events(agent="extractor")] == ["extractor"]
    assert respondent_stats(store, "r") == {"output_tokens": 7, "token_entropy": None}
    assert store.runs()[0]["n_events"] == 2 and store.runs()[0]["n_retrievals"] == 1
