"""Bench indexes, built with the project's own `tools.index.build_index` and reused while complete.

Passage vectors cached in the shared data stand in for the encoder wherever a chunk is a whole passage
(same title and text, so the same input to the same encoder); every other chunk is encoded for real.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ermedrag.tools.retrieval.corpus import Document

INDEX_FILES = {"manifest.json", "chroma", "bm25", "bench.json"}


def whole_passage_vectors(
    documents: list[Document], vectors: dict[str, np.ndarray], chunk_size: int, chunk_overlap: int
) -> tuple[dict[str, np.ndarray], Counter]:
    """Chunk id -> cached vector for chunks that are a whole passage; also chunks per document."""
    from ermedrag.tools.retrieval.corpus import chunk_documents

    chunks = chunk_documents(documents, chunk_size, chunk_overlap)
    per_doc = Counter(c.doc_id for c in chunks)
    reusable = {}
    for chunk in chunks:
        if per_doc[chunk.doc_id] == 1 and chunk.doc_id in vectors and chunk.start == 0:
            reusable[chunk.id] = vectors[chunk.doc_id]
    return reusable, per_doc


def ensure_index(
    index_dir: Path,
    documents: list[Document],
    vectors: dict[str, np.ndarray],
    *,
    chunk_size: int,
    chunk_overlap: int,
    fingerprint: dict,
    rebuild: bool,
) -> dict:
    """Reuse a complete bench index (its bench.json matches `fingerprint` and the manifest), else build it."""
    from ermedrag.tools.retrieval.index_files import read_manifest

    fingerprint = {**fingerprint, "chunk_size": chunk_size, "chunk_overlap": chunk_overlap}
    record_path = index_dir / "bench.json"
    if index_dir.exists() and not rebuild and record_path.exists():
        record = json.loads(record_path.read_text())
        if (
            record.get("fingerprint") == fingerprint
            and read_manifest(index_dir).get("chunks") == record["index"]["chunks"]
        ):
            refresh_bm25(index_dir)
            print(
                f"reusing the complete index at {index_dir} ({record['index']['chunks']:,} chunks, "
                f"built in {record['index']['build_seconds']:.0f} s)"
            )
            return record
        print(f"{index_dir} is incomplete or stale: rebuilding")
    if index_dir.exists() and any(index_dir.iterdir()):
        extra = {p.name for p in index_dir.iterdir() if p.name not in INDEX_FILES and not p.name.startswith(".bm25-")}
        if extra:
            sys.exit(f"{index_dir} holds files that are not a bench index ({sorted(extra)[:5]}): choose another dir")
        shutil.rmtree(index_dir)
    return _build_in_child(index_dir, documents, vectors, chunk_size, chunk_overlap, fingerprint)


def _build_in_child(
    index_dir: Path,
    documents: list[Document],
    vectors: dict[str, np.ndarray],
    chunk_size: int,
    chunk_overlap: int,
    fingerprint: dict,
) -> dict:
    """Build in a child process, so that the build's own peak RSS can be measured and recorded."""
    import multiprocessing
    import resource

    child = multiprocessing.get_context("fork").Process(
        target=_build, args=(index_dir, documents, vectors, chunk_size, chunk_overlap, fingerprint)
    )
    child.start()
    child.join()
    if child.exitcode:
        sys.exit(f"building {index_dir} failed (exit code {child.exitcode})")
    record = json.loads((index_dir / "bench.json").read_text())
    # The largest child so far: a build is the first child a bench run starts.
    record["index"]["build_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    (index_dir / "bench.json").write_text(json.dumps(record, indent=2))
    return record


def _build(
    index_dir: Path,
    documents: list[Document],
    vectors: dict[str, np.ndarray],
    chunk_size: int,
    chunk_overlap: int,
    fingerprint: dict,
) -> dict:
    from ermedrag.tools.retrieval.index import build_index

    t0 = time.perf_counter()
    reusable, per_doc = whole_passage_vectors(documents, vectors, chunk_size, chunk_overlap)
    plan_s = time.perf_counter() - t0
    # build_index encodes a whole add-batch when any chunk in it lacks a vector, so documents whose chunks
    # all need the encoder go in a first call, the rest in a second (same settings; adding is idempotent).
    cached_docs = {cid.rsplit("#", 1)[0] for cid in reusable}
    fresh = [d for d in documents if d.id not in cached_docs]
    cached = [d for d in documents if d.id in cached_docs]
    print(
        f"chunk_size={chunk_size}: {len(documents):,} documents -> {sum(per_doc.values()):,} chunks; "
        f"{len(reusable):,} are whole passages with cached vectors, the other "
        f"{sum(per_doc[d.id] for d in fresh):,} are encoded now (planning pass {plan_s:.0f} s, not counted)"
    )
    stats = []
    for label, docs in (("encoded now", fresh), ("cached vectors", cached)):
        if docs:
            print(f"build_index ({label}): {len(docs):,} documents", flush=True)
            stats.append(
                build_index(
                    docs,
                    index_dir,
                    chunk_size=chunk_size,
                    chunk_overlap=chunk_overlap,
                    precomputed=reusable,
                    progress=True,
                )
            )
            s = stats[-1]
            print(
                f"  +{s['chunks_added']:,} chunks in {s['seconds']:.1f} s (embedding {s['embed_seconds']:.1f} s, "
                f"bm25 {s['bm25_seconds']:.1f} s)",
                flush=True,
            )
    index = {
        "documents": len(documents),
        "chunks": stats[-1]["chunks_total"],
        "build_seconds": round(sum(s["seconds"] for s in stats), 1),
        "bm25_seconds": round(sum(s["bm25_seconds"] for s in stats), 1),
        "fresh_encoded": stats[0]["chunks_added"] if fresh else 0,
        "fresh_embed_seconds": round(stats[0]["embed_seconds"], 1) if fresh else 0.0,
    }
    record = {
        "fingerprint": fingerprint,
        "index": index,
        "calls": stats,
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    record["bm25"] = bm25_fingerprint()  # build_index used the current BM25 settings
    (index_dir / "bench.json").write_text(json.dumps(record, indent=2))
    return record


def refresh_bm25(index_dir: Path) -> None:
    """Rebuild only the BM25 part when its parameters or the stemmer changed since the index was built."""
    from ermedrag.tools.retrieval.index_files import BM25_PARAMS, read_manifest
    from ermedrag.tools.retrieval.index import rebuild_bm25  # noqa: PLC2701

    record_path = index_dir / "bench.json"
    record = json.loads(record_path.read_text())
    wanted = bm25_fingerprint()
    if record.get("bm25") == wanted and read_manifest(index_dir).get("bm25") == BM25_PARAMS:
        return
    t0 = time.perf_counter()
    rebuild_bm25(index_dir)
    print(f"{index_dir}: BM25 rebuilt with {wanted} in {time.perf_counter() - t0:.0f} s")
    record_path.write_text(json.dumps({**record, "bm25": wanted}, indent=2))


def bm25_fingerprint() -> dict:
    from importlib.metadata import version

    from ermedrag.tools.retrieval.index_files import BM25_PARAMS

    return {"params": BM25_PARAMS, "stemmer": version("PyStemmer"), "layout": "segments"}


def fingerprint(files: list[Path]) -> dict:
    return {"files": {p.name: p.stat().st_size for p in files}}
