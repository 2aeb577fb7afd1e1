"""RAG quality: retrieved ids from the traces' retrieval events, gold evidence, ragas ID-based precision/recall,
the judge wiring.

Everything is offline: the judge is a scripted chat model (this module's `reply`), never a remote service.
"""

from __future__ import annotations

import gzip
import json
import math
import warnings
from pathlib import Path

import pytest
from langchain_core.embeddings import Embeddings

from ermedrag.evals import rag_quality as rq
from ermedrag.tools.data import gold_evidence as ge
from ermedrag.tools.records.traces import RetrievalEvent, TraceEvent, TraceStore

JUDGE = "scripted:tests.evals.test_rag_quality"
QUESTION = "Does aspirin inhibit cyclooxygenase?"


def reply(messages) -> str:
    """A scripted ragas judge: answers each ragas prompt in its JSON format (used via `JUDGE`)."""
    prompt = messages[-1].text
    if "GARBLED" in prompt:  # a judge that ignores the format
        return "I think it is fine."
    if "Break down each sentence" in prompt:  # Faithfulness: statements of the response
        return json.dumps({"statements": ["Aspirin inhibits cyclooxygenase.", "Aspirin cures influenza."]})
    if "judge the faithfulness" in prompt:  # Faithfulness: one verdict per statement
        return json.dumps(
            {
                "statements": [
                    {"statement": "Aspirin inhibits cyclooxygenase.", "reason": "stated", "verdict": 1},
                    {"statement": "Aspirin cures influenza.", "reason": "not stated", "verdict": 0},
                ]
            }
        )
    if "Generate a question for the given answer" in prompt:  # ResponseRelevancy
        return json.dumps({"question": QUESTION, "noncommittal": 0})
    return "unexpected prompt"


def event(run_id: str, agent: str, inputs: dict, parsed=None, completion: str = "") -> TraceEvent:
    return TraceEvent(
        run_id=run_id,
        node=agent,
        agent=agent,
        model="scripted",
        sampling={},
        messages=[],
        completion=completion,
        parsed=parsed,
        usage=None,
        logprobs=None,
        latency_s=0.0,
        inputs=inputs,
    )


def retrieval(store: TraceStore, run_id: str, snippet_ids: list[str], node: str = "retrieve") -> None:
    """A retrieval event that returned `snippet_ids`, in this rank order."""
    store.add_retrieval(
        RetrievalEvent(
            run_id=run_id,
            node=node,
            query="q",
            latency_s=0.0,
            settings={"k": len(snippet_ids)},
            index_info={},
            snippets=[
                {
                    "id": sid,
                    "doc_id": ge.doc_id(sid),
                    "chunk_id": f"{ge.doc_id(sid)}#0-99",
                    "score": 1 / rank,
                    "scores": {},
                }
                for rank, sid in enumerate(snippet_ids, 1)
            ],
        )
    )


def er_run(store: TraceStore, run_id: str, snippet_ids: list[str], extracted: list[str] | None = None) -> None:
    """An ER-MedRAG run: a retrieval of `snippet_ids`, one extractor event per snippet in the order `extracted`
    (default: retrieval order; the fan-out finishes in any order), the respondent's evidence citing the first
    snippet (as if only it gave a triplet)."""
    store.start_run(run_id, "er_medrag", {"question": "q"}, "A")
    retrieval(store, run_id, snippet_ids)
    for sid in snippet_ids if extracted is None else extracted:
        store.add_event(event(run_id, "extractor", {"question": "q", "snippet_id": sid, "snippet": f"text of {sid}"}))
    evidence = f"1. [{snippet_ids[0]}] a — b — c"
    store.add_event(
        event(
            run_id,
            "respondent",
            {"question": "q", "options": {"A": "yes"}, "evidence": evidence},
            parsed={"answer": "A", "reasoning": "because"},
        )
    )


def respondent_run(store: TraceStore, run_id: str, graph: str, evidence: str, retrieved: list[str]) -> None:
    """A run whose respondent reads `evidence` after one retrieval of `retrieved` (none if empty: CoT)."""
    store.start_run(run_id, graph, {"question": "q"}, "A")
    if retrieved:
        retrieval(store, run_id, retrieved)
    store.add_event(
        event(
            run_id,
            "respondent",
            {"question": "q", "options": {"A": "yes"}, "evidence": evidence},
            parsed={"answer": "A", "reasoning": "because"},
        )
    )


