"""BM25 in segments (tools/retrieval/bm25.py): however the chunks were split into commits, merged or not, a query's
scores equal, bit for bit, one bm25s index over all of them (the reference implementation, same parameters); a build
tokenizes only its new chunks; and indexes committed before segments open and convert.

Indexes here are built with hash vectors (no encoder): BM25 is what is under test."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from ermedrag.tools.retrieval.bm25 import (
    SegmentedBM25,
    bm25_text,
    bm25_tokenize,
    load_segment,
    merge_segments,
    segments_to_merge,
    write_segment,
)
from ermedrag.tools.retrieval.corpus import Document, read_documents
from ermedrag.tools.retrieval.index_files import BM25_PARAMS, chunk_texts
from ermedrag.tools.retrieval.index import _client, build_index, open_index, rebuild_bm25
from ermedrag.tools.retrieval.search import bm25_search, query_terms
from ermedrag.tools.data.starter_kb import PASSAGES
from ermedrag.testing.vectors import HashVectors

QUERIES = [
    "A 45-year-old man with type 2 diabetes, chest pain and an elevated troponin after metformin; which "
    "treatment is first-line for his hypertension?",
    "wheezing child asthma inhaled corticosteroid dose",
    "anaphylaxis epinephrine intramuscular thigh",
]


def starter_texts() -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in PASSAGES.read_text().splitlines() if line.strip()]
    return [r["id"] for r in rows], [bm25_text(r.get("title", ""), r["text"]) for r in rows]


def reference_scores(texts: list[str], weights: dict[str, float]) -> np.ndarray:
    """Σ w · BM25 from one bm25s index over every text (its own get_scores, one term at a time)."""
    import bm25s

    reference = bm25s.BM25(**BM25_PARAMS)
    reference.index(bm25_tokenize(texts), show_progress=False)
    return sum(np.float32(w) * reference.get_scores([t]) for t, w in weights.items())


def weighted_terms(bm25, query: str) -> dict[str, float]:
    terms = dict.fromkeys(query_terms(bm25, query))
    return {term: 1.0 + 0.5 * (number % 3) for number, term in enumerate(terms)}


def segments_of(folder: Path, ids: list[str], texts: list[str], bounds: list[int]) -> list:
    segments = []
    for number, (start, end) in enumerate(zip([0, *bounds], [*bounds, len(ids)])):
        (folder / f"s{number}").mkdir()
        write_segment(folder / f"s{number}", ids[start:end], texts[start:end])
        segments.append(load_segment(folder / f"s{number}"))
    return segments


def test_segments_score_as_one_bm25s_index_merged_or_not(tmp_path: Path) -> None:
    ids, texts = starter_texts()
    segments = segments_of(tmp_path, ids, texts, [30, 45, 52])
    (tmp_path / "merged").mkdir()
    merge_segments(tmp_path / "merged", segments)
    merged = load_segment(tmp_path / "merged")
    assert merged.ids == ids and merged.size == len(texts)
    for bm25 in (SegmentedBM25(segments, **BM25_PARAMS), SegmentedBM25([merged], **BM25_PARAMS)):
        for query in QUERIES:
            weights = weighted_terms(bm25, query)
            expected = reference_scores(texts, weights)
            assert len(weights) >= 3 and expected.max() > 0
            np.testing.assert_array_equal(bm25.scores(weights), expected)


def test_merging_concatenates_postings_of_terms_shared_and_not(tmp_path: Path) -> None:
    texts = ["aspirin aspirin warfarin", "warfarin bleeding", "aspirin", "insulin insulin insulin glucose"]
    segments = segments_of(tmp_path, ["a", "b", "c", "d"], texts, [2, 3])
    (tmp_path / "merged").mkdir()
    merge_segments(tmp_path / "merged", segments)
    merged = load_segment(tmp_path / "merged")

    def postings(term: str) -> list[tuple[int, float]]:
        t = merged.terms[term]
        span = slice(int(merged.indptr[t]), int(merged.indptr[t + 1]))
        return list(zip(merged.chunks[span].tolist(), merged.tf[span].tolist()))

    assert postings("aspirin") == [(0, 2.0), (2, 1.0)]
    assert postings("warfarin") == [(0, 1.0), (1, 1.0)]
    assert postings("insulin") == [(3, 3.0)]
    assert merged.lengths.tolist() == [3.0, 2.0, 1.0, 4.0]


def test_unknown_terms_and_empty_texts_score_nothing(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    write_segment(tmp_path / "s", ["a", "b"], ["", "the of and"])  # nothing left after stop words
    bm25 = SegmentedBM25([load_segment(tmp_path / "s")], **BM25_PARAMS)
    assert "aspirin" not in bm25
    assert bm25.scores({"aspirin": 1.0}).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "sizes, merged",
    [([100, 10], 1), ([100, 10, 10], 2), ([30, 20, 10, 40], 4), ([64, 32, 16, 8, 8], 5), ([5], 1), ([], 1)],
)
def test_the_newest_segments_merge_while_the_tail_is_as_large_as_its_neighbour(sizes, merged) -> None:
    assert segments_to_merge(sizes) == merged


def test_segment_count_stays_logarithmic_however_chunks_are_added() -> None:
    rng = np.random.default_rng(0)
    sizes: list[int] = []
    for batch in rng.integers(1, 50, size=400).tolist():
        sizes.append(batch)
        count = segments_to_merge(sizes)
        sizes[-count:] = [sum(sizes[-count:])]
        assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes  # strictly falling sizes
        assert len(sizes) <= math.log2(sum(sizes)) + 1


def _documents(start: int, end: int) -> list[Document]:
    return list(read_documents([PASSAGES]))[start:end]


def test_builds_add_segments_of_their_new_chunks_and_score_as_one_index(tmp_path: Path) -> None:
    directory = tmp_path / "index"
    added = []
    for start, end in [(0, 40), (40, 50), (50, 58), (58, 60), (60, 72)]:
        stats = build_index(_documents(0, end), directory, precomputed=HashVectors(), progress=False)
        added.append(stats["chunks_added"])
        manifest = json.loads((directory / "manifest.json").read_text())
        names = [s["name"] for s in manifest["bm25_segments"]]
        assert {p.name for p in (directory / "bm25").iterdir()} == {".lock", *names}
        assert sum(s["chunks"] for s in manifest["bm25_segments"]) == manifest["chunks"] == stats["chunks_total"]
        sizes = [s["chunks"] for s in manifest["bm25_segments"]]
        assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
    assert all(added) and len(sizes) >= 2  # each build added chunks; several segments are left unmerged
    index = open_index(directory)
    ids, texts = chunk_texts(index.collection)
    order = {cid: text for cid, text in zip(ids, texts)}
    committed_texts = [order[cid] for cid in index.bm25_ids]
    assert sorted(index.bm25_ids) == sorted(ids)
    for query in QUERIES:
        weights = weighted_terms(index.bm25, query)
        np.testing.assert_array_equal(index.bm25.scores(weights), reference_scores(committed_texts, weights))
    hits = bm25_search(index, "anaphylaxis epinephrine", 3)
    assert hits and "anaphylaxis" in index.chunks([hits[0].chunk_id])[hits[0].chunk_id].text.lower()


def test_a_build_with_nothing_new_keeps_the_segments(tmp_path: Path) -> None:
    directory = tmp_path / "index"
    build_index(_documents(0, 20), directory, precomputed=HashVectors(), progress=False)
    before = json.loads((directory / "manifest.json").read_text())["bm25_segments"]
    assert build_index(_documents(0, 20), directory, precomputed=HashVectors(), progress=False)["chunks_added"] == 0
    assert json.loads((directory / "manifest.json").read_text())["bm25_segments"] == before


def test_indexing_the_same_files_again_repairs_a_lost_segment(tmp_path: Path) -> None:
    from ermedrag.tools.retrieval.index_files import IndexUnavailable

    directory = tmp_path / "index"
    build_index(_documents(0, 40), directory, precomputed=HashVectors(), progress=False)
    build_index(_documents(0, 50), directory, precomputed=HashVectors(), progress=False)
    segments = json.loads((directory / "manifest.json").read_text())["bm25_segments"]
    assert len(segments) == 2
    shutil.rmtree(directory / "bm25" / segments[-1]["name"])
    with pytest.raises(IndexUnavailable, match=segments[-1]["name"]):
        open_index(directory)
    stats = build_index(_documents(0, 50), directory, precomputed=HashVectors(), progress=False)
    index = open_index(directory)
    assert stats["chunks_total"] == len(index.bm25_ids) == len(set(index.bm25_ids)) == index.size
    text_of = dict(zip(*chunk_texts(index.collection)))
    weights = weighted_terms(index.bm25, QUERIES[1])
    np.testing.assert_array_equal(
        index.bm25.scores(weights), reference_scores([text_of[cid] for cid in index.bm25_ids], weights)
    )


def as_one_bm25s_index(directory: Path, generation: str | None) -> list[str]:
    """Turn a built index into the layout before segments: one bm25s index with ids.json in bm25/<generation>
    named by the manifest, or (generation None, the oldest layout) in bm25/ itself; returns its BM25 texts."""
    import bm25s

    manifest = json.loads((directory / "manifest.json").read_text())
    for segment in manifest.pop("bm25_segments"):
        shutil.rmtree(directory / "bm25" / segment["name"])
    ids, texts = chunk_texts(_client(directory, None).get_collection("chunks"))
    legacy = bm25s.BM25(**BM25_PARAMS)
    legacy.index(bm25_tokenize(texts), show_progress=False)
    folder = directory / "bm25" / (generation or "")
    legacy.save(str(folder))
    (folder / "ids.json").write_text(json.dumps(ids))
    (directory / "manifest.json").write_text(
        json.dumps({**manifest, **({"bm25_generation": generation} if generation else {})})
    )
    return texts


def test_an_index_of_one_bm25s_generation_opens_and_converts(tmp_path: Path) -> None:
    """The layout before segments: the manifest names a bm25s generation folder holding ids.json."""
    directory = tmp_path / "index"
    build_index(_documents(0, 30), directory, precomputed=HashVectors(), progress=False)
    texts = as_one_bm25s_index(directory, "g000004")

    index = open_index(directory)
    weights = weighted_terms(index.bm25, QUERIES[0])
    np.testing.assert_array_equal(index.bm25.scores(weights), reference_scores(texts, weights))
    stats = build_index(_documents(0, 40), directory, precomputed=HashVectors(), progress=False)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert "bm25_generation" not in manifest and manifest["bm25_segments"] == [
        {"name": "s000005", "chunks": stats["chunks_total"]}
    ]  # every chunk re-indexed into one segment
    assert {p.name for p in (directory / "bm25").iterdir()} == {".lock", "s000005"}
    assert rebuild_bm25(directory) == stats["chunks_total"]
    assert [s["name"] for s in json.loads((directory / "manifest.json").read_text())["bm25_segments"]] == ["s000006"]


@pytest.mark.parametrize("listed", [[{"name": "../../elsewhere", "chunks": 3}], [{"name": "s000001"}], ["s000001"]])
def test_a_manifest_with_bad_segment_entries_is_refused_naming_the_problem(tmp_path: Path, listed) -> None:
    from ermedrag.tools.retrieval.index_files import IndexUnavailable

    directory = tmp_path / "index"
    build_index(_documents(0, 5), directory, precomputed=HashVectors(), progress=False)
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**manifest, "bm25_segments": listed}))
    with pytest.raises(IndexUnavailable, match="manifest.json"):
        open_index(directory)
