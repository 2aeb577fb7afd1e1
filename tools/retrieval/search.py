"""Coarse-to-fine hybrid retrieval.

    coarse: BM25 and dense search over chunks, score-fused, with one round of pseudo-relevance feedback
    fine:   split the best coarse chunks into sentence windows, re-score them, keep the best k snippets

Each stage is a plain function; `retrieve` composes them, so a stage can be swapped without touching the
others (a reranker, another fusion).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

from ermedrag.tools import settings
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.retrieval.bm25 import SegmentedBM25, SingleBM25s, bm25_tokenize
from ermedrag.tools.retrieval.index import Index
from ermedrag.tools.retrieval.index_files import bm25_texts
from ermedrag.tools.retrieval.encoder import encode, encode_queries

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[\"'])")
MAX_QUERY_CHARS = 2_000
# How many results a retrieval keeps. The one home of these defaults: the graphs' Context falls back to them.
SNIPPETS_K = 4  # snippets per ER-MedRAG / vanilla RAG question: one extractor call each, so they set its cost
COARSE_K = 8  # chunks the coarse stage keeps (the per-chunk fine stage reads the first k of them)
SEARCH_K = 5  # snippets of one Med-R³ search (the paper inserts the top 5)


@dataclass(frozen=True)
class ChunkHit:
    chunk_id: str
    score: float
    ranks: dict[str, int] = field(default_factory=dict)


@dataclass
class Snippet:
    """A piece of evidence with where it came from. `start`/`end` are offsets into the document text.

    `score` is what ranked it (per-chunk policy: its chunk's coarse fusion score); `scores` has the parts.
    """

    id: str
    text: str
    chunk_id: str
    doc_id: str
    title: str
    source: str
    start: int
    end: int
    score: float
    scores: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class RetrievalConfig:
    """How the coarse stage ranks chunks and the fine stage cuts them into snippets. Defaults were chosen on the
    BioASQ tuning split of benches/retrieval (never on the questions it reports); the bench's README has the
    measurements."""

    fusion: Literal["score", "rrf"] = "score"
    bm25_weight: float = 0.6  # score fusion: BM25's share, dense gets the rest
    rrf_k: int = 60
    fetch_k: int = 100  # chunks each retriever returns: max(fetch_k, 2k)
    feedback_chunks: int = 3  # pseudo-relevance feedback from the top chunks of a first pass; 0 = off
    expansion_terms: int = 15  # BM25 terms added from the feedback chunks (RM3-style)
    expansion_weight: float = 0.5  # their total weight relative to the question's terms
    feedback_vector_weight: float = 0.5  # Rocchio: query vector + w * mean of the feedback chunk vectors
    reranker: str | None = None  # cross-encoder (HF id or folder) re-scoring the top `rerank_k`; off by default
    rerank_k: int = 20
    # Fine stage (`fine_sentence_windows`).
    fine_scorer: Literal["dense", "lexical"] = "lexical"  # BM25 among the windows themselves: no encoder call
    fine_policy: Literal["per_chunk", "global"] = "per_chunk"  # chunks in coarse order: ranked better than windows
    window_neighbours: int = 1  # sentences either side of each one: a lone sentence often lacks its subject
    window_max_chars: int = 600  # a snippet is one extractor prompt: a long one dilutes it
    # A shorter window (a title line, a heading: "Asthma") holds no evidence on its own, yet its few words can
    # match the question best: it is merged with the next window of its chunk (or the one before). A chunk this
    # short is one snippet, whole: it is a passage of its own (BioASQ's gold snippets include 37-character ones;
    # dropping such chunks cost the passages bench recall@10 0.817 -> 0.803). Characters of stripped text, at
    # most window_max_chars; 0 = off.
    min_snippet_chars: int = 40
    windows_per_chunk: int = 3  # a long document's chunk often holds several pieces of evidence (benches/README)
    min_relative_score: float = 0.5  # a further window of a chunk must score this share of its best one
    coarse_prior_weight: float = 0.5  # global policy: fine scores alone over-reward short matching phrases

    def __post_init__(self) -> None:
        if self.fusion not in ("score", "rrf"):
            raise ValueError(f"fusion must be 'score' or 'rrf', not {self.fusion!r}")
        if self.fine_scorer not in ("dense", "lexical"):
            raise ValueError(f"fine_scorer must be 'dense' or 'lexical', not {self.fine_scorer!r}")
        if self.fine_policy not in ("per_chunk", "global"):
            raise ValueError(f"fine_policy must be 'per_chunk' or 'global', not {self.fine_policy!r}")
        if not 0.0 <= self.bm25_weight <= 1.0:
            raise ValueError(f"bm25_weight must be in [0, 1], not {self.bm25_weight}")
        if (
            min(self.fetch_k, self.rrf_k, self.rerank_k, self.window_max_chars, self.windows_per_chunk) < 1
            or min(self.feedback_chunks, self.expansion_terms, self.window_neighbours, self.min_snippet_chars) < 0
        ):
            raise ValueError(f"counts must be positive: {self}")


DEFAULT_CONFIG = RetrievalConfig()
PLAIN_RRF = RetrievalConfig(fusion="rrf", feedback_chunks=0)


def query_terms(bm25: SegmentedBM25 | SingleBM25s, query: str) -> list[str]:
    """The query's stemmed terms that the BM25 vocabulary knows."""
    return [t for t in bm25_tokenize([query], as_strings=True)[0] if t in bm25]


def bm25_search(index: Index, query: str, k: int) -> list[ChunkHit]:
    if index.bm25 is None or not index.bm25_ids:
        return []
    return bm25_weighted_search(index, dict.fromkeys(query_terms(index.bm25, query), 1.0), k)


def bm25_weighted_search(index: Index, term_weights: dict[str, float], k: int) -> list[ChunkHit]:
    """BM25 with a weight per query term: Σ w_t · BM25(t, chunk). Terms must be in the vocabulary."""
    if index.bm25 is None or not term_weights:
        return []
    scores = index.bm25.scores(term_weights)
    top = np.argpartition(-scores, min(k, len(scores)) - 1)[:k]
    top = top[np.argsort(-scores[top], kind="stable")]
    return [ChunkHit(index.bm25_ids[int(i)], float(scores[i])) for i in top if scores[i] > 0]


def dense_search(index: Index, query: str, k: int, query_vector: np.ndarray | None = None) -> list[ChunkHit]:
    vector = encode_queries([query], index.encoder)[0] if query_vector is None else query_vector
    got = index.collection.query(
        query_embeddings=[vector.tolist()], n_results=min(k, max(index.committed_chunks, 1)), include=["distances"]
    )
    return [ChunkHit(cid, 1.0 - float(dist)) for cid, dist in zip(got["ids"][0], got["distances"][0])]


def rrf_fuse(
    rankings: dict[str, list[ChunkHit]], k: int, rrf_k: int = 60, weights: dict[str, float] | None = None
) -> list[ChunkHit]:
    """Reciprocal-rank fusion: score = Σ w / (rrf_k + rank)."""
    scores: dict[str, float] = {}
    ranks: dict[str, dict[str, int]] = {}
    for name, hits in rankings.items():
        weight = (weights or {}).get(name, 1.0)
        for rank, hit in enumerate(hits, 1):
            scores[hit.chunk_id] = scores.get(hit.chunk_id, 0.0) + weight / (rrf_k + rank)
            ranks.setdefault(hit.chunk_id, {})[name] = rank
    best = sorted(scores, key=scores.get, reverse=True)[:k]
    return [ChunkHit(cid, scores[cid], ranks[cid]) for cid in best]


def min_max(hits: Sequence[ChunkHit]) -> dict[str, float]:
    """Each hit's score scaled to [0, 1] over the list (lowest 0, highest 1)."""
    if not hits:
        return {}
    values = np.array([h.score for h in hits])
    low, span = float(values.min()), max(float(values.max() - values.min()), 1e-9)
    return {h.chunk_id: (h.score - low) / span for h in hits}


def score_fuse(rankings: dict[str, list[ChunkHit]], k: int, weights: dict[str, float]) -> list[ChunkHit]:
    """Convex combination of min-max normalised scores (a chunk missing from a list scores 0 there).

    Unlike RRF it keeps how far apart the scores are, which ranked better on the tuning split."""
    scores: dict[str, float] = {}
    ranks: dict[str, dict[str, int]] = {}
    for name, hits in rankings.items():
        normalised = min_max(hits)
        for rank, hit in enumerate(hits, 1):
            scores[hit.chunk_id] = scores.get(hit.chunk_id, 0.0) + weights[name] * normalised[hit.chunk_id]
            ranks.setdefault(hit.chunk_id, {})[name] = rank
    best = sorted(scores, key=scores.get, reverse=True)[:k]
    return [ChunkHit(cid, scores[cid], ranks[cid]) for cid in best]


def fuse(bm25_hits: list[ChunkHit], dense_hits: list[ChunkHit], k: int, config: RetrievalConfig) -> list[ChunkHit]:
    rankings = {"bm25": bm25_hits, "dense": dense_hits}
    if config.fusion == "rrf":
        return rrf_fuse(rankings, k, config.rrf_k)
    return score_fuse(rankings, k, {"bm25": config.bm25_weight, "dense": 1.0 - config.bm25_weight})


def feedback_query(
    index: Index, terms: list[str], vector: np.ndarray, feedback: Sequence[str], config: RetrievalConfig
) -> tuple[dict[str, float], np.ndarray]:
    """Pseudo-relevance feedback: the question's terms plus the feedback chunks' most frequent other terms
    (length-normalised frequency), and the query vector moved towards the chunks' mean vector."""
    got = index.collection.get(ids=list(feedback), include=["documents", "metadatas", "embeddings"])
    texts = bm25_texts(got)
    weights = dict.fromkeys(terms, 1.0)
    mass: dict[str, float] = {}
    for tokens in bm25_tokenize(texts, as_strings=True) if texts else []:
        for term in tokens:
            if term not in weights and term in index.bm25:
                mass[term] = mass.get(term, 0.0) + 1.0 / len(tokens)
    added = sorted(mass, key=mass.get, reverse=True)[: config.expansion_terms]
    total = sum(mass[t] for t in added) or 1.0
    for term in added:
        weights[term] = config.expansion_weight * max(len(terms), 1) * mass[term] / total
    if len(got["embeddings"]):
        vector = vector + config.feedback_vector_weight * np.asarray(got["embeddings"], dtype=np.float32).mean(0)
        vector = vector / max(float(np.linalg.norm(vector)), 1e-9)
    return weights, vector


def coarse_hybrid(
    index: Index, query: str, k: int, config: RetrievalConfig = DEFAULT_CONFIG, query_vector: np.ndarray | None = None
) -> list[ChunkHit]:
    """BM25 + dense over chunks, fused; then (by default) one round of pseudo-relevance feedback, fused
    again; then an optional cross-encoder over the top `rerank_k`."""
    fetch_k = max(config.fetch_k, 2 * k)
    vector = encode_queries([query], index.encoder)[0] if query_vector is None else query_vector
    terms = query_terms(index.bm25, query) if index.bm25 is not None else []
    hits = fuse(bm25_search(index, query, fetch_k), dense_search(index, query, fetch_k, vector), fetch_k, config)
    if config.feedback_chunks and hits and index.bm25 is not None:
        feedback = [h.chunk_id for h in hits[: config.feedback_chunks]]
        weights, vector = feedback_query(index, terms, vector, feedback, config)
        hits = fuse(
            bm25_weighted_search(index, weights, fetch_k), dense_search(index, query, fetch_k, vector), fetch_k, config
        )
    if config.reranker:
        hits = cross_encoder_rerank(index, query, hits, config.reranker, config.rerank_k)
    return hits[:k]


@shared_resource(maxsize=2)
def load_cross_encoder(name: str) -> Any:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(name, device=settings.read("ERMEDRAG_DEVICE"))


def cross_encoder_rerank(index: Index, query: str, hits: list[ChunkHit], model: str, top: int) -> list[ChunkHit]:
    """Re-score the top `top` chunks with a cross-encoder (e.g. ncbi/MedCPT-Cross-Encoder); the rest keep
    their order below them."""
    head = hits[:top]
    chunks = index.chunks([h.chunk_id for h in head])
    head = [h for h in head if h.chunk_id in chunks]
    if not head:
        return hits
    scores = load_cross_encoder(model).predict(
        [(query, chunks[h.chunk_id].text) for h in head], show_progress_bar=False
    )
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    reranked = [
        ChunkHit(head[i].chunk_id, float(scores[i]), {**head[i].ranks, "reranker": r}) for r, i in enumerate(order, 1)
    ]
    return reranked + hits[top:]


def _spans_between(separator: str, text: str) -> list[tuple[int, int]]:
    """(start, end) spans of the non-blank pieces of `text` between matches of `separator`."""
    spans, start = [], 0
    for match in re.finditer(separator, text):
        if text[start : match.start()].strip():
            spans.append((start, match.start()))
        start = match.end()
    if text[start:].strip():
        spans.append((start, len(text)))
    return spans


def split_sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of sentences; bullet lists and newlines also end a sentence."""
    return _spans_between(rf"{SENTENCE_END.pattern}|\n+|\s+-\s+(?=[A-Z])", text)


def paragraphs(text: str) -> list[tuple[int, int]]:
    """(start, end) spans of the text between blank lines."""
    return _spans_between(r"\n\s*\n", text)


def sentence_windows(
    text: str,
    window: int = DEFAULT_CONFIG.window_neighbours,
    max_chars: int = DEFAULT_CONFIG.window_max_chars,
    min_chars: int = DEFAULT_CONFIG.min_snippet_chars,
) -> list[tuple[int, int]]:
    """Each sentence with up to `window` neighbours on either side from the same paragraph (a blank line
    ends one: evidence rarely runs across it), capped at `max_chars`; windows under `min_chars` merged
    (`merge_short_windows`)."""
    out = []
    for start, end in paragraphs(text):
        spans = [(start + s, start + e) for s, e in split_sentences(text[start:end])]
        for i in range(len(spans)):
            first, last = spans[max(0, i - window)][0], spans[min(len(spans) - 1, i + window)][1]
            out.append((first, min(last, first + max_chars)))
    return merge_short_windows(text, out or [(0, min(len(text), max_chars))], min(min_chars, max_chars), max_chars)


def merge_short_windows(
    text: str, windows: Sequence[tuple[int, int]], min_chars: int, max_chars: int
) -> list[tuple[int, int]]:
    """`windows` (in text order) with each one under `min_chars` of stripped text joined to the next (the one
    before when it is last), capped at `max_chars` from its start. A title line thus leads the window of its
    first sentences instead of being a snippet of its own. When no window reaches `min_chars` the short text
    is one window (a short passage is still evidence, and the coarse stage ranked its chunk); blank, none."""
    out: list[tuple[int, int]] = []
    pending: tuple[int, int] | None = None  # short windows waiting for the next one
    for start, end in windows:
        if pending is not None:
            start, end = min(start, pending[0]), max(end, pending[1])
            end, pending = min(end, start + max_chars), None
        if len(text[start:end].strip()) < min_chars:
            pending = (start, end)
        else:
            out.append((start, end))
    if pending is not None and out:
        start, end = min(out[-1][0], pending[0]), max(out[-1][1], pending[1])
        out[-1] = (start, min(end, start + max_chars))
    elif pending is not None and text[pending[0] : pending[1]].strip():
        out.append(pending)
    return out


def fine_sentence_windows(
    index: Index, query: str, hits: Sequence[ChunkHit], k: int, config: RetrievalConfig = DEFAULT_CONFIG
) -> list[Snippet]:
    """Sentence windows of the coarse chunks as snippets (the config's `fine_*`, `window_*` and per-chunk fields).

    `per_chunk` (default): chunks in coarse order; from each, its best window and up to
    `windows_per_chunk` - 1 more that do not overlap it and score at least `min_relative_score` of it (a
    chunk of a long document often holds several pieces of evidence); then the other windows by fine score +
    coarse prior if there are fewer than k. The coarse fusion ranks chunks better than window scores do
    (passages bench: MRR 0.84 vs 0.79 when windows were ranked globally), so the fine stage decides *where*
    in a chunk the evidence is. `global`: all windows ranked by fine score + coarse prior.
    """
    policy = config.fine_policy
    hits = list(hits[:k]) if policy == "per_chunk" and len(hits) >= k else list(hits)
    chunks = index.chunks([h.chunk_id for h in hits])
    coarse_rank = {h.chunk_id: rank for rank, h in enumerate(hits, 1) if h.chunk_id in chunks}
    coarse_score = {h.chunk_id: h.score for h in hits}
    candidates = [
        (cid, s, e)
        for cid in coarse_rank
        for s, e in sentence_windows(
            chunks[cid].text, config.window_neighbours, config.window_max_chars, config.min_snippet_chars
        )
    ]
    if not candidates:
        return []
    texts = [chunks[cid].text[s:e] for cid, s, e in candidates]
    fine = _dense_scores(index, query, texts) if config.fine_scorer == "dense" else _lexical_scores(query, texts)
    # Global ranking leans on the chunk's coarse rank: fine scores alone over-reward short matching phrases.
    prior = np.array([1.0 / (1 + coarse_rank[cid]) for cid, _, _ in candidates])
    total = fine + config.coarse_prior_weight * prior
    head: set[int] = set()
    if policy == "per_chunk":
        best_first = sorted(range(len(candidates)), key=lambda i: (coarse_rank[candidates[i][0]], -fine[i]))
        best: dict[str, float] = {}
        for i in best_first:
            best.setdefault(candidates[i][0], fine[i])
        firsts = {i for n, i in enumerate(best_first) if n == 0 or candidates[i][0] != candidates[best_first[n - 1]][0]}
        head = firsts | {
            i for i in best_first if fine[i] > 0 and fine[i] >= config.min_relative_score * best[candidates[i][0]]
        }
        order = [i for i in best_first if i in head] + [i for i in np.argsort(-total) if i not in head]
    else:
        order = list(np.argsort(-total))
    snippets: list[Snippet] = []
    taken: dict[str, list[tuple[int, int]]] = {}
    for i in order:
        cid, s, e = candidates[i]
        if any(s < te and ts < e for ts, te in taken.get(cid, [])):
            continue
        if i in head and len(taken.get(cid, [])) >= config.windows_per_chunk:
            continue
        taken.setdefault(cid, []).append((s, e))
        chunk = chunks[cid]
        start, end = chunk.start + s, chunk.start + e
        snippets.append(
            Snippet(
                id=f"{chunk.doc_id}@{start}-{end}",
                text=texts[i].strip(),
                chunk_id=cid,
                doc_id=chunk.doc_id,
                title=chunk.title,
                source=chunk.source,
                start=start,
                end=end,
                score=float(coarse_score[cid] if policy == "per_chunk" else total[i]),
                scores={
                    "fine": float(fine[i]),
                    "coarse": float(coarse_score[cid]),
                    "coarse_rank": float(coarse_rank[cid]),
                },
            )
        )
        if len(snippets) == k:
            break
    return snippets


def _dense_scores(index: Index, query: str, texts: list[str]) -> np.ndarray:
    return encode(texts, index.encoder) @ encode_queries([query], index.encoder)[0]


def _lexical_scores(query: str, texts: list[str], k1: float = 1.2, b: float = 0.75) -> np.ndarray:
    """BM25 of each window against the query, with statistics over the windows themselves, scaled to [0, 1].

    Computed directly: indexing a few hundred windows with bm25s cost more than scoring them."""
    import math

    windows = bm25_tokenize(texts, as_strings=True)
    terms = set(bm25_tokenize([query], as_strings=True)[0])
    counts = [{t: w.count(t) for t in terms.intersection(w)} for w in windows]
    df: dict[str, int] = {}
    for found in counts:
        for term in found:
            df[term] = df.get(term, 0) + 1
    n, avg_len = len(windows), max(sum(map(len, windows)) / max(len(windows), 1), 1.0)
    idf = {t: math.log(1 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()}
    scores = np.array(
        [
            sum(idf[t] * c * (k1 + 1) / (c + k1 * (1 - b + b * len(w) / avg_len)) for t, c in found.items())
            for w, found in zip(windows, counts)
        ]
    )
    return scores / max(float(scores.max(initial=0.0)), 1e-9)


def clean_query(query: str) -> str:
    return " ".join(query.split())[:MAX_QUERY_CHARS]


def retrieve(
    index: Index,
    query: str,
    *,
    k: int = SNIPPETS_K,
    coarse_k: int | None = None,
    config: RetrievalConfig = DEFAULT_CONFIG,
    query_vector: np.ndarray | None = None,
) -> list[Snippet]:
    """The default pipeline: coarse hybrid over `coarse_k` chunks (None: `coarse_k_for(k)`), then their best `k`
    sentence windows."""
    query = clean_query(query)
    if not query:
        return []
    hits = coarse_hybrid(index, query, coarse_k_for(k) if coarse_k is None else coarse_k, config, query_vector)
    return fine_sentence_windows(index, query, hits, k, config)


def coarse_k_for(k: int, coarse_k: int = COARSE_K) -> int:
    """Coarse chunks for `k` snippets: at least `k`, so each snippet can come from its own chunk. On the BioASQ
    held-out split `retrieve(k=10)` reads 10 chunks this way (recall@10 0.741; with 8 it was 0.703: benches/README).
    A `coarse_k` of 0 or less keeps no chunk, hence no snippet: it is not raised to `k`."""
    return max(coarse_k, k) if coarse_k > 0 else 0


def search(
    index: Index, query: str, *, k: int = SEARCH_K, coarse_k: int = COARSE_K, config: RetrievalConfig = DEFAULT_CONFIG
) -> list[dict[str, Any]]:
    """One search of Med-R³'s reason ↔ search loop as its training rollout runs it: the top `k` snippets (as
    dicts) of `coarse_k_for` coarse chunks. The graph's search node runs this same retrieval through the
    graphs' recording wrapper, so graph and rollout see the same documents."""
    return [s.to_dict() for s in retrieve(index, query, k=k, coarse_k=coarse_k_for(k, coarse_k), config=config)]


def retrieval_settings(k: int, coarse_k: int, config: RetrievalConfig) -> dict[str, Any]:
    """Everything that decided a retrieval's results besides the query and the index, as plain data (traces)."""
    return {"k": k, "coarse_k": coarse_k, **asdict(config)}


def retrieve_many(index: Index, queries: Sequence[str], **options: Any) -> list[list[Snippet]]:
    """`retrieve` for several queries, encoding them in one batch (faster per query than one at a time)."""
    cleaned = [clean_query(q) for q in queries]
    vectors = encode_queries([q or " " for q in cleaned], index.encoder)
    return [retrieve(index, q, query_vector=v, **options) for q, v in zip(cleaned, vectors)]
