"""Choose tools.retrieval's default coarse-stage settings on the tuning split of the BioASQ qrels (never the
held-out questions retrieval_bench.py reports): on the passages setting, BM25's tokenisation and
parameters, HNSW against exact search, then the coarse stage's settings one at a time around the defaults;
on the long-documents setting, how many sentence windows one chunk may give. Writes benches/results/retrieval_tuning.json.

    .venv/bin/python benches/retrieval/tune.py --queries 400
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from common import CACHE, DEFAULT_DATA, REPO, run_system, set_threads
from data import SharedData, Span, split_qrels
from scoring import DEPTH, passage_ids, score_passages

# BM25 alone, built in memory over the index's chunks: tokenisation and (k1, b).
BM25_VARIANTS: list[dict] = [
    {"stem": False, "k1": 1.5, "b": 0.75},
    {"stem": True, "k1": 1.5, "b": 0.75},  # bm25s defaults
    {"stem": True, "k1": 1.2, "b": 0.75},
    {"stem": True, "k1": 1.5, "b": 0.9},
    {"stem": True, "k1": 1.2, "b": 1.0},  # tools.index.BM25_PARAMS
    {"stem": True, "k1": 1.5, "b": 1.0},
    {"stem": False, "k1": 1.2, "b": 1.0},
]
# The coarse stage (tools.retrieval.RetrievalConfig), one setting varied at a time around the defaults.
VARIANTS: list[dict] = [
    {"fusion": "rrf", "feedback_chunks": 0},
    {"fusion": "rrf", "rrf_k": 10, "feedback_chunks": 0},
    {"feedback_chunks": 0, "bm25_weight": 0.5},
    {"feedback_chunks": 0},
    {"feedback_chunks": 0, "bm25_weight": 0.7},
    {},  # the defaults
    {"bm25_weight": 0.5},
    {"bm25_weight": 0.7},
    {"feedback_chunks": 2},
    {"feedback_chunks": 5},
    {"expansion_terms": 10},
    {"expansion_terms": 20},
    {"expansion_weight": 1.0},
    {"expansion_weight": 0.0},
    {"feedback_vector_weight": 0.0},
    {"feedback_vector_weight": 1.0},
    {"fetch_k": 300},
]


def bm25_variants(index, questions: list[dict]) -> list[dict]:
    import bm25s

    from ermedrag.tools.retrieval.bm25 import snowball_stemmer
    from ermedrag.tools.retrieval.index_files import chunk_texts

    ids, texts = chunk_texts(index.collection)
    rows = []
    for variant in BM25_VARIANTS:
        stemmer = snowball_stemmer() if variant["stem"] else None
        tokenize = lambda t, s=stemmer: bm25s.tokenize(t, stopwords="en", stemmer=s, show_progress=False)  # noqa: E731
        retriever = bm25s.BM25(k1=variant["k1"], b=variant["b"])
        retriever.index(tokenize(texts), show_progress=False)

        def search(text: str, r=retriever, s=stemmer) -> list[str]:
            terms = [
                t
                for t in bm25s.tokenize([text], stopwords="en", stemmer=s, show_progress=False, return_ids=False)[0]
                if t in r.vocab_dict
            ]
            if not terms:
                return []
            found, _ = r.retrieve([terms], k=DEPTH, show_progress=False, n_threads=1)
            return passage_ids(ids[int(i)] for i in found[0])

        rows.append({"bm25": variant, **run_system(json.dumps(variant), search, score_passages, questions, [])})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def hnsw_vs_exact(index, questions: list[dict]) -> dict:
    """Chroma's HNSW (its default ef_search) against exact cosine search over the same vectors: how many
    of the exact top-100 chunks HNSW returns, and the time of each."""
    import numpy as np

    from ermedrag.tools.retrieval.encoder import encode
    from ermedrag.tools.retrieval.search import dense_search

    ids, vectors = [], []
    for offset in range(0, index.size, 5000):
        page = index.collection.get(include=["embeddings"], limit=5000, offset=offset)
        ids.extend(page["ids"])
        vectors.append(np.asarray(page["embeddings"], dtype=np.float32))
    matrix = np.concatenate(vectors)
    overlap, hnsw_ms, exact_ms = [], [], []
    for q in questions:
        vector = encode([q["question"]])[0]
        t0 = time.perf_counter()
        approx = {h.chunk_id for h in dense_search(index, q["question"], DEPTH, vector)}
        t1 = time.perf_counter()
        exact = {ids[i] for i in np.argpartition(-(matrix @ vector), DEPTH)[:DEPTH]}
        t2 = time.perf_counter()
        overlap.append(len(approx & exact) / DEPTH)
        hnsw_ms.append(1000 * (t1 - t0))
        exact_ms.append(1000 * (t2 - t1))
    row = {
        "recall_of_exact_top100": round(float(np.mean(overlap)), 4),
        "hnsw_p50_ms": round(float(np.median(hnsw_ms)), 1),
        "exact_numpy_p50_ms": round(float(np.median(exact_ms)), 1),
        "configuration": index.collection.configuration_json.get("hnsw"),
    }
    print("hnsw vs exact:", json.dumps(row), flush=True)
    return row


# The fine stage (RetrievalConfig's fine-stage fields), likewise.
FINE_VARIANTS: list[dict] = [
    {"windows_per_chunk": 1},
    {"windows_per_chunk": 2},
    {"windows_per_chunk": 3},
    {"windows_per_chunk": 5},
    {"windows_per_chunk": 3, "min_relative_score": 0.25},
]


def fine_variants(index_dir: str, data: SharedData, questions: list[dict]) -> list[dict]:
    """The fine stage on the long-documents index (where chunks hold several passages): how many windows a
    chunk may give, scored as retrieval_bench.py scores that setting."""
    from data import long_documents, load_passages
    from scoring import snippet_metrics
    from ermedrag.tools.retrieval.index import open_index
    from ermedrag.tools.retrieval.search import RetrievalConfig, clean_query, coarse_hybrid, fine_sentence_windows

    _, spans = long_documents(load_passages(data))
    index = open_index(index_dir)
    rows = []
    for changes in FINE_VARIANTS:

        def search(text: str, c=dataclasses.replace(RetrievalConfig(), **changes)) -> list:
            query = clean_query(text)
            return [
                Span(s.doc_id, s.start, s.end)
                for s in fine_sentence_windows(index, query, coarse_hybrid(index, query, DEPTH), DEPTH, c)
            ]

        score_spans = lambda q, found: snippet_metrics(found, [spans[g] for g in q["gold"]])  # noqa: E731
        rows.append({"fine": changes, **run_system(json.dumps(changes), search, score_spans, questions, [])})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA)
    parser.add_argument("--index-dir", default=str(CACHE / "passages-index"), help="built by retrieval_bench.py")
    parser.add_argument(
        "--long-documents-index",
        default=str(CACHE / "longdocs-index"),
        help="built by retrieval_bench.py (the fine-stage variants run on it)",
    )
    parser.add_argument("--queries", type=int, default=400, help="tuning questions used")
    parser.add_argument("--fine-queries", type=int, default=150, help="tuning questions for the fine-stage variants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "benches/results/retrieval_tuning.json"))
    args = parser.parse_args()
    set_threads(args.threads)

    from ermedrag.tools.retrieval.index_files import BM25_PARAMS
    from ermedrag.tools.retrieval.index import open_index
    from ermedrag.tools.retrieval.search import RetrievalConfig, coarse_hybrid

    data = SharedData(Path(args.data))
    tuning, _ = split_qrels(data, args.seed)
    questions = tuning[: args.queries]
    index = open_index(args.index_dir)
    hnsw = hnsw_vs_exact(index, questions)
    bm25_rows = bm25_variants(index, questions)
    rows = []
    for changes in VARIANTS:
        config = dataclasses.replace(RetrievalConfig(), **changes)
        search = lambda text, c=config: passage_ids(  # noqa: E731
            h.chunk_id for h in coarse_hybrid(index, " ".join(text.split()), DEPTH, c)
        )
        t0 = time.perf_counter()
        row = {"changes": changes, **run_system(json.dumps(changes), search, score_passages, questions, tuning[-3:])}
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    fine_rows = fine_variants(args.long_documents_index, data, tuning[: args.fine_queries])
    Path(args.out).write_text(
        json.dumps(
            {
                "questions": len(questions),
                "split": "tuning",
                "seed": args.seed,
                "defaults": dataclasses.asdict(RetrievalConfig()),
                "bm25_params": BM25_PARAMS,
                "bm25_variants": bm25_rows,
                "variants": rows,
                "hnsw": hnsw,
                "fine_long_documents": {"questions": args.fine_queries, "variants": fine_rows},
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
