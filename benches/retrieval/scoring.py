"""Per-question metrics for both settings (means over questions are the reported figures)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from data import Span

DEPTH = 100  # results ranked per query (mrr@100)
MIN_OVERLAP = 0.5


def passage_of(chunk_id: str) -> str:
    """The passage id of a chunk id (`passage#start-end`)."""
    return chunk_id.rsplit("#", 1)[0]


def passage_ids(chunk_ids: Iterable[str]) -> list[str]:
    """The passages of ranked chunk ids, each once, in rank order."""
    return list(dict.fromkeys(map(passage_of, chunk_ids)))


def score_passages(question: dict, ranked: list[str]) -> dict[str, float]:
    """`passage_metrics` against a qrels question's gold passages."""
    return passage_metrics(ranked, set(question["gold"]))


def passage_metrics(ranked: Sequence[str], gold: set[str]) -> dict[str, float]:
    """Setting 1: `ranked` passage ids (deduplicated), `gold` passage ids."""
    return _metrics([{p} & gold for p in ranked[:DEPTH]], len(gold))


def snippet_metrics(snippets: Sequence[Span], gold: Sequence[Span]) -> dict[str, float]:
    """Setting 2: a returned snippet finds a gold passage when their character overlap is at least half of
    the longer of the two (so a whole chunk that merely contains a short gold sentence does not count);
    `contained@10` is the lenient reading, at least half of the gold passage inside the snippet."""
    by_doc: dict[str, list[int]] = {}
    for i, g in enumerate(gold):
        by_doc.setdefault(g.doc_id, []).append(i)
    found = [
        {i for i in by_doc.get(s.doc_id, ()) if _overlap(s, gold[i]) >= MIN_OVERLAP * max(_len(s), _len(gold[i]))}
        for s in snippets[:DEPTH]
    ]
    out = _metrics(found, len(gold))
    contained = set().union(
        *[
            {i for i in by_doc.get(s.doc_id, ()) if _overlap(s, gold[i]) >= MIN_OVERLAP * _len(gold[i])}
            for s in snippets[:10]
        ]
    )
    out["contained@10"] = len(contained) / len(gold)
    out["snippet_chars"] = sum(_len(s) for s in snippets[:10]) / max(len(snippets[:10]), 1)
    return out


def _metrics(found: list[set], n_gold: int) -> dict[str, float]:
    """`found[r]`: the gold items the result at rank r+1 finds (each gold item counts once)."""
    top = found[:10]
    first = next((r for r, f in enumerate(found) if f), None)
    seen: set = set()
    dcg = 0.0
    for r, f in enumerate(top):
        if f - seen:
            dcg += 1 / math.log2(r + 2)
        seen |= f
    idcg = sum(1 / math.log2(r + 2) for r in range(min(n_gold, 10)))
    return {
        "hit@10": float(bool(seen)),
        "recall@10": len(seen) / n_gold,
        "mrr@100": 0.0 if first is None else 1 / (first + 1),
        "ndcg@10": dcg / idcg,
    }


def _overlap(a: Span, b: Span) -> int:
    return max(0, min(a.end, b.end) - max(a.start, b.start))


def _len(span: Span) -> int:
    return max(span.end - span.start, 1)
