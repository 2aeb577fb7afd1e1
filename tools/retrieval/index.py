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

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

import numpy as np

from ermedrag.tools.retrieval.bm25 import SegmentedBM25, SingleBM25s, bm25_text
from ermedrag.tools.retrieval.corpus import Chunk, CorpusError, Document, chunk_documents
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.retrieval.encoder import (
    DEFAULT_ENCODER,
    SentenceTransformerEmbedding,
    encode,
)
from ermedrag.tools.retrieval.index_files import (
    ADD_BATCH,
    COLLECTION,
    PAGE,
    IndexUnavailable,
    bm25_texts,
    commit_bm25,
    committed_ids,
    pause_point,
    read_committed,
    read_manifest,
    remove_leftovers,
    writer_lock,
)

log = logging.getLogger(__name__)


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
    return Chunk(
        id=chunk_id,
        doc_id=str(meta["doc_id"]),
        text=text,
        title=str(meta.get("title", "")),
        source=str(meta.get("source", "")),
        start=int(meta["start"]),
        end=int(meta["end"]),
    )


def _client(directory: Path, chroma_url: str | None) -> Any:
    import chromadb
    from chromadb.config import Settings

    settings = Settings(anonymized_telemetry=False)
    if chroma_url:
        host, port, ssl = _chroma_address(chroma_url)
        try:  # the client asks the server who we are at once: a server that is not there fails here
            return chromadb.HttpClient(host=host, port=port, ssl=ssl, settings=settings)
        except Exception as err:  # chromadb turns httpx's ConnectError into a ValueError without the URL
            raise IndexUnavailable(
                f"cannot reach the Chroma server at {chroma_url} ({type(err).__name__}: {err}); "
                f"start it, or point --chroma-url / ERMEDRAG_CHROMA_URL at a running one "
                f"(leave it empty to use the embedded store in {directory})"
            ) from err
    return chromadb.PersistentClient(path=str(directory / "chroma"), settings=settings)


def _chroma_address(chroma_url: str) -> tuple[str, int, bool]:
    """(host, port, ssl) of http(s)://host[:port]; IndexUnavailable naming the URL and the knob otherwise."""
    parts = urlsplit(chroma_url if "://" in chroma_url else f"http://{chroma_url}")
    try:
        port = parts.port
    except ValueError:  # a port that is not a number in 0-65535
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise IndexUnavailable(
            f"Chroma server URL {chroma_url!r} is not http(s)://host[:port]; fix --chroma-url / ERMEDRAG_CHROMA_URL"
        )
    ssl = parts.scheme == "https"
    return parts.hostname, port or (443 if ssl else 8000), ssl


# --- opening ---------------------------------------------------------------------------------------------


def open_index(directory: str | os.PathLike[str], chroma_url: str | None = None) -> Index:
    """Open the last committed state of an index, repairing what an interrupted build left in the vector
    store; raises IndexUnavailable naming the directory when there is none or it cannot be repaired."""
    directory = Path(directory)
    manifest, bm25, committed = read_committed(directory)
    from chromadb.errors import NotFoundError

    try:
        collection = _client(directory, chroma_url).get_collection(
            COLLECTION, embedding_function=SentenceTransformerEmbedding(manifest["encoder"])
        )
    except NotFoundError as err:
        raise IndexUnavailable(
            f"{directory}: manifest.json is there but its Chroma collection is missing; "
            f"rebuild it with `ermedrag index PATH --index-dir {directory}`"
        ) from err
    if committed is not None and collection.count() != len(committed):
        _repair_on_open(directory, collection, manifest, committed)
    return Index(directory, manifest["encoder"], collection, bm25, committed or [])


def _repair_on_open(directory: Path, collection: Any, manifest: dict[str, Any], committed: list[str]) -> None:
    """Delete uncommitted chunks (an interrupted build's) unless a build is running; refuse lost ones."""
    with writer_lock(directory, wait=False) as held:
        if not held or read_manifest(directory) != manifest:  # a build is running, or committed since we read
            log.info("%s: a build is adding chunks to the vector store; this reader uses the last commit", directory)
            return
        state = _reconcile(collection, committed, wanted={})
        if state.missing:
            raise IndexUnavailable(_missing_message(directory, state, len(committed)))
        if state.removed:
            log.warning(
                "%s: removed %d chunks an interrupted build had added to the vector store without "
                "committing them; the index is its last committed state (%d chunks)",
                directory,
                state.removed,
                len(committed),
            )


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
        collection.delete(ids=stale[start : start + PAGE])
        pause_point("repairing")
    stored_set = set(stored)
    missing = [cid for cid in committed if cid not in stored_set]
    return Reconciled(len(stale), [cid for cid in extra if cid in wanted and cid not in changed], missing)


def _changed_texts(collection: Any, ids: list[str], wanted: dict[str, str]) -> set[str]:
    """Of uncommitted chunks a build wants (id -> BM25 text), those stored with another title or text (their
    document changed since)."""
    changed: set[str] = set()
    for start in range(0, len(ids), PAGE):
        got = collection.get(ids=ids[start : start + PAGE], include=["documents", "metadatas"])
        changed.update(cid for cid, text in zip(got["ids"], bm25_texts(got)) if text != wanted[cid])
    return changed


def _all_ids(collection: Any) -> list[str]:
    ids: list[str] = []
    for offset in range(0, collection.count(), PAGE):
        ids.extend(collection.get(include=[], limit=PAGE, offset=offset)["ids"])
    return ids


