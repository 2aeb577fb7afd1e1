"""The coarse stage's levers on small real indexes: weighted BM25, pseudo-relevance feedback, the optional
cross-encoder, batched queries, and Chroma as a `chroma run` server on 127.0.0.1 versus embedded."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import free_port, log_tail, stop_process_group
from ermedrag.tools.retrieval.corpus import Document
from ermedrag.tools.retrieval.index_files import IndexUnavailable
from ermedrag.tools.retrieval.index import build_index, open_index
from ermedrag.tools.records.traces import TraceStore
from ermedrag.tools.retrieval.search import (
    DEFAULT_CONFIG,
    PLAIN_RRF,
    ChunkHit,
    RetrievalConfig,
    bm25_search,
    bm25_weighted_search,
    coarse_hybrid,
    cross_encoder_rerank,
    retrieve,
    retrieve_many,
)

# The feedback case: only the first passage says "zorbitine"; the others share its other terms or none.
PASSAGES = [
    ("zorb", "Zorbitine", "Zorbitine poisoning causes fulminant hepatic necrosis and jaundice within days."),
    (
        "liver",
        "Liver failure",
        "Fulminant hepatic necrosis with jaundice is treated with acetylcysteine or transplantation.",
    ),
    ("asthma", "Asthma", "Inhaled corticosteroids are the mainstay of persistent asthma control."),
    ("afib", "Atrial fibrillation", "Stroke risk in atrial fibrillation is scored with CHA2DS2-VASc."),
    ("dm", "Diabetes", "Metformin is the usual first drug for type 2 diabetes with normal kidney function."),
    ("ana", "Anaphylaxis", "Intramuscular epinephrine is the first-line treatment for anaphylaxis."),
    ("cap", "Pneumonia", "Community-acquired pneumonia in healthy adults is treated with amoxicillin."),
    ("inr", "Warfarin", "Warfarin needs regular INR monitoring to keep anticoagulation in range."),
]


def _documents() -> list[Document]:
    return [Document(id=i, title=t, text=x, source="test") for i, t, x in PASSAGES]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("levers") / "index"
    build_index(_documents(), directory, progress=False)
    return directory


def _rank(hits: list[ChunkHit], doc_id: str) -> int:
    return next(r for r, h in enumerate(hits, 1) if h.chunk_id.startswith(doc_id + "#"))


def test_config_refuses_bad_values() -> None:
    for bad in (
        {"fusion": "max"},
        {"bm25_weight": 1.5},
        {"fetch_k": 0},
        {"feedback_chunks": -1},
        {"fine_scorer": "bm25"},
        {"fine_policy": "best"},
        {"window_neighbours": -1},
        {"window_max_chars": 0},
        {"windows_per_chunk": 0},
    ):
        with pytest.raises(ValueError):
            RetrievalConfig(**bad)


def test_fine_stage_settings_come_from_the_config(index_dir: Path) -> None:
    index = open_index(index_dir)
    question = "anticoagulation INR warfarin monitoring"
    capped = retrieve(index, question, k=6, config=dataclasses.replace(DEFAULT_CONFIG, window_max_chars=40))
    assert capped and all(s.end - s.start <= 40 for s in capped)
    one_each = retrieve(
        index, question, k=6, coarse_k=6, config=dataclasses.replace(DEFAULT_CONFIG, windows_per_chunk=1)
    )
    assert len({s.chunk_id for s in one_each}) == len(one_each) == 6


def test_weighted_bm25_with_unit_weights_is_bm25(index_dir: Path) -> None:
    index = open_index(index_dir)
    plain = bm25_search(index, "hepatic necrosis jaundice", 8)
    weighted = bm25_weighted_search(index, {"hepat": 1.0, "necrosi": 1.0, "jaundic": 1.0}, 8)
    assert [h.chunk_id for h in plain] == [h.chunk_id for h in weighted]
    np.testing.assert_allclose([h.score for h in plain], [h.score for h in weighted], rtol=1e-5)
    doubled = bm25_weighted_search(index, {"hepat": 2.0, "necrosi": 2.0, "jaundic": 2.0}, 8)
    np.testing.assert_allclose([h.score for h in doubled], [2 * h.score for h in plain], rtol=1e-5)


def test_feedback_brings_up_a_passage_that_shares_the_top_hits_terms(index_dir: Path) -> None:
    index = open_index(index_dir)
    query = "What does zorbitine do?"
    without = coarse_hybrid(index, query, 8, dataclasses.replace(DEFAULT_CONFIG, feedback_chunks=0))
    with_feedback = coarse_hybrid(index, query, 8, dataclasses.replace(DEFAULT_CONFIG, feedback_chunks=1))
    assert _rank(with_feedback, "zorb") == 1
    assert _rank(without, "liver") > 2  # BM25 cannot see it: it never says zorbitine
    assert _rank(with_feedback, "liver") == 2
    assert "bm25" in with_feedback[1].ranks  # found by the expanded BM25 query


def test_plain_rrf_and_score_fusion_both_rank_the_obvious_passage_first(index_dir: Path) -> None:
    index = open_index(index_dir)
    for config in (PLAIN_RRF, DEFAULT_CONFIG):
        assert _rank(coarse_hybrid(index, "anticoagulation INR warfarin monitoring", 4, config), "inr") == 1


def test_retrieve_many_gives_what_retrieve_gives(index_dir: Path) -> None:
    index = open_index(index_dir)
    questions = ["How is asthma controlled?", "  What treats anaphylaxis? ", "", "zorbitine"]
    batched = retrieve_many(index, questions, k=3)
    assert [[s.id for s in got] for got in batched] == [[s.id for s in retrieve(index, q, k=3)] for q in questions]
    assert batched[2] == []


def _tiny_cross_encoder(folder: Path) -> Path:
    """A cross-encoder with random weights built from a config, with the packaged MiniLM's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from ermedrag.tools.retrieval.encoder import DEFAULT_ENCODER, encoder_path

    tokenizer = AutoTokenizer.from_pretrained(encoder_path(DEFAULT_ENCODER))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=1,
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_cross_encoder_reorders_the_head_by_its_scores(index_dir: Path, tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    model = _tiny_cross_encoder(tmp_path / "cross-encoder")
    index = open_index(index_dir)
    query = "first-line treatment of anaphylaxis"
    hits = coarse_hybrid(index, query, 8, PLAIN_RRF)
    reranked = cross_encoder_rerank(index, query, hits, str(model), top=5)
    texts = index.chunks([h.chunk_id for h in hits[:5]])
    expected = CrossEncoder(str(model)).predict([(query, texts[h.chunk_id].text) for h in hits[:5]])
    assert [h.chunk_id for h in reranked[:5]] == [hits[i].chunk_id for i in np.argsort(-expected, kind="stable")]
    assert reranked[5:] == hits[5:]
    via_config = coarse_hybrid(index, query, 8, dataclasses.replace(PLAIN_RRF, reranker=str(model), rerank_k=5))
    assert [h.chunk_id for h in via_config] == [h.chunk_id for h in reranked]


def test_chroma_server_mode_gives_what_embedded_gives(index_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "chroma.log"
    chroma = Path(sys.executable).with_name("chroma")
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(chroma), "run", "--path", str(tmp_path / "server-store"), "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                build_index(_documents(), tmp_path / "served", chroma_url=url, progress=False)
                break
            except Exception:  # the server is still starting
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError(f"chroma run did not come up:\n{log_tail(log)}")
                time.sleep(0.5)
        served, embedded = open_index(tmp_path / "served", chroma_url=url), open_index(index_dir)
        assert served.size == embedded.size == len(PASSAGES)
        assert not (tmp_path / "served" / "chroma").exists()  # the vectors live in the server
        for question in ("What does zorbitine do?", "How is stroke risk scored in atrial fibrillation?"):
            assert [s.id for s in retrieve(served, question, k=4)] == [s.id for s in retrieve(embedded, question, k=4)]
        # The index records where its vectors live and reopens there, also in another process and through the CLI
        # (which had advised rebuilding, re-embedding everything locally); adding to it goes to the same server.
        manifest = json.loads((tmp_path / "served" / "manifest.json").read_text())
        assert manifest["vector_store"] == url
        assert open_index(tmp_path / "served").size == len(PASSAGES)
        build_index(_documents()[:1], tmp_path / "served", progress=False)  # no --chroma-url: the recorded server
        assert not (tmp_path / "served" / "chroma").exists()
        with pytest.raises(IndexUnavailable, match="keeps its vectors in the Chroma server at"):
            build_index(_documents()[:1], tmp_path / "served", chroma_url="http://127.0.0.1:1", progress=False)
        env = {
            **os.environ,
            "ERMEDRAG_TRACE_DB": str(tmp_path / "t.sqlite"),
            "ERMEDRAG_CHECKPOINT_DB": str(tmp_path / "c.sqlite"),
        }
        env.pop("ERMEDRAG_CHROMA_URL", None)
        asked = subprocess.run(
            [
                sys.executable,
                "-m",
                "ermedrag",
                "ask",
                "What does zorbitine do?",
                "--graph",
                "vanilla_rag",
                "--model",
                "scripted:ermedrag.testing.scripted",
                "--index-dir",
                str(tmp_path / "served"),
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert asked.returncode == 0, asked.stderr[-2000:]
        assert json.loads(asked.stdout)["snippets"]
    finally:
        stop_process_group(server)


def test_the_graphs_use_the_reranker_named_in_their_context(index_dir: Path, tmp_path: Path) -> None:
    from ermedrag.graphs.context import Context
    from ermedrag.graphs.steps import retrieval_config, retrieve_evidence

    model = str(_tiny_cross_encoder(tmp_path / "cross-encoder"))
    question = "first-line treatment of anaphylaxis"
    plain = Context(index_dir=str(index_dir), coarse_k=6, snippets_k=6)
    reranked = Context(
        index_dir=str(index_dir), coarse_k=6, snippets_k=6, reranker=model, trace_db=str(tmp_path / "traces.sqlite")
    )
    assert retrieval_config(plain) == DEFAULT_CONFIG
    assert retrieval_config(reranked).reranker == model and retrieval_config(reranked).rerank_k >= 6
    index = open_index(index_dir)
    # coarse_hybrid re-scores its fused list (all 8 passages here) before keeping coarse_k
    expected = cross_encoder_rerank(index, question, coarse_hybrid(index, question, 100), model, top=20)[:6]
    got = retrieve_evidence(reranked, question, run_id="r", node="retrieve")["snippets"]
    assert [s["chunk_id"] for s in got] == [h.chunk_id for h in expected]
    (recorded,) = TraceStore(reranked.trace_db).retrievals("r")  # the trace says which reranker ranked them
    assert (recorded["settings"]["reranker"], recorded["settings"]["rerank_k"]) == (model, 20)
