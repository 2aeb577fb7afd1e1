"""BM25 in segments: a commit indexes only its new chunks, and a query scores them all as one BM25.

A segment stores raw term frequencies (postings by term) and each chunk's length, not precomputed scores, so a
query scores with the statistics of every committed segment together (chunk count, document frequency, mean
length): the same scores as one BM25 over all chunks (Lucene's variant, rounded where bm25s rounds; tested
equal to bm25s's bit for bit), however the chunks were split into commits. Adding 10k chunks to a million
therefore tokenizes 10k texts, where a single bm25s index had to re-index the million.

The newest segments are merged (postings concatenated; no text is tokenized again) while the newest is at least
as large as the one before it, so sizes fall geometrically and N chunks never need more than log2(N) segments.
A build that replaces documents writes each segment holding their old chunks again without them (postings
copied, terms left with none dropped), so the scores stay those of one BM25 over the chunks committed.

    bm25/s000004/  terms.json (the segment's vocabulary, by term id), ids.json (chunk ids, by position),
                   indptr.npy, chunks.npy, tf.npy (each term's postings: chunk positions and frequencies),
                   lengths.npy (tokens per chunk)

Postings are memory-mapped: a query reads only its terms' pages.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import numpy as np

from ermedrag.tools.cache import shared_resource

ARRAYS = ("indptr", "chunks", "tf", "lengths")


@shared_resource(maxsize=1)
def snowball_stemmer() -> Any:
    import Stemmer

    return Stemmer.Stemmer("english")


def bm25_tokenize(texts: Sequence[str], as_strings: bool = False) -> Any:
    """English stop words removed, Snowball-stemmed; ids+vocab for indexing, or token strings."""
    import bm25s

    return bm25s.tokenize(
        list(texts), stopwords="en", stemmer=snowball_stemmer(), show_progress=False, return_ids=not as_strings
    )


def bm25_text(title: str, text: str) -> str:
    """What BM25 indexes for a chunk: its title and its text."""
    return f"{title}. {text}"


@dataclass(frozen=True)
class Segment:
    """One segment, opened: vocabulary and chunk ids in memory, postings memory-mapped."""

    ids: list[str]
    terms: dict[str, int]
    indptr: np.ndarray  # term id -> its postings' span in chunks/tf
    chunks: np.ndarray  # chunk positions within the segment, ascending within each term
    tf: np.ndarray  # occurrences of the term in that chunk
    lengths: np.ndarray  # tokens per chunk

    @property
    def size(self) -> int:
        return len(self.ids)


def write_segment(folder: Path, ids: Sequence[str], texts: Sequence[str]) -> None:
    """Tokenize `texts` (one per chunk id) and write their segment's files into `folder`."""
    tokenized = bm25_tokenize(texts)
    vocabulary = sorted(tokenized.vocab, key=tokenized.vocab.get)  # term strings by term id
    lengths = np.fromiter((len(tokens) for tokens in tokenized.ids), dtype=np.int64, count=len(ids))
    term_of = np.fromiter(chain.from_iterable(tokenized.ids), dtype=np.int32, count=int(lengths.sum()))
    chunk_of = np.repeat(np.arange(len(ids), dtype=np.int32), lengths)
    del tokenized
    _write_postings(
        folder, ids, vocabulary, term_of, chunk_of, np.ones(len(term_of), dtype=np.float32), lengths.astype(np.float32)
    )


def merge_segments(folder: Path, segments: Sequence[Segment], drop: Collection[str] = frozenset()) -> None:
    """Write one segment holding `segments`' chunks in their order (their postings concatenated), leaving out
    the chunks whose ids are in `drop` (a replaced document's: their postings go, and terms left with none)."""
    vocabulary: dict[str, int] = {}
    ids: list[str] = []
    term_of, chunk_of, tf, lengths = [], [], [], []
    for segment in segments:
        local_terms = sorted(segment.terms, key=segment.terms.get)
        mapping = np.fromiter(
            (vocabulary.setdefault(t, len(vocabulary)) for t in local_terms), dtype=np.int32, count=len(local_terms)
        )
        terms = np.repeat(mapping, np.diff(np.asarray(segment.indptr)))
        chunks, counts, sizes = np.asarray(segment.chunks, dtype=np.int32), np.asarray(segment.tf), segment.lengths
        kept = [cid not in drop for cid in segment.ids] if drop else None
        if kept is not None and not all(kept):
            keep = np.asarray(kept, dtype=bool)
            position = (np.cumsum(keep) - 1).astype(np.int32)  # a kept chunk's position among the kept ones
            postings = keep[chunks]
            terms, chunks, counts, sizes = terms[postings], position[chunks[postings]], counts[postings], sizes[keep]
            ids.extend(cid for cid, k in zip(segment.ids, kept) if k)
        else:
            ids.extend(segment.ids)
        term_of.append(terms)
        chunk_of.append(chunks + np.int32(len(ids) - len(sizes)))
        tf.append(counts)
        lengths.append(sizes)
    terms = np.concatenate(term_of)
    words = list(vocabulary)
    used = np.zeros(len(words), dtype=bool)
    used[terms] = True
    if not used.all():  # terms only the dropped chunks had: gone, as from a segment written without them
        terms = (np.cumsum(used) - 1).astype(np.int32)[terms]
        words = [w for w, u in zip(words, used) if u]
    _write_postings(folder, ids, words, terms, np.concatenate(chunk_of), np.concatenate(tf), np.concatenate(lengths))