def med_r3_run(store: TraceStore, run_id: str, searches: list[list[str]]) -> None:
    """A Med-R³ run: a reasoner step before each search (one retrieval event each) and one after the last."""
    store.start_run(run_id, "med_r3", {"question": "q"}, "A")
    for found in searches:
        store.add_event(event(run_id, "reasoner", {"question": "q", "transcript": ""}, completion="<search>q</search>"))
        retrieval(store, run_id, found, node="search")
    store.add_event(event(run_id, "reasoner", {"question": "q", "transcript": "..."}, completion="<answer>A</answer>"))


def row(system: str, benchmark: str, question_id: str, run_id: str | None) -> dict:
    return {
        "config": {"system": system, "model": "scripted:ermedrag.testing.scripted"},
        "benchmark": benchmark,
        "question_id": question_id,
        "run_id": run_id,
        "gold": "A",
        "answer": "A",
        "ok": True,
        "correct": True,
    }


@pytest.fixture
def fixture_data(tmp_path: Path) -> dict[str, Path]:
    """A trace db, a results folder, qrels and a PubMedQA corpus with known ids."""
    qrels = tmp_path / "qrels.jsonl"
    qrels.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "bioasq-aaa", "question": "?", "type": "yesno", "gold": ["bioasq-g1", "bioasq-g2", "bioasq-g3"]},
                {"id": "bioasq-bbb", "question": "?", "type": "yesno", "gold": ["bioasq-h1"]},
            ]
        )
        + "\n"
    )
    corpora = tmp_path / "corpora"
    corpora.mkdir()
    with gzip.open(corpora / ge.PUBMEDQA_CORPUS, "wt") as handle:
        for pid, pmid in [
            ("pubmed-111-0", "111"),
            ("pubmed-111-1", "111"),
            ("pubmed-111-2", "111"),
            ("pubmed-111-3", "111"),
            ("pubmed-1112-0", "1112"),
        ]:
            handle.write(json.dumps({"id": pid, "title": "t", "text": "x", "pmid": pmid}) + "\n")

    store = TraceStore(tmp_path / "traces.sqlite")
    # er_medrag / bioasq-aaa: docs g1, x9, g1 (again), g2 → retrieved {g1, x9, g2}: P = 2/3, R = 2/3
    er_run(store, "r1", ["bioasq-g1@0-50", "bioasq-x9@0-40", "bioasq-g1@60-120", "bioasq-g2@0-10"])
    # er_medrag / bioasq-bbb: {h1} → P = 1, R = 1
    er_run(store, "r2", ["bioasq-h1@5-9"])
    # vanilla_rag / bioasq-aaa: retrieved g3 and a medquad passage → P = 1/2, R = 1/3
    respondent_run(
        store,
        "r3",
        "vanilla_rag",
        "1. [bioasq-g3@0-5] Title: some text\n2. [medquad-1@0-9] Other: more",
        ["bioasq-g3@0-5", "medquad-1@0-9"],
    )
    # er_medrag / pubmedqa-111: 111-0, 111-2 gold; 1112-0 only shares the digits; P = 2/4; R = 2/4 with corpus
    er_run(store, "r4", ["pubmed-111-0@0-5", "pubmed-1112-0@0-5", "pubmed-111-2@3-9", "bioasq-x@0-1"])
    # cot / pubmedqa-111: no retrieval
    respondent_run(store, "r5", "cot", "(none: answer from your own knowledge)", [])
    # er_medrag / medqa: no gold evidence
    er_run(store, "r6", ["medquad-7@0-5"])
    # er_medrag / bioasq-ccc: not in the qrels
    er_run(store, "r7", ["bioasq-g1@0-5"])
    # retrieved a, a (another window), b, c, d; extraction finished in the reverse order
    er_run(
        store,
        "r8",
        ["a@0-1", "a@2-3", "b@0-1", "c@0-1", "d@0-1"],
        extracted=["d@0-1", "c@0-1", "b@0-1", "a@2-3", "a@0-1"],
    )
    # med_r3 / pubmedqa-111: two searches, 111-1 found by both → {111-1, x, 111-3}: P = 2/3; R = 2/4 with corpus
    med_r3_run(store, "r9", [["pubmed-111-1@0-5", "bioasq-x@0-1"], ["pubmed-111-1@7-9", "pubmed-111-3@0-4"]])

    results = tmp_path / "results"
    results.mkdir()
    rows = [
        row("er_medrag", "bioasq", "bioasq-aaa", "r1"),
        row("er_medrag", "bioasq", "bioasq-bbb", "r2"),
        row("vanilla_rag", "bioasq", "bioasq-aaa", "r3"),
        row("er_medrag", "pubmedqa", "pubmedqa-111", "r4"),
        row("cot", "pubmedqa", "pubmedqa-111", "r5"),
        row("er_medrag", "medqa", "medqa-1", "r6"),
        row("er_medrag", "bioasq", "bioasq-ccc", "r7"),
        row("er_medrag", "bioasq", "bioasq-bbb", "missing-run"),
        row("er_medrag", "bioasq", "bioasq-bbb", None),
        row("med_r3", "pubmedqa", "pubmedqa-111", "r9"),
    ]
    (results / rq.RESULTS).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return {"db": tmp_path / "traces.sqlite", "results": results, "qrels": qrels, "corpora": corpora}


