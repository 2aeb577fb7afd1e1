"""An index's files on disk (see `tools.retrieval.index` for the crash-consistency protocol): the manifest, which is
the commit point; the committed BM25 segments and how a build stages, merges and commits them; the writer lock;
and the test hook that pauses a build at named points."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from itertools import count
from pathlib import Path
from typing import Any, Callable, Collection, Iterator


from ermedrag.tools import settings
from ermedrag.tools.retrieval.bm25 import (
    SegmentedBM25,
    SingleBM25s,
    bm25_text,
    load_segment,
    merge_segments,
    segment_ids,
    segments_to_merge,
    write_segment,
)

COLLECTION = "chunks"
ADD_BATCH = 512
PAGE = 5000  # ids per Chroma get/delete (its embedded batch limit is 5461)
# BM25 saturation and length normalisation, chosen on the BioASQ tuning split (benches/retrieval/tune.py):
# full length normalisation (b=1) favours short, dense evidence; bm25s' own defaults are k1=1.5, b=0.75.
BM25_PARAMS = {"k1": 1.2, "b": 1.0}
MANIFEST = "manifest.json"
BM25_DIR = "bm25"
LOCK = ".lock"
STAGING_PREFIX = ".staging-"
SEGMENT_NAME = re.compile(r"s\d{6}")
OPEN_ATTEMPTS = 3  # a build may commit and remove the segments a reader was about to load: read again
# Test hook: "point:seconds[,point:seconds]" sleeps at named points of a build (after printing the point on
# stderr), so a test can kill it there. Points: vectors_added, bm25_writing, bm25_staged (each segment written),
# bm25_rewritten (the segments that held replaced chunks written again without them), manifest_staged, committed,
# replaced_removed (each batch of a replaced document's old chunks deleted from the vector store), repairing.
PAUSE_ENV = "ERMEDRAG_INDEX_PAUSE"

log = logging.getLogger(__name__)


class IndexUnavailable(RuntimeError):
    """An index that is missing or unusable; the message says which directory and why."""


# --- the manifest and the committed BM25 generation --------------------------------------------------------


def read_manifest(directory: Path) -> dict[str, Any]:
    """The committed manifest, {} when there is none."""
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:  # written by rename, so never half: edited or damaged by hand
        raise IndexUnavailable(f"{path}: not valid JSON ({err.msg}); restore it or build a new index") from err
    if not isinstance(manifest, dict):
        raise IndexUnavailable(f"{path}: expected a JSON object; restore it or build a new index")
    return manifest


def _segments(manifest: dict[str, Any]) -> dict[str, int] | None:
    """The committed BM25 segments, oldest first, with their chunk counts; None for an index from before
    segments."""
    listed = manifest.get("bm25_segments")
    if not isinstance(listed, list):
        return None
    try:
        segments = {str(entry["name"]): int(entry["chunks"]) for entry in listed}
    except (TypeError, KeyError, ValueError) as err:
        raise IndexUnavailable(
            f"manifest.json: bm25_segments is not a list of {{name, chunks}} ({err!r}); "
            "build a new index (`ermedrag index PATH --index-dir NEW_DIR`)"
        ) from err
    if bad := [name for name in segments if not SEGMENT_NAME.fullmatch(name)]:  # names become paths under bm25/
        raise IndexUnavailable(
            f"manifest.json: {bad[0]!r} is not a BM25 segment name (s + 6 digits); "
            "build a new index (`ermedrag index PATH --index-dir NEW_DIR`)"
        )
    return segments


def _segment_names(manifest: dict[str, Any]) -> list[str] | None:
    segments = _segments(manifest)
    return None if segments is None else list(segments)


def _legacy_folder(directory: Path, manifest: dict[str, Any]) -> Path:
    """An index from before segments: its bm25s generation folder, or bm25/ itself (before generations)."""
    generation = manifest.get("bm25_generation")
    return directory / BM25_DIR / generation if generation else directory / BM25_DIR


def _new_names(manifest: dict[str, Any]) -> Iterator[str]:
    """Segment names above every name the manifest has used (leftovers of a crash are removed before)."""
    names = (_segment_names(manifest) or []) + [manifest.get("bm25_generation") or ""]
    first = max((int(n[1:]) for n in names if n[1:].isdigit()), default=0) + 1
    return (f"s{number:06d}" for number in count(first))


def committed_ids(directory: Path, manifest: dict[str, Any], strict: bool = False) -> list[str] | None:
    """The committed chunk ids: [] without a manifest. When the BM25 ids are gone (an index from before
    generations that lost them, or a damaged one) None, and the collection is then taken as it is; or, when
    `strict` and the manifest names segments or a generation, FileNotFoundError."""
    if not manifest:
        return []
    names = _segment_names(manifest)
    try:
        if names is not None:
            return [cid for name in names for cid in segment_ids(directory / BM25_DIR / name)]
        return json.loads((_legacy_folder(directory, manifest) / "ids.json").read_text())
    except FileNotFoundError:
        if strict and (names is not None or manifest.get("bm25_generation")):
            raise
        return None


def _load_bm25(
    directory: Path, manifest: dict[str, Any]
) -> tuple[SegmentedBM25 | SingleBM25s | None, list[str] | None]:
    """The committed BM25 and its ids (None: an old index without BM25 ids; see `committed_ids`).
    Memory-mapped: a query reads only its terms' postings, so serving needs pages for what queries touch. A
    later build writes new segments; an open mapping of a removed one stays valid until it is closed."""
    names = _segment_names(manifest)
    segments = [load_segment(directory / BM25_DIR / name) for name in names or []]
    ids = (
        [cid for s in segments for cid in s.ids]
        if names is not None
        else committed_ids(directory, manifest, strict=True)
    )
    if not ids:
        return None, ids
    if manifest.get("chunks", len(ids)) != len(ids) and (names is not None or manifest.get("bm25_generation")):
        raise IndexUnavailable(
            f"{directory}: manifest.json commits {manifest['chunks']} chunks but its BM25 "
            f"segments list {len(ids)}; it was changed by hand: build a new index "
            "(`ermedrag index PATH --index-dir NEW_DIR`)"
        )
    if names is not None:  # raw term frequencies: scored with today's BM25_PARAMS, whatever they were at build
        return SegmentedBM25(segments, **BM25_PARAMS), ids
    import bm25s

    return SingleBM25s(bm25s.BM25.load(str(_legacy_folder(directory, manifest)), mmap=True)), ids


def read_committed(directory: Path) -> tuple[dict[str, Any], Any | None, list[str] | None]:
    """(manifest, BM25, ids) of one commit; reads again when a build removed the generation meanwhile."""
    for attempt in range(OPEN_ATTEMPTS):
        manifest = read_manifest(directory)
        if not manifest:
            raise IndexUnavailable(
                f"no index at {directory} (build one with `ermedrag index PATH --index-dir {directory}`)"
            )
        try:
            bm25, ids = _load_bm25(directory, manifest)
            return manifest, bm25, ids
        except FileNotFoundError as err:
            if read_manifest(directory) == manifest or attempt == OPEN_ATTEMPTS - 1:
                named = _segment_names(manifest) or manifest.get("bm25_generation")
                raise IndexUnavailable(
                    f"{directory}: manifest.json names BM25 {named!r}, which is missing "
                    f"({err.filename}); "
                    f"index the same files again (`ermedrag index PATH --index-dir {directory}`) "
                    "or run ermedrag.tools.retrieval.index.rebuild_bm25 on it"
                ) from err
    raise AssertionError("unreachable")


# --- BM25 segments and the commit -----------------------------------------------------------------------


def bm25_texts(got: dict[str, Any]) -> list[str]:
    """What BM25 indexes for each chunk of a Chroma `get` result (documents and metadatas)."""
    return [bm25_text(m.get("title", ""), d) for d, m in zip(got["documents"], got["metadatas"])]


def chunk_texts(collection: Any, leave_out: Collection[str] = frozenset()) -> tuple[list[str], list[str]]:
    """(ids, BM25 texts) of every chunk in a collection (but those in `leave_out`)."""
    ids: list[str] = []
    texts: list[str] = []
    for offset in range(0, collection.count(), PAGE):
        page = collection.get(include=["documents", "metadatas"], limit=PAGE, offset=offset)
        for cid, text in zip(page["ids"], bm25_texts(page)):
            if cid not in leave_out:
                ids.append(cid)
                texts.append(text)
    return ids, texts


def commit_bm25(
    directory: Path,
    collection: Any,
    manifest: dict[str, Any],
    added: dict[str, str] | None,
    removed: Collection[str] = frozenset(),
) -> int:
    """Commit BM25 for the collection (reconciled: committed + this build's chunks, less `removed`, the committed
    chunks of replaced documents): the committed segments that hold removed chunks written again without them,
    a new segment of `added` (chunk id -> BM25 text: the chunks not yet committed), merged with the newest
    segments when due; or, with `added` None or an index from before segments, one segment of every chunk read
    back from the collection (but the removed ones). Then the manifest naming them, then the segments no longer
    named removed. The removed chunks stay in the vector store: the caller deletes them after this commit.
    Caller holds the lock."""
    segments = _segments(manifest)
    names = _new_names(manifest)
    if added is None or segments is None:
        segments, (ids, texts) = {}, chunk_texts(collection, leave_out=removed)
    else:
        segments = _without(directory, segments, set(removed), names) if removed else segments
        ids, texts = list(added), list(added.values())
    if ids:
        name = next(names)
        _stage_segment(directory, name, partial(write_segment, ids=ids, texts=texts))
        segments = {**segments, name: len(ids)}
    del texts
    segments = _merge_newest(directory, segments, names)
    committed = {key: value for key, value in manifest.items() if key != "bm25_generation"}
    committed.update(
        chunks=sum(segments.values()),
        bm25=BM25_PARAMS,
        updated_at=time.time(),
        bm25_segments=[{"name": name, "chunks": count} for name, count in segments.items()],
    )
    _write_manifest(directory, committed)
    remove_leftovers(directory, committed)
    return committed["chunks"]


def _without(directory: Path, segments: dict[str, int], removed: set[str], names: Iterator[str]) -> dict[str, int]:
    """The segments with the `removed` chunks left out: each segment holding some written again without them
    under a new name, in its place (postings copied, nothing tokenized again); one holding only removed chunks
    dropped. The committed ones stay as they are until the commit names the new list."""
    kept: dict[str, int] = {}
    for name, size in segments.items():
        gone = removed & set(segment_ids(directory / BM25_DIR / name))
        if not gone:
            kept[name] = size
        elif len(gone) < size:
            rewritten = next(names)
            segment = load_segment(directory / BM25_DIR / name)
            _stage_segment(directory, rewritten, partial(merge_segments, segments=[segment], drop=gone))
            kept[rewritten] = size - len(gone)
    pause_point("bm25_rewritten")
    return kept


def _merge_newest(directory: Path, segments: dict[str, int], names: Iterator[str]) -> dict[str, int]:
    """The segments after merging the newest ones that are due (`bm25.segments_to_merge`) into one."""
    listed = list(segments)
    count = segments_to_merge(list(segments.values()))
    if count < 2:
        return segments
    merged = next(names)
    parts = [load_segment(directory / BM25_DIR / name) for name in listed[-count:]]
    _stage_segment(directory, merged, partial(merge_segments, segments=parts))
    return {**{name: segments[name] for name in listed[:-count]}, merged: sum(p.size for p in parts)}


def _stage_segment(directory: Path, name: str, write: Callable[[Path], None]) -> None:
    """A segment written by `write` into bm25/<name>, complete and on disk before the name appears."""
    root = directory / BM25_DIR
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    write(staging)
    pause_point("bm25_writing")
    for file in staging.iterdir():
        _fsync(file)
    _fsync(staging)
    final = root / name
    shutil.rmtree(final, ignore_errors=True)  # an uncommitted one from an interrupted build
    staging.rename(final)
    _fsync(root)
    pause_point("bm25_staged")


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """The commit: the new manifest on disk under a temporary name, then renamed over the old one."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(json.dumps(manifest, indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    pause_point("manifest_staged")
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)
    pause_point("committed")


