"""An index is consistent at every instant: builds SIGKILLed at any point (real kills of real subprocesses
writing a real Chroma store, bm25s and the manifest) leave the last committed state, or one that opening
repairs to it; a rerun of the build then completes the index.

Children never load the encoder: vectors come from a hash of the chunk id (`HashVectors`, passed as
`precomputed`), and retrieval is given a query vector, so a child costs its imports and first build (~4 s).
The test process opens, checks and rebuilds the index between kills itself, with a fresh Chroma client each
time (and never while a child writes); the last check of each test is in a fresh process.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO
from ermedrag.testing.vectors import HashVectors, hash_vector
from ermedrag.tools.retrieval.corpus import Document, chunk_documents, read_documents
from ermedrag.tools.retrieval.index_files import PAUSE_ENV, IndexUnavailable, writer_lock
from ermedrag.tools.retrieval.index import _client, build_index, cached_index, open_index, rebuild_bm25

DOCS_PER_STEP = 24
CHILD_TIMEOUT_S = 120
TOPICS = [
    "metformin lowers hepatic glucose output",
    "epinephrine treats anaphylaxis intramuscularly",
    "amoxicillin treats community acquired pneumonia",
    "warfarin needs INR monitoring",
    "salbutamol relieves acute bronchospasm",
    "levothyroxine replaces thyroid hormone",
]


# One script, three modes. `build N`: index the first N documents (announcing "building" on stderr first, so
# the parent can time a kill from there). `open`: what the index holds (after opening it, which may repair
# it). `verify N`: that, then build the first N documents and report again. Also run in-process (`_verify`).
CHILD = r"""
import json, sys
from ermedrag.tools.retrieval import index as ix, index_files
from ermedrag.tools.retrieval.corpus import read_documents
from ermedrag.testing.vectors import HashVectors
from tests.tools.retrieval.test_index_durability import index_state, verify

mode, corpus, directory, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ix.ADD_BATCH = 4  # many Chroma adds: kills land between and inside them
ix.PAGE = index_files.PAGE = int(sys.argv[5]) if len(sys.argv) > 5 else index_files.PAGE  # read in both

if mode == "build":
    documents = read_documents([corpus])[:n]
    print("building", file=sys.stderr, flush=True)
    ix.build_index(documents, directory, precomputed=HashVectors(), progress=False)
    print("built", file=sys.stderr, flush=True)
elif mode == "open":
    print(json.dumps(index_state(directory)))
else:
    print(json.dumps(verify(corpus, directory, n)))
"""


def index_state(directory: str | Path) -> dict[str, Any]:
    """What opening the index gives (it may repair it first): its ids in BM25, Chroma and the manifest, and
    a retrieval; `peek` is the collection's count before opening."""
    from ermedrag.tools.retrieval import index as ix
    from ermedrag.tools.retrieval.search import retrieve

    try:
        peek = ix._client(Path(directory), None).get_collection(ix.COLLECTION).count()
    except Exception:  # noqa: BLE001 (no store yet)
        peek = None
    try:
        index = ix.open_index(directory)
    except ix.IndexUnavailable as err:
        return {"unavailable": str(err), "peek": peek}
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    snippets = retrieve(index, "anaphylaxis epinephrine", query_vector=hash_vector("q"))
    return {
        "bm25": index.bm25_ids,
        "chroma": index.collection.get(include=[])["ids"],
        "peek": peek,
        "manifest_chunks": manifest["chunks"],
        "identity": index.identity()["chunks"],
        "snippet_chunks": [s.chunk_id for s in snippets],
    }


def verify(corpus: str | Path, directory: str | Path, n: int) -> dict[str, Any]:
    """The index as opened (with the warnings opening logged), then a build of the first `n` documents, then
    the index again."""
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ermedrag.tools.retrieval.index")
    logger.addHandler(handler)
    try:
        before = {**index_state(directory), "warnings": warnings}
    finally:
        logger.removeHandler(handler)
    stats = build_index(read_documents([corpus])[:n], directory, precomputed=HashVectors(), progress=False)
    return {"before": before, "stats": stats, "after": index_state(directory)}


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(PAUSE_ENV, None)
    return {**env, **extra}