def test_doc_id_strips_the_span():
    assert ge.doc_id("pubmed-21645374-0@12-240") == "pubmed-21645374-0"
    assert ge.doc_id("bioasq-23f0d2db77a8") == "bioasq-23f0d2db77a8"


def test_retrieved_ids_from_retrieval_events(fixture_data):
    store = TraceStore(fixture_data["db"])
    assert rq.retrieved_ids(store, "r1") == ["bioasq-g1", "bioasq-x9", "bioasq-g2"]
    assert rq.retrieved_ids(str(fixture_data["db"]), "r3") == ["bioasq-g3", "medquad-1"]
    assert rq.retrieved_ids(store, "r8") == ["a", "b", "c", "d"]  # retrieval order, not extraction order
    assert rq.retrieved_ids(store, "r9") == ["pubmed-111-1", "bioasq-x", "pubmed-111-3"]  # over both searches
    assert rq.retrieved_ids(store, "r5") == []
    assert rq.retrieved_ids(store, "no-such-run") == []


def test_gold_evidence_rules(fixture_data):
    pubmed = ge.gold_evidence("pubmedqa-111", "pubmedqa")
    assert pubmed == ge.GoldEvidence(prefix="pubmed-111-") and not pubmed.complete
    assert "pubmed-111-7" in pubmed and "pubmed-1112-0" not in pubmed
    assert pubmed.reference_ids(["pubmed-111-2", "pubmed-1112-0", "pubmed-111-0"]) == ["pubmed-111-0", "pubmed-111-2"]
    expanded = ge.gold_evidence("pubmedqa-111", "pubmedqa_test", corpus_dir=fixture_data["corpora"])
    assert expanded.complete and expanded.ids == {f"pubmed-111-{i}" for i in range(4)}
    bioasq = ge.gold_evidence("bioasq-aaa", "bioasq", qrels_path=fixture_data["qrels"])
    assert bioasq.ids == {"bioasq-g1", "bioasq-g2", "bioasq-g3"} and bioasq.complete
    assert ge.gold_evidence("bioasq-ccc", "bioasq", qrels_path=fixture_data["qrels"]) is None
    assert ge.gold_evidence("medqa-1", "medqa") is None
    assert ge.gold_evidence("not-a-pubmed-id", "pubmedqa") is None