def remove_leftovers(directory: Path, manifest: dict[str, Any]) -> None:
    """Everything in bm25/ the manifest does not name (merged, uncommitted or pre-segment generations, staging
    folders), a manifest that was never renamed, and staging folders of the layout before generations."""
    root = directory / BM25_DIR
    names = _segment_names(manifest)
    keep = set(names) if names is not None else {manifest.get("bm25_generation")}
    old_layout = manifest and names is None and not manifest.get("bm25_generation")
    for entry in root.iterdir() if root.is_dir() else []:
        if entry.name == LOCK or entry.name in keep or (old_layout and entry.is_file()):
            continue  # the lock; the committed segments; an old-layout index's files (committed, no generation)
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    (directory / (MANIFEST + ".tmp")).unlink(missing_ok=True)
    for old in directory.glob(".bm25-*"):
        shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush a file or a folder's entries to disk (a kill needs none of this; a power cut does)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def writer_lock(directory: Path, wait: bool) -> Iterator[bool]:
    """The index's writer lock (bm25/.lock); yields whether it is held. Builds wait for it; readers that
    would repair do not (False: a build is running, or the index is read-only)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one writer at a time is then up to the user
        yield True
        return
    try:
        (directory / BM25_DIR).mkdir(parents=True, exist_ok=True)
        handle = open(directory / BM25_DIR / LOCK, "a+b")
    except OSError as err:
        if wait:
            raise IndexUnavailable(f"{directory}: cannot write to it ({err})") from err
        yield False
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            held = False
            if wait:
                log.warning("%s: another build is writing this index; waiting for it to finish", directory)
                fcntl.flock(handle, fcntl.LOCK_EX)
                held = True
        try:
            yield held
        finally:
            if held:
                fcntl.flock(handle, fcntl.LOCK_UN)


def pause_point(point: str) -> None:
    """The test hook (PAUSE_ENV): sleep here when asked, after saying where on stderr."""
    spec = settings.read(PAUSE_ENV)
    if not spec:
        return
    for item in spec.split(","):
        name, _, seconds = item.partition(":")
        if name.strip() == point:
            print(f"{PAUSE_ENV} {point}", file=sys.stderr, flush=True)
            time.sleep(float(seconds or 0))
