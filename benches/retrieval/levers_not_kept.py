"""Levers tried on the passages setting after the defaults were set, and not kept: each is measured against
the default coarse stage on the same tuning questions (never the held-out ones). Writes
benches/results/retrieval_levers_not_kept.json.

    .venv/bin/python benches/retrieval/levers_not_kept.py     # ≈ 10 min with the passages index built

- sibling boost: a chunk gains λ × the best fused score of another candidate with the same title (the same
  PubMed article, OpenStax section or MedQuAD document): relevant passages cluster in documents;
- term coverage: a chunk gains γ × the IDF-weighted share of the question's terms it contains;
- learned fusion: logistic regression over both passes' normalised BM25 and dense scores (and the raw
  cosines), trained on the first `--train` tuning questions, scored on the rest;
- query adapter: a linear map of the question's vector, trained contrastively against the fixed passage
  vectors on the same training questions (dense alone gains; the question is whether the hybrid does).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
from common import CACHE, DEFAULT_DATA, REPO, run_system, set_threads
from data import SharedData, split_qrels
from scoring import DEPTH, passage_ids, passage_of, score_passages

Features = dict[str, dict[str, float]]  # chunk id -> feature -> value


def two_pass_features(index, query: str, vector: np.ndarray) -> Features:
    """Every candidate of the default coarse stage's two passes with each list's normalised score (0 where
    absent) and the dense cosines: the inputs the learned fusion may weigh."""
    from ermedrag.tools.retrieval.search import (
        DEFAULT_CONFIG,
        bm25_search,
        bm25_weighted_search,
        dense_search,
        feedback_query,
        fuse,
        min_max,
        query_terms,
    )

    k = max(DEFAULT_CONFIG.fetch_k, 2 * DEPTH)  # as coarse_hybrid fetches for DEPTH results
    bm25_1, dense_1 = bm25_search(index, query, k), dense_search(index, query, k, vector)
    first = fuse(bm25_1, dense_1, k, DEFAULT_CONFIG)
    weights, moved = feedback_query(
        index,
        query_terms(index.bm25, query),
        vector,
        [h.chunk_id for h in first[: DEFAULT_CONFIG.feedback_chunks]],
        DEFAULT_CONFIG,
    )
    bm25_2, dense_2 = bm25_weighted_search(index, weights, k), dense_search(index, query, k, moved)
    lists = {"bm25_1": bm25_1, "dense_1": dense_1, "bm25_2": bm25_2, "dense_2": dense_2}
    features: Features = {}
    for name, hits in lists.items():
        for chunk_id, value in min_max(hits).items():
            features.setdefault(chunk_id, dict.fromkeys(lists, 0.0))[name] = value
    for name in ("dense_1", "dense_2"):
        for hit in lists[name]:
            features[hit.chunk_id][f"cos_{name[-1]}"] = hit.score
    for row in features.values():
        row.setdefault("cos_1", 0.0)
        row.setdefault("cos_2", 0.0)
    return features


def default_score(row: dict[str, float]) -> float:
    from ermedrag.tools.retrieval.search import DEFAULT_CONFIG

    return DEFAULT_CONFIG.bm25_weight * row["bm25_2"] + (1 - DEFAULT_CONFIG.bm25_weight) * row["dense_2"]


def sibling_boost(index, lam: float) -> Callable[[str, Features], list[str]]:
    def rank(query: str, features: Features) -> list[str]:
        base = {cid: default_score(row) for cid, row in features.items()}
        titles = {cid: chunk.title for cid, chunk in index.chunks(list(base)).items()}
        by_title: dict[str, list[float]] = {}
        for cid, value in base.items():
            by_title.setdefault(titles.get(cid, cid), []).append(value)
        boosted = {}
        for cid, value in base.items():
            others = sorted(by_title[titles.get(cid, cid)], reverse=True)
            others.remove(value)
            boosted[cid] = value + lam * (others[0] if others else 0.0)
        return sorted(boosted, key=boosted.get, reverse=True)

    return rank


def term_coverage(index, gamma: float) -> Callable[[str, Features], list[str]]:
    from ermedrag.tools.retrieval.search import query_terms

    position = {cid: i for i, cid in enumerate(index.bm25_ids)}
    n = len(index.bm25_ids)

    def rank(query: str, features: Features) -> list[str]:
        coverage, total = np.zeros(n, dtype=np.float32), 0.0
        for term in set(query_terms(index.bm25, query)):
            present = index.bm25.scores({term: 1.0}) > 0
            idf = math.log(1 + (n - present.sum() + 0.5) / (present.sum() + 0.5))
            coverage += idf * present
            total += idf
        scored = {
            cid: default_score(row) + gamma * float(coverage[position[cid]]) / max(total, 1e-9)
            for cid, row in features.items()
        }
        return sorted(scored, key=scored.get, reverse=True)

    return rank


FEATURES = ["bm25_1", "dense_1", "bm25_2", "dense_2", "cos_1", "cos_2"]


def learned_fusion(train: list[tuple[dict, Features]]) -> tuple[Callable[[str, Features], list[str]], list[float]]:
    from sklearn.linear_model import LogisticRegression

    x = [[row[f] for f in FEATURES] for _, feats in train for row in feats.values()]
    y = [passage_of(cid) in q["gold"] for q, feats in train for cid in feats]
    weights = LogisticRegression(max_iter=2000).fit(np.array(x), np.array(y)).coef_[0]

    def rank(query: str, features: Features) -> list[str]:
        scored = {cid: float(np.dot(weights, [row[f] for f in FEATURES])) for cid, row in features.items()}
        return sorted(scored, key=scored.get, reverse=True)

    return rank, [round(float(w), 3) for w in weights]


def train_query_adapter(
    index, train: list[dict], vectors: np.ndarray, epochs: int = 20, decay: float = 0.01, temperature: float = 0.05
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """W (384×384, from the identity, L2-pulled towards it): softmax over all passage vectors with the gold
    chunks as positives. Returns W, the passage matrix and its chunk ids."""
    import torch

    ids, pages = [], []
    for offset in range(0, index.size, 5000):
        page = index.collection.get(include=["embeddings"], limit=5000, offset=offset)
        ids.extend(page["ids"])
        pages.append(np.asarray(page["embeddings"], dtype=np.float32))
    matrix = torch.tensor(np.concatenate(pages))
    rows: dict[str, list[int]] = {}
    for i, cid in enumerate(ids):
        rows.setdefault(passage_of(cid), []).append(i)
    positives = [[r for g in q["gold"] for r in rows.get(g, [])] for q in train]
    queries = torch.tensor(vectors)
    identity = torch.eye(matrix.shape[1])
    weight = identity.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([weight], lr=1e-3)
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(train))
        for start in range(0, len(order), 64):
            batch = [i for i in order[start : start + 64] if positives[i]]
            q = torch.nn.functional.normalize(queries[batch] @ weight, dim=1)
            log_probs = torch.log_softmax(q @ matrix.T / temperature, dim=1)
            loss = -torch.stack([log_probs[j, positives[i]].mean() for j, i in enumerate(batch)]).mean()
            loss = loss + decay * ((weight - identity) ** 2).sum()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return weight.detach().numpy(), matrix.numpy(), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA)
    parser.add_argument("--index-dir", default=str(CACHE / "passages-index"), help="built by retrieval_bench.py")
    parser.add_argument("--train", type=int, default=900, help="tuning questions the learned levers train on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benches/results/retrieval_levers_not_kept.json"))
    args = parser.parse_args()
    set_threads(1)

    from ermedrag.tools.retrieval.encoder import encode
    from ermedrag.tools.retrieval.index import open_index
    from ermedrag.tools.retrieval.search import DEFAULT_CONFIG, clean_query, coarse_hybrid

    tuning, _ = split_qrels(SharedData(Path(args.data)), args.seed)
    train, scored = tuning[: args.train], tuning[args.train :]
    index = open_index(args.index_dir)
    vectors = encode([clean_query(q["question"]) for q in tuning], index.encoder)
    vector_of = {q["id"]: v for q, v in zip(tuning, vectors)}
    by_text = {q["question"]: q for q in tuning}
    features = {q["id"]: two_pass_features(index, clean_query(q["question"]), vector_of[q["id"]]) for q in tuning}

    def system(rank: Callable[[str, Features], list[str]]) -> Callable[[str], list[str]]:
        return lambda text: passage_ids(rank(clean_query(text), features[by_text[text]["id"]]))[:DEPTH]

    results: dict[str, dict] = {}

    def measure(name: str, search: Callable[[str], list[str]], **extra) -> None:
        results[name] = {**run_system(name, search, score_passages, scored, []), **extra}
        print(name, json.dumps(results[name]), flush=True)

    measure(
        "default",
        lambda text: passage_ids(
            [
                h.chunk_id
                for h in coarse_hybrid(index, clean_query(text), DEPTH, DEFAULT_CONFIG, vector_of[by_text[text]["id"]])
            ]
        ),
    )
    measure("default_from_features", system(lambda q, f: sorted(f, key=lambda c: default_score(f[c]), reverse=True)))
    for lam in (0.1, 0.35):
        measure(f"sibling_boost_{lam}", system(sibling_boost(index, lam)))
    for gamma in (0.1, 0.2):
        measure(f"term_coverage_{gamma}", system(term_coverage(index, gamma)))
    rank, weights = learned_fusion([(q, features[q["id"]]) for q in train])
    measure("learned_fusion", system(rank), weights=dict(zip(FEATURES, weights)))

    adapter, matrix, ids = train_query_adapter(index, train, vectors[: len(train)])
    adapted = {q["id"]: v / np.linalg.norm(v) for q, v in zip(scored, vectors[len(train) :] @ adapter)}

    def dense_only(vector_by_id: dict[str, np.ndarray]) -> Callable[[str], list[str]]:
        return lambda text: passage_ids(
            [ids[i] for i in np.argsort(-(matrix @ vector_by_id[by_text[text]["id"]]))[:DEPTH]]
        )

    measure("dense_exact", dense_only(vector_of))
    measure("dense_exact_query_adapter", dense_only(adapted))
    measure(
        "query_adapter",
        lambda text: passage_ids(
            [
                h.chunk_id
                for h in coarse_hybrid(index, clean_query(text), DEPTH, DEFAULT_CONFIG, adapted[by_text[text]["id"]])
            ]
        ),
    )
    Path(args.out).write_text(
        json.dumps(
            {
                "split": "tuning",
                "seed": args.seed,
                "train_questions": len(train),
                "scored_questions": len(scored),
                "note": "every figure is on the tuning questions after the first --train; learned levers trained on those",
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