def test_bioasq_without_qrels_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.delenv("ERMEDRAG_SHARED_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match="qrels"):
        ge.gold_evidence("bioasq-aaa", "bioasq")
    with pytest.raises(FileNotFoundError, match="qrels"):
        ge.gold_evidence("bioasq-aaa", "bioasq", qrels_path=tmp_path / "absent.jsonl")


def test_ragas_id_metrics_are_used():
    from ragas.metrics._context_precision import IDBasedContextPrecision
    from ragas.metrics._context_recall import IDBasedContextRecall

    assert rq.BACKEND == "ragas"
    assert rq.metric_classes() == {"context_precision": IDBasedContextPrecision, "context_recall": IDBasedContextRecall}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import ragas.metrics

        assert ragas.metrics.IDBasedContextPrecision is IDBasedContextPrecision  # the public (deprecated) name
        assert ragas.metrics.IDBasedContextRecall is IDBasedContextRecall


def test_id_scores_exact_and_equal_to_fallback():
    pairs = [(["a", "b", "c"], ["a", "d"]), (["a", "a", "b"], ["a"]), (["x"], ["a", "b"]), ([], ["a"]), (["a"], [])]
    expected = [(1 / 3, 1 / 2), (1 / 2, 1.0), (0.0, 0.0), (None, 0.0), (0.0, None)]
    got = rq.id_scores(pairs)
    assert got == [pytest.approx(e) for e in expected]
    fallback = [(rq._finite(rq._fallback_precision(r, g)), rq._finite(rq._fallback_recall(r, g))) for r, g in pairs]
    assert got == fallback


def test_context_scores_prefix_rule_has_no_recall():
    retrieved = ["pubmed-111-0", "pubmed-1112-0", "pubmed-111-2", "bioasq-x"]
    assert rq.context_scores(retrieved, ge.GoldEvidence(prefix="pubmed-111-")) == {
        "context_precision": 0.5,
        "context_recall": None,
    }
    gold = ge.GoldEvidence(ids=frozenset(f"pubmed-111-{i}" for i in range(4)))
    assert rq.context_scores(retrieved, gold) == {"context_precision": 0.5, "context_recall": 0.5}


def by_key(report: dict) -> dict:
    return {(g["system"], g["benchmark"]): g for g in report["groups"]}


def test_rag_quality_hand_computed(fixture_data):
    report = rq.rag_quality(
        [fixture_data["results"]],
        fixture_data["db"],
        qrels_path=fixture_data["qrels"],
        corpus_dir=fixture_data["corpora"],
    )
    assert report["backend"] == "ragas"
    assert report["metrics"]["context_precision"].endswith("IDBasedContextPrecision")
    groups = by_key(report)
    assert set(groups) == {
        ("er_medrag", "bioasq"),
        ("vanilla_rag", "bioasq"),
        ("er_medrag", "pubmedqa"),
        ("med_r3", "pubmedqa"),
    }
    er_bioasq = groups["er_medrag", "bioasq"]
    assert er_bioasq["n"] == 2 and er_bioasq["n_recall"] == 2
    assert er_bioasq["context_precision"] == pytest.approx((2 / 3 + 1) / 2)
    assert er_bioasq["context_recall"] == pytest.approx((2 / 3 + 1) / 2)
    assert er_bioasq["models"] == ["scripted:ermedrag.testing.scripted"]
    vanilla = groups["vanilla_rag", "bioasq"]
    assert (vanilla["n"], vanilla["context_precision"], vanilla["context_recall"]) == (1, 0.5, pytest.approx(1 / 3))
    pubmed = groups["er_medrag", "pubmedqa"]
    assert (pubmed["n"], pubmed["context_precision"], pubmed["context_recall"], pubmed["n_recall"]) == (1, 0.5, 0.5, 1)
    med_r3 = groups["med_r3", "pubmedqa"]
    assert (med_r3["n"], med_r3["context_precision"], med_r3["context_recall"]) == (1, pytest.approx(2 / 3), 0.5)
    # medqa + bioasq-ccc have no gold; two rows have no run in the store; CoT retrieved nothing
    assert report["skipped"] == {"no_gold": 2, "no_run": 2, "no_retrieval": 1}
    assert report["notes"] == []


def test_rag_quality_without_corpus_or_qrels(fixture_data, monkeypatch):
    monkeypatch.delenv("ERMEDRAG_SHARED_DATA", raising=False)
    report = rq.rag_quality(fixture_data["results"] / rq.RESULTS, str(fixture_data["db"]))
    pubmed = by_key(report)["er_medrag", "pubmedqa"]
    assert (pubmed["context_precision"], pubmed["context_recall"], pubmed["n_recall"]) == (0.5, None, 0)
    med_r3 = by_key(report)["med_r3", "pubmedqa"]
    assert (med_r3["context_precision"], med_r3["context_recall"]) == (pytest.approx(2 / 3), None)
    assert {g["benchmark"] for g in report["groups"]} == {"pubmedqa"}
    assert report["skipped"]["no_gold"] == 7  # six BioASQ rows (no qrels) + medqa
    assert len(report["notes"]) == 1 and "qrels" in report["notes"][0]


def test_shared_pubmedqa_gold(shared_data):
    gold = ge.gold_evidence("pubmedqa-21645374", "pubmedqa")
    assert gold.prefix == "pubmed-21645374-"
    expanded = ge.gold_evidence("pubmedqa-21645374", "pubmedqa", corpus_dir=shared_data / "corpora")
    assert {"pubmed-21645374-0", "pubmed-21645374-1"} <= expanded.ids
    assert all(i.startswith("pubmed-21645374-") for i in expanded.ids)
    questions = [json.loads(line) for line in (shared_data / "benchmarks" / "pubmedqa_test.jsonl").open()]
    passages = ge.pubmedqa_passages(str(shared_data / "corpora"))
    assert all(q["id"] == f"pubmedqa-{q['pmid']}" and passages.get(q["pmid"]) for q in questions)


def test_shared_bioasq_gold(shared_data):
    qrels = shared_data / ge.QRELS_FILE
    gold = ge.gold_evidence("bioasq-6402c910201352f04a00000c", "bioasq", qrels_path=qrels)
    assert gold.ids == {"bioasq-23f0d2db77a8"}
    questions = [json.loads(line) for line in (shared_data / "benchmarks" / "bioasq_yesno.jsonl").open()]
    golds = [ge.gold_evidence(q["id"], "bioasq", qrels_path=qrels) for q in questions]
    assert all(g is not None and g.ids for g in golds)
    with gzip.open(shared_data / "corpora" / "bioasq_snippets.jsonl.gz", "rt") as handle:
        corpus_ids = {json.loads(line)["id"] for line in handle}
    assert set().union(*(g.ids for g in golds)) <= corpus_ids


def test_judge_needs_a_model():
    with pytest.raises(rq.JudgeUnavailable, match="judge model"):
        rq.judge_metrics([{"user_input": "q", "response": "r", "retrieved_contexts": ["c"]}], None)


class TinyEmbeddings(Embeddings):
    """A deterministic LangChain-style embeddings object (bag of letters), so no encoder is loaded."""

    def embed_documents(self, texts):
        return [self.embed_query(t) for t in texts]

    def embed_query(self, text):
        return [text.lower().count(c) + 1e-3 for c in "abcdefghijklmnopqrstuvwxyz"]


def test_judge_metrics_offline_with_scripted_judge():
    from ragas.metrics._answer_relevance import ResponseRelevancy
    from ragas.metrics._faithfulness import Faithfulness

    metrics = rq.build_judge(JUDGE, embeddings=TinyEmbeddings())
    assert isinstance(metrics["faithfulness"], Faithfulness)
    assert isinstance(metrics["answer_relevancy"], ResponseRelevancy)
    rows = [
        {
            "user_input": QUESTION,
            "response": "Aspirin inhibits cyclooxygenase. It cures influenza.",
            "retrieved_contexts": ["Aspirin irreversibly inhibits cyclooxygenase-1."],
            "question_id": "q1",
        }
    ]
    report = rq.judge_metrics(rows, JUDGE, embeddings=TinyEmbeddings())
    assert report["judge"] == JUDGE and report["relevancy_skipped"] is None
    scored = report["rows"][0]
    assert scored["question_id"] == "q1" and "errors" not in scored
    assert scored["faithfulness"] == 0.5  # one of the two statements is supported
    assert scored["answer_relevancy"] == pytest.approx(1.0)  # the generated question is the question
    assert report["summary"] == {
        "faithfulness": {"mean": 0.5, "n": 1},
        "answer_relevancy": {"mean": pytest.approx(1.0), "n": 1},
    }
    no_relevancy = rq.judge_metrics(rows, JUDGE, relevancy=False)
    assert set(no_relevancy["summary"]) == {"faithfulness"} and no_relevancy["relevancy_skipped"]


def test_judge_failure_is_recorded_per_row():
    rows = [{"user_input": "q", "response": "GARBLED", "retrieved_contexts": ["c"]}]
    report = rq.judge_metrics(rows, JUDGE, relevancy=False)  # the judge's reply is not ragas' JSON format
    assert report["rows"][0]["faithfulness"] is None and "faithfulness" in report["rows"][0]["errors"]
    assert report["summary"]["faithfulness"] == {"mean": None, "n": 0}


def test_judge_samples_from_traces(fixture_data):
    store = TraceStore(fixture_data["db"])
    rows = [
        row("er_medrag", "bioasq", "bioasq-bbb", "r2"),
        row("vanilla_rag", "bioasq", "bioasq-aaa", "r3"),
        row("cot", "pubmedqa", "pubmedqa-111", "r5"),
    ]
    samples = rq.judge_samples(rows, store)
    assert [s["run_id"] for s in samples] == ["r2", "r3"]  # CoT has no contexts
    assert samples[0]["retrieved_contexts"] == ["text of bioasq-h1@5-9"]
    assert samples[0]["user_input"] == "q" and samples[0]["response"] == "because\nAnswer: A. yes"
    assert samples[1]["retrieved_contexts"][0].startswith("1. [bioasq-g3@0-5]")
    assert samples[0]["system"] == "er_medrag"


def test_offline_sentence_transformer_embeddings_for_relevancy():
    """ResponseRelevancy's default embeddings: the packaged MiniLM, loaded offline (no download)."""
    embeddings = rq._sentence_transformer_embeddings("")
    vector = embeddings.embed_query(QUESTION)
    assert len(vector) == 384 and math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-4)