def _write_postings(
    folder: Path,
    ids: Sequence[str],
    vocabulary: list[str],
    term_of: np.ndarray,
    chunk_of: np.ndarray,
    counts: np.ndarray,
    lengths: np.ndarray,
) -> None:
    """Postings by term from one (term, chunk, count) triple per occurrence, chunks ascending: a stable sort by
    term keeps each term's chunks in order, and equal neighbours (same term, same chunk) add up."""
    order = np.argsort(term_of, kind="stable")
    term_of, chunk_of, counts = term_of[order], chunk_of[order], counts[order]
    del order
    first = np.ones(len(term_of), dtype=bool)  # the first occurrence of each (term, chunk)
    first[1:] = (term_of[1:] != term_of[:-1]) | (chunk_of[1:] != chunk_of[:-1])
    starts = np.flatnonzero(first)
    tf = np.add.reduceat(counts, starts) if len(starts) else counts
    term_of, chunk_of = term_of[starts], chunk_of[starts]
    indptr = np.zeros(len(vocabulary) + 1, dtype=np.int64)
    np.cumsum(np.bincount(term_of, minlength=len(vocabulary)), out=indptr[1:])
    arrays = {"indptr": indptr, "chunks": chunk_of, "tf": tf.astype(np.float32), "lengths": lengths}
    for name in ARRAYS:
        np.save(folder / f"{name}.npy", arrays[name])
    (folder / "terms.json").write_text(json.dumps(vocabulary))
    (folder / "ids.json").write_text(json.dumps(list(ids)))


def segment_ids(folder: Path) -> list[str]:
    return json.loads((folder / "ids.json").read_text())


def load_segment(folder: Path) -> Segment:
    """Open a segment; FileNotFoundError when a file is missing (a build removed it meanwhile)."""
    terms = json.loads((folder / "terms.json").read_text())
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    return Segment(
        ids=segment_ids(folder),
        terms={t: i for i, t in enumerate(terms)},
        indptr=arrays["indptr"],
        chunks=arrays["chunks"],
        tf=arrays["tf"],
        lengths=np.array(arrays["lengths"]),
    )


def segments_to_merge(sizes: Sequence[int]) -> int:
    """How many of the newest segments (sizes oldest first) to merge into one: while the merged tail is at least
    as large as the segment before it. 1 means none."""
    count, size = 1, sizes[-1] if sizes else 0
    while count < len(sizes) and size >= sizes[-count - 1]:
        size += sizes[-count - 1]
        count += 1
    return count


class SegmentedBM25:
    """Lucene BM25 (idf = ln(1 + (N - df + 0.5)/(df + 0.5)), tf / (tf + k1(1 - b + b·len/avglen))) over
    segments, with the statistics of all of them."""

    def __init__(self, segments: Sequence[Segment], k1: float, b: float):
        self.segments = list(segments)
        self.num_chunks = sum(s.size for s in self.segments)
        lengths = np.concatenate([s.lengths for s in self.segments]) if self.segments else np.zeros(0)
        mean_length = float(lengths.mean(dtype=np.float64)) if len(lengths) and lengths.any() else 1.0
        self.offsets = np.cumsum([0] + [s.size for s in self.segments]).tolist()
        # Each chunk's length normalisation k1(1 - b + b·len/avglen), once per opening, as a view per segment. It
        # stays float64, like bm25s's, so that every score rounds to the same float32 as one bm25s index.
        norms = k1 * ((1 - b) + b * lengths.astype(np.float64) / mean_length)
        self.norms = [norms[start : start + s.size] for start, s in zip(self.offsets, self.segments)]

    def __contains__(self, term: str) -> bool:
        return any(term in s.terms for s in self.segments)

    def scores(self, term_weights: Mapping[str, float]) -> np.ndarray:
        """Σ w_t · BM25(t, chunk) for every chunk in commit order, read from each term's postings only."""
        scores = np.zeros(self.num_chunks, dtype=np.float32)
        for term, weight in term_weights.items():
            spans = [
                (i, int(s.indptr[t]), int(s.indptr[t + 1]))
                for i, s in enumerate(self.segments)
                if (t := s.terms.get(term)) is not None
            ]
            df = sum(end - start for _, start, end in spans)
            if not df:
                continue
            # Rounded where bm25s rounds: idf to float32, then idf·tf-part (float64) to the float32 it stores.
            idf = np.float64(np.float32(math.log(1 + (self.num_chunks - df + 0.5) / (df + 0.5))))
            for i, start, end in spans:
                segment, offset = self.segments[i], self.offsets[i]
                chunks, tf = segment.chunks[start:end], segment.tf[start:end].astype(np.float64)
                posting_scores = (idf * (tf / (self.norms[i][chunks] + tf))).astype(np.float32)
                view = scores[offset : offset + segment.size]
                view[chunks] += np.float32(weight) * posting_scores  # a chunk appears once per term
        return scores


class SingleBM25s:
    """An index committed before segments: one bm25s index of precomputed scores (opened as it is; its next
    build writes segments)."""

    def __init__(self, retriever: Any):
        self.retriever = retriever
        self.num_chunks = int(retriever.scores["num_docs"])

    def __contains__(self, term: str) -> bool:
        return term in self.retriever.vocab_dict

    def scores(self, term_weights: Mapping[str, float]) -> np.ndarray:
        matrix = self.retriever.scores
        data, indices, indptr = matrix["data"], matrix["indices"], matrix["indptr"]
        scores = np.zeros(self.num_chunks, dtype=np.float32)
        for term, weight in term_weights.items():
            term_id = self.retriever.vocab_dict.get(term)
            if term_id is None:
                continue
            start, end = int(indptr[term_id]), int(indptr[term_id + 1])
            scores[indices[start:end]] += np.float32(weight) * data[start:end]  # a chunk appears once per term
        return scores