def _missing_message(directory: Path, state: Reconciled, committed: int) -> str:
    return (
        f"{directory}: the vector store lacks {len(state.missing)} of the {committed} committed chunks "
        f"(e.g. {state.missing[0]!r}); index the same files again (`ermedrag index PATH --index-dir {directory}` "
        "re-adds the chunks of the documents it is given) or build a new --index-dir"
    )


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
    _check_settings(directory, read_manifest(directory), encoder, chunk_size, chunk_overlap)
    started = time.perf_counter()
    chunks = _unique_chunks(chunk_documents(documents, chunk_size, chunk_overlap))
    directory.mkdir(parents=True, exist_ok=True)
    with writer_lock(directory, wait=True):
        manifest = read_manifest(directory)  # again, under the lock: another build may have committed meanwhile
        _check_settings(directory, manifest, encoder, chunk_size, chunk_overlap)
        remove_leftovers(directory, manifest)
        collection = _client(directory, chroma_url).get_or_create_collection(
            COLLECTION,
            embedding_function=SentenceTransformerEmbedding(encoder),
            configuration={"hnsw": {"space": "cosine"}},
        )
        committed = committed_ids(directory, manifest)
        texts = {c.id: bm25_text(c.title, c.text) for c in chunks}
        state = _reconcile_for_build(directory, collection, committed, texts)
        new = _unknown(collection, chunks)
        embed_s = _add_chunks(collection, new, encoder, precomputed, progress)
        t0 = time.perf_counter()
        # BM25 for this build's chunks that no commit holds; or, when the committed ids cannot be read (a lost
        # segment), for every chunk in the collection, as rebuild_bm25 repairs it. A new index starts with none.
        known = set(committed or [])
        added = None if committed is None else {cid: text for cid, text in texts.items() if cid not in known}
        total = commit_bm25(
            directory,
            collection,
            {
                **manifest,
                "encoder": encoder,
                "chunk_size": chunk_size,
                "chunk_overlap": chunk_overlap,
                **({} if manifest else {"bm25_segments": []}),
            },
            added,
        )
        bm25_s = time.perf_counter() - t0
    cached_index.cache_clear()
    return {
        "chunks_seen": len(chunks),
        "chunks_added": len(new),
        "chunks_resumed": len(state.resumed),
        "chunks_total": total,
        "uncommitted_removed": state.removed,
        "embed_seconds": embed_s,
        "bm25_seconds": bm25_s,
        "seconds": time.perf_counter() - started,
    }


def _check_settings(
    directory: Path, manifest: dict[str, Any], encoder: str, chunk_size: int, chunk_overlap: int
) -> None:
    if manifest and (manifest["encoder"], manifest["chunk_size"], manifest["chunk_overlap"]) != (
        encoder,
        chunk_size,
        chunk_overlap,
    ):
        raise IndexUnavailable(
            f"{directory} was built with encoder={manifest['encoder']}, chunk_size="
            f"{manifest['chunk_size']}, chunk_overlap={manifest['chunk_overlap']}; "
            "use the same settings or a new --index-dir"
        )


def _unique_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Each chunk id once; two documents under one id with different text would silently lose one."""
    unique: dict[str, Chunk] = {}
    for chunk in chunks:
        earlier = unique.setdefault(chunk.id, chunk)
        if earlier.text != chunk.text:
            raise CorpusError(
                f"document id {chunk.doc_id!r} is given twice with different text; give each "
                "document its own id (read_documents renames repeats id~2, id~3, ...)"
            )
    return list(unique.values())


def _reconcile_for_build(
    directory: Path, collection: Any, committed: list[str] | None, wanted: dict[str, str]
) -> Reconciled:
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
        log.warning(
            "%s: removed %d chunks an interrupted build had added without committing them", directory, state.removed
        )
    return state


def _unknown(collection: Any, chunks: list[Chunk]) -> list[Chunk]:
    known: set[str] = set()
    for start in range(0, len(chunks), PAGE):
        known.update(collection.get(ids=[c.id for c in chunks[start : start + PAGE]], include=[])["ids"])
    return [c for c in chunks if c.id not in known]


def _add_chunks(
    collection: Any, new: list[Chunk], encoder: str, precomputed: dict[str, np.ndarray] | None, progress: bool
) -> float:
    """Embed and add `new` in batches (uncommitted until the manifest names them); returns embedding seconds."""
    from tqdm.auto import tqdm

    embed_s = 0.0
    bar = tqdm(total=len(new), desc="embedding chunks", unit="chunk", disable=not progress)
    for start in range(0, len(new), ADD_BATCH):
        batch = new[start : start + ADD_BATCH]
        t0 = time.perf_counter()
        vectors = _vectors(batch, encoder, precomputed)
        embed_s += time.perf_counter() - t0
        collection.add(
            ids=[c.id for c in batch],
            embeddings=vectors,
            documents=[c.text for c in batch],
            metadatas=[
                {"doc_id": c.doc_id, "title": c.title, "source": c.source, "start": c.start, "end": c.end}
                for c in batch
            ],
        )
        bar.update(len(batch))
        pause_point("vectors_added")
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
    if not read_manifest(directory):  # before the lock, which would create bm25/ in a folder holding no index
        raise IndexUnavailable(f"no index at {directory}")
    with writer_lock(directory, wait=True):
        manifest = read_manifest(directory)
        remove_leftovers(directory, manifest)
        collection = _client(directory, chroma_url).get_collection(COLLECTION)
        _reconcile_for_build(directory, collection, committed_ids(directory, manifest), wanted={})
        total = commit_bm25(directory, collection, manifest, added=None)
    cached_index.cache_clear()
    return total