def _corpus(path: Path, n: int) -> Path:
    records = [
        {
            "id": f"doc-{i:04d}",
            "title": f"Note {i}",
            "text": f"Note {i}: {TOPICS[i % len(TOPICS)]}. " + " ".join(f"term{i}x{j}" for j in range(12)),
            "source": "durability",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _ids(corpus: Path, n: int) -> set[str]:
    return {c.id for c in chunk_documents(read_documents([corpus])[:n])}


def _verify(corpus: Path, directory: Path, n: int, fresh_process: bool = False) -> dict[str, Any]:
    """`verify` here, with Chroma clients of this process dropped before and after (a child writes next), or
    in a fresh process."""
    if fresh_process:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, "verify", str(corpus), str(directory), str(n)],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    _drop_chroma_clients()
    try:
        return json.loads(json.dumps(verify(corpus, directory, n)))
    finally:
        _drop_chroma_clients()


def _drop_chroma_clients() -> None:
    from chromadb.api.shared_system_client import SharedSystemClient

    cached_index.cache_clear()
    SharedSystemClient.clear_system_cache()
    gc.collect()


def _start_build(corpus: Path, directory: Path, n: int, pause: str = "") -> subprocess.Popen[str]:
    extra = {PAUSE_ENV: pause} if pause else {}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, "build", str(corpus), str(directory), str(n)],
        cwd=REPO,
        env=_env(**extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_line(proc: subprocess.Popen[str], wanted: str, timeout_s: float = CHILD_TIMEOUT_S) -> list[str]:
    """stderr lines until one contains `wanted` (the child is then at that point), or the child exits."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if wanted in line:
            return lines
    raise AssertionError(f"child never reached {wanted!r}: " + "".join(lines)[-4000:])


def _kill(proc: subprocess.Popen[str]) -> bool:
    """SIGKILL; whether the child was still running (False: it had finished the build)."""
    running = proc.poll() is None
    if running:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    return running


def _assert_committed(state: dict[str, Any], allowed: list[set[str]], label: str) -> set[str]:
    """One committed state: the same chunk ids in BM25, Chroma and the manifest, one of `allowed`."""
    if "unavailable" in state:
        assert set() in allowed and "no index at" in state["unavailable"], (label, state)
        return set()
    bm25, chroma = set(state["bm25"]), set(state["chroma"])
    assert len(state["bm25"]) == len(bm25) == state["manifest_chunks"] == state["identity"], label
    assert bm25 == chroma, (label, sorted(bm25 ^ chroma)[:5])
    assert bm25 in allowed, (label, len(bm25), [len(a) for a in allowed])
    assert state["snippet_chunks"] and set(state["snippet_chunks"]) <= bm25, label
    return bm25


def _assert_reported_repair(before: dict[str, Any], label: str) -> None:
    """Opening said so when it removed uncommitted chunks (how many the store held beyond the commit)."""
    if "unavailable" in before or before["peek"] is None:
        return
    extra = before["peek"] - len(before["bm25"])
    repairs = [w for w in before["warnings"] if "interrupted build" in w]
    if extra > 0:
        assert repairs and f"removed {extra} chunks" in repairs[0], (label, before["warnings"])
    else:
        assert not repairs, (label, before["warnings"])


def _kill_and_recover(
    corpus: Path, directory: Path, step: int, kill: Any, label: str, expect: str = "either", fresh_process: bool = False
) -> dict[str, Any]:
    """After `kill()` has killed the build of the first (step+1)*DOCS_PER_STEP documents: the index is the
    previous commit or the new one (`expect`), and a rerun of the same build gives the full new one."""
    n = (step + 1) * DOCS_PER_STEP
    previous, wanted = _ids(corpus, step * DOCS_PER_STEP), _ids(corpus, n)
    kill()
    result = _verify(corpus, directory, n, fresh_process)
    allowed = {"either": [previous, wanted], "previous": [previous], "new": [wanted]}[expect]
    _assert_committed(result["before"], allowed, label)
    _assert_reported_repair(result["before"], label)
    assert _assert_committed(result["after"], [wanted], label + " rerun") == wanted
    assert result["stats"]["chunks_total"] == len(wanted)
    leftovers = {p.name for p in (directory / "bm25").iterdir()} - {".lock"}
    committed = {s["name"] for s in json.loads((directory / "manifest.json").read_text())["bm25_segments"]}
    assert leftovers == committed, (label, leftovers)  # the committed segments only
    assert not (directory / "manifest.json.tmp").exists()
    return result


# --- deterministic kill points (default run) ---------------------------------------------------------------


def test_killed_at_named_points_the_index_is_the_last_commit(tmp_path: Path) -> None:
    """Three builds, each adding documents, killed: after the manifest rename (the new commit stands), after
    the first Chroma add (the previous commit; the 4 added chunks are removed), and with the new manifest
    written but not yet renamed (the previous commit)."""
    points = [("committed", "new"), ("vectors_added", "previous"), ("manifest_staged", "previous")]
    corpus, directory = _corpus(tmp_path / "corpus.jsonl", len(points) * DOCS_PER_STEP), tmp_path / "index"
    for step, (point, expect) in enumerate(points):
        proc = _start_build(corpus, directory, (step + 1) * DOCS_PER_STEP, pause=f"{point}:60")

        def kill(proc: subprocess.Popen[str] = proc, point: str = point) -> None:
            _wait_for_line(proc, f"{PAUSE_ENV} {point}")
            if point == "manifest_staged":
                assert (directory / "manifest.json.tmp").exists()
            assert _kill(proc), "the child finished before the kill"

        result = _kill_and_recover(corpus, directory, step, kill, point, expect, fresh_process=step == len(points) - 1)
        if point == "vectors_added":  # the first add batch (4 chunks) was in the store, uncommitted
            assert result["before"]["peek"] == len(result["before"]["bm25"]) + 4


# --- random kill points (slow) -----------------------------------------------------------------------------


KILL_POINTS = 20
SEED = 20240611


@pytest.mark.slow
def test_killed_at_20_random_points_the_index_is_the_last_commit(tmp_path: Path) -> None:
    """Kills after random delays across whole builds (about half of them timed from a named point, to reach
    inside the BM25 write and around the manifest rename), plus kills inside an opening reader's repair."""
    rng = random.Random(SEED)
    corpus, directory = _corpus(tmp_path / "corpus.jsonl", (KILL_POINTS + 1) * DOCS_PER_STEP), tmp_path / "index"
    # How long a build runs here (from "building" to "built"), to spread the plain delays over it.
    probe = tmp_path / "probe-index"
    proc = _start_build(corpus, probe, 2 * DOCS_PER_STEP)
    _wait_for_line(proc, "building")
    t0 = time.monotonic()
    _wait_for_line(proc, "built")
    build_s = time.monotonic() - t0
    _kill(proc)
    points = ["vectors_added", "bm25_writing", "bm25_staged", "manifest_staged", "committed"]
    outcomes: dict[str, int] = {}
    for step in range(KILL_POINTS):
        if step % 2 == 0:  # plain: a random delay from the start of the build
            delay, pause, marker = rng.uniform(0, 1.2 * build_s), "", "building"
        else:  # from a named point, which sleeps a little to widen its window, then the kill lands at random
            point = points[(step // 2) % len(points)]
            delay, pause, marker = rng.uniform(0, 0.08), f"{point}:0.03", f"{PAUSE_ENV} {point}"
        n = (step + 1) * DOCS_PER_STEP
        proc = _start_build(corpus, directory, n, pause=pause)

        def kill(proc: subprocess.Popen[str] = proc, marker: str = marker, delay: float = delay) -> None:
            _wait_for_line(proc, marker)
            time.sleep(delay)
            outcome = "killed" if _kill(proc) else "finished"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        result = _kill_and_recover(
            corpus,
            directory,
            step,
            kill,
            f"step {step} ({marker} +{delay:.3f}s)",
            fresh_process=step == KILL_POINTS - 1,
        )
        landed = (
            "new commit"
            if len(result["before"].get("bm25", [])) == len(result["after"]["bm25"])
            else ("previous commit, repaired" if result["before"]["warnings"] else "previous commit")
        )
        outcomes[landed] = outcomes.get(landed, 0) + 1
        if step % 5 == 4:  # a reader killed while it repairs what a killed build left, then opened again
            _kill_a_repairing_reader(corpus, directory, step + 1)
    print(f"{KILL_POINTS} kills (build ~{build_s:.1f}s): {outcomes}")
    assert outcomes.get("killed", 0) >= KILL_POINTS // 2, outcomes


def _kill_a_repairing_reader(corpus: Path, directory: Path, step: int) -> None:
    n = (step + 1) * DOCS_PER_STEP
    committed = _ids(corpus, step * DOCS_PER_STEP)
    proc = _start_build(corpus, directory, n, pause="bm25_staged:60")  # all its chunks added, uncommitted
    _wait_for_line(proc, f"{PAUSE_ENV} bm25_staged")
    _kill(proc)
    reader = subprocess.Popen(
        [sys.executable, "-c", CHILD, "open", str(corpus), str(directory), str(n), "5"],
        cwd=REPO,
        env=_env(**{PAUSE_ENV: "repairing:60"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_line(reader, f"{PAUSE_ENV} repairing")  # the first 5 uncommitted chunks are deleted
    except AssertionError as err:
        raise AssertionError(f"{err}\nreader stdout: {reader.communicate(timeout=30)[0][-3000:]}") from None
    _kill(reader)
    reader.stdout.close()
    result = _verify(corpus, directory, step * DOCS_PER_STEP)
    assert _assert_committed(result["before"], [committed], "reader killed while repairing") == committed
    assert result["stats"]["chunks_added"] == 0


# --- repairs without kills ---------------------------------------------------------------------------------


def _docs(prefix: str, n: int) -> list[Document]:
    return [
        Document(id=f"{prefix}-{i}", title=prefix, text=f"{TOPICS[i % len(TOPICS)]} (note {prefix}-{i}).")
        for i in range(n)
    ]


def _add_raw(directory: Path, ids: list[str]) -> None:
    """Chunks in the vector store that no commit names, as an interrupted build leaves them."""
    collection = _client(directory, None).get_collection("chunks")
    collection.add(
        ids=ids,
        embeddings=np.stack([hash_vector(i) for i in ids]),
        documents=["stray"] * len(ids),
        metadatas=[{"doc_id": "stray", "title": "", "source": "", "start": 0, "end": 5}] * len(ids),
    )


def test_open_removes_uncommitted_chunks_once_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "index"
    build_index(_docs("a", 5), directory, precomputed=HashVectors(), progress=False)
    _add_raw(directory, [f"stray#{i}-{i + 1}" for i in range(7)])
    with caplog.at_level(logging.WARNING, logger="ermedrag.tools.retrieval.index"):
        index = open_index(directory)
        assert index.size == 5 and len(index.bm25_ids) == 5
        open_index(directory)
    repairs = [r.getMessage() for r in caplog.records if "interrupted build" in r.getMessage()]
    assert len(repairs) == 1 and "removed 7 chunks" in repairs[0] and str(directory) in repairs[0], repairs


def test_open_leaves_a_running_builds_chunks_alone(tmp_path: Path) -> None:
    directory = tmp_path / "index"
    build_index(_docs("a", 5), directory, precomputed=HashVectors(), progress=False)
    with writer_lock(directory, wait=True):  # as a build in another process holds it
        _add_raw(directory, ["new#0-5", "new#5-9"])
        index = open_index(directory)
        assert len(index.bm25_ids) == 5 and index.size == 7  # the last commit, and the build's chunks kept
    assert open_index(directory).size == 5  # no build now: repaired


def test_lost_committed_vectors_are_reported_and_a_rebuild_re_adds_them(tmp_path: Path) -> None:
    directory = tmp_path / "index"
    docs = _docs("a", 6)
    build_index(docs, directory, precomputed=HashVectors(), progress=False)
    lost = open_index(directory).bm25_ids[:2]
    _client(directory, None).get_collection("chunks").delete(ids=lost)
    with pytest.raises(
        IndexUnavailable,
        match=re.escape(str(directory)) + r": the vector store lacks 2 of the 6 "
        r"committed chunks.*index the same files again",
    ):
        open_index(directory)
    with pytest.raises(IndexUnavailable, match="lacks 2 of the 6"):  # documents without them cannot repair it
        build_index(docs[3:], directory, precomputed=HashVectors(), progress=False)
    stats = build_index(docs, directory, precomputed=HashVectors(), progress=False)
    assert (stats["chunks_added"], stats["chunks_total"]) == (2, 6)
    assert open_index(directory).size == 6


def test_a_rerun_keeps_uncommitted_chunks_it_wants(tmp_path: Path) -> None:
    """An interrupted build's vectors are not embedded again by the rerun (same id and text), but are when
    the document changed."""
    directory = tmp_path / "index"
    build_index(_docs("a", 3), directory, precomputed=HashVectors(), progress=False)
    more = _docs("a", 6)
    chunks = chunk_documents(more[3:])
    collection = _client(directory, None).get_collection("chunks")
    collection.add(
        ids=[c.id for c in chunks],
        embeddings=np.stack([hash_vector(c.id) for c in chunks]),
        documents=[c.text if i else "an older text" for i, c in enumerate(chunks)],
        metadatas=[
            {"doc_id": c.doc_id, "title": c.title, "source": c.source, "start": c.start, "end": c.end} for c in chunks
        ],
    )
    _add_raw(directory, ["gone#0-5"])
    stats = build_index(more, directory, precomputed=HashVectors(), progress=False)
    assert (stats["chunks_resumed"], stats["chunks_added"], stats["uncommitted_removed"]) == (2, 1, 2)
    index = open_index(directory)
    assert index.size == len(index.bm25_ids) == 6
    assert {c.text for c in index.chunks(index.bm25_ids).values()} == {c.text for c in chunk_documents(more)}


def test_an_index_from_before_generations_opens_and_is_converted(tmp_path: Path) -> None:
    """Oldest layout: bm25/ holds the bm25s files and ids.json, the manifest names no generation."""
    from tests.tools.retrieval.test_bm25_segments import as_one_bm25s_index

    directory = tmp_path / "index"
    build_index(_docs("a", 4), directory, precomputed=HashVectors(), progress=False)
    as_one_bm25s_index(directory, None)
    _add_raw(directory, ["stray#0-5"])
    assert open_index(directory).size == 4  # repaired against the old layout's ids.json
    stats = build_index(_docs("a", 6), directory, precomputed=HashVectors(), progress=False)
    assert stats["chunks_total"] == 6
    assert {p.name for p in (directory / "bm25").iterdir()} == {".lock", "s000001"}
    assert rebuild_bm25(directory) == 6
    assert {p.name for p in (directory / "bm25").iterdir()} == {".lock", "s000002"}
    assert len(open_index(directory).bm25_ids) == 6


def test_two_documents_under_one_id_are_renamed_or_refused(tmp_path: Path) -> None:
    """Within one build_index call, as read_corpus does: renamed id~2 (refused under error), exact repeats dropped."""
    from ermedrag.tools.retrieval.corpus import CorpusError

    docs = [Document("x", "One text."), Document("x", "Two texts"), Document("x", "One text.")]
    with pytest.raises(CorpusError, match="document id 'x' already used"):
        build_index(docs, tmp_path / "index", precomputed=HashVectors(), progress=False, on_duplicate_id="error")
    assert not (tmp_path / "index" / "manifest.json").exists()
    stats = build_index(docs, tmp_path / "index", precomputed=HashVectors(), progress=False)
    assert (stats["input_renamed"], stats["input_repeats"], stats["documents_new"]) == (1, 1, 2)
    index = open_index(tmp_path / "index")
    assert {c.doc_id: c.text for c in index.chunks(index.bm25_ids).values()} == {"x": "One text.", "x~2": "Two texts"}
