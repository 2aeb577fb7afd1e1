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

A document whose id the index already holds (`build_index`'s `on_duplicate_id`) with other text, when
replaced, goes in the same commit: in 2 its new chunks are added under ids no committed chunk has (a chunk on
the offsets of an old one with other text gets `doc#start-end~2`, `~3`, ...: Chroma cannot hold two texts
under one id, and overwriting a committed chunk before the commit would leave neither version), in 3 the
committed segments that hold its old chunks are written again without them (new names, postings copied), in 4
the manifest names those, and after 4 its old chunks are deleted from Chroma, as chunks no commit lists. A kill
before 4 leaves the old version (its new chunks are uncommitted), from 4 on the new one (its old chunks are
uncommitted, removed by the repair below): never both, never neither.

Chroma is the one part that cannot roll back by itself: chunks an interrupted build added stay in the
collection. `open_index` compares the collection's count with the committed count (one call); when the
collection holds more, the chunks the committed ids do not list are deleted (an interrupted build's new chunks,
or the old chunks of documents it replaced), with one warning giving the counts, unless a build holds the lock
(they are that build's). When it holds fewer (committed vectors lost), IndexUnavailable says so and how to
repair: index the same files again (a build re-adds the missing chunks of the documents it is given) or build
a new index. `rebuild_bm25` runs the same repair.
Limit: Chroma has no snapshots, so a process that has an index open while another builds it can get that
build's not yet committed chunks from dense search (its BM25 and identity() stay at the commit it opened), and
loses the old chunks of documents that build replaces once it deletes them (`Index.chunks` leaves them out).
Indexes from before segments (one bm25s index: a generation folder `bm25/g000007/` named by the manifest, or
the files in bm25/ itself) open as they are, and their next build re-indexes them into one segment.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

import numpy as np

from ermedrag.tools.retrieval.bm25 import SegmentedBM25, SingleBM25s, bm25_text
from ermedrag.tools.retrieval.corpus import (
    DEFAULT_ON_DUPLICATE_ID,
    EXAMPLES_KEPT,
    Chunk,
    CorpusError,
    Document,
    assign_ids,
    chunk_documents,
    id_key,
)
from ermedrag.tools.retrieval.ids import RENAMED, StoredChunk, settle_ids
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
CHUNK_ID = re.compile(r".*#(\d+)-(\d+)(?:~\d+)?", re.S)  # doc#start-end; ~N when a replace moved it off an old id


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


VECTOR_STORE = "vector_store"  # the manifest field saying where the vectors live: EMBEDDED or a server's URL
EMBEDDED = "embedded"


def public_url(chroma_url: str) -> str:
    """A Chroma server's URL as the manifest records it: scheme, host and port, never credentials or a path."""
    host, port, ssl = _chroma_address(chroma_url)
    return f"{'https' if ssl else 'http'}://{host}:{port}"


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

    recorded = manifest.get(VECTOR_STORE) or EMBEDDED
    chroma_url = chroma_url or (None if recorded == EMBEDDED else recorded)  # where the build put them
    try:
        collection = _client(directory, chroma_url).get_collection(
            COLLECTION, embedding_function=SentenceTransformerEmbedding(manifest["encoder"])
        )
    except NotFoundError as err:
        where = f"the Chroma server at {chroma_url}" if chroma_url else f"the embedded store in {directory / 'chroma'}"
        advice = (
            f"its build put them in {recorded if recorded != EMBEDDED else 'the embedded store'}: pass that with "
            f"--chroma-url (or leave it out)"
            if (chroma_url or EMBEDDED) != recorded
            else f"rebuild it with `ermedrag index PATH --index-dir {directory}`"
            + (f" --chroma-url {chroma_url}" if chroma_url else "")
        )
        raise IndexUnavailable(f"{directory}: its vectors are not in {where}; {advice}") from err
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
                "%s: removed %d chunks an interrupted build had left in the vector store without committing "
                "them (new chunks, or old ones of documents it replaced); the index is its last committed state "
                "(%d chunks)",
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
    _delete(collection, stale, "repairing")
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


def _delete(collection: Any, ids: list[str], point: str) -> None:
    for start in range(0, len(ids), PAGE):
        collection.delete(ids=ids[start : start + PAGE])
        pause_point(point)


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
    on_duplicate_id: str = DEFAULT_ON_DUPLICATE_ID,
) -> dict[str, Any]:
    """Add documents to the index at `directory` (creating it) and commit; returns counts and timings.

    A document whose id (compared by `corpus.id_key`) the index already holds with the same chunks (title and
    text) is unchanged, under every policy. With other text, `on_duplicate_id` decides:
      replace (default) its indexed version is replaced in the same commit (the module docstring says how):
              indexing an edited file again updates it, where keeping both would retrieve the outdated text;
      rename  it is kept as a copy `id~2`, `id~3`, ... (the first id~N neither the index nor this input holds;
              none when one of id, id~N holds this text already), so two corpora that both number 0, 1, 2 add up;
      skip    the indexed version stays;
      error   DuplicateIdError naming it, before anything is written.
    Within these documents a reused id is renamed id~N (refused under error), as `read_corpus` does. Documents
    not given are never removed.

    `precomputed` maps chunk ids to embeddings already computed with the same encoder (benches use it).
    Counts: chunks_seen (of the documents indexed now: all but the skipped), chunks_added (embedded and added
    now), chunks_resumed (added by an interrupted build and committed now), chunks_total (committed),
    uncommitted_removed (an interrupted build's chunks these documents do not have, deleted), chunks_removed
    (old chunks of replaced documents); documents_{new, unchanged, replaced, renamed, skipped} with up to 3
    {replaced, renamed, skipped, unchanged}_examples ("id from file:line"), replaced_other_source (replaced
    documents that had been indexed from another source), input_renamed / input_repeats (reused ids renamed /
    exact repeats dropped within `documents`). `describe_documents` words them for people.
    """
    directory = Path(directory)
    chroma_url = _check_settings(directory, read_manifest(directory), encoder, chunk_size, chunk_overlap, chroma_url)
    started = time.perf_counter()
    documents, given = assign_ids(documents, on_duplicate_id)
    chunks: dict[str, list[Chunk]] = {doc.id: [] for doc in documents}
    for chunk in chunk_documents(documents, chunk_size, chunk_overlap):
        chunks[chunk.doc_id].append(chunk)
    directory.mkdir(parents=True, exist_ok=True)
    with writer_lock(directory, wait=True):
        manifest = read_manifest(directory)  # again, under the lock: another build may have committed meanwhile
        _check_settings(directory, manifest, encoder, chunk_size, chunk_overlap, chroma_url)
        remove_leftovers(directory, manifest)
        collection = _client(directory, chroma_url).get_or_create_collection(
            COLLECTION,
            embedding_function=SentenceTransformerEmbedding(encoder),
            configuration={"hnsw": {"space": "cosine"}},
        )
        committed = committed_ids(directory, manifest)
        known = set(committed if committed is not None else _all_ids(collection))
        held = _held_ids(documents, known, on_duplicate_id)
        stored = _stored_chunks(collection, [cid for forms in held.values() for ids in forms.values() for cid in ids])
        plan = settle_ids(documents, chunks, held, stored, known, on_duplicate_id)
        if plan.refused:
            raise DuplicateIdError(directory, plan.refused)
        texts = {c.id: bm25_text(c.title, c.text) for c in plan.chunks}
        state = _reconcile_for_build(directory, collection, committed, texts, set(plan.removed))
        new = _unknown(collection, plan.chunks)
        embed_s = _add_chunks(collection, new, encoder, precomputed, progress)
        t0 = time.perf_counter()
        # BM25 for this build's chunks that no commit holds; or, when the committed ids cannot be read (a lost
        # segment), for every chunk in the collection, as rebuild_bm25 repairs it. A new index starts with none.
        added = None if committed is None else {cid: text for cid, text in texts.items() if cid not in known}
        total = commit_bm25(
            directory,
            collection,
            {
                **manifest,
                "encoder": encoder,
                "chunk_size": chunk_size,
                "chunk_overlap": chunk_overlap,
                VECTOR_STORE: public_url(chroma_url) if chroma_url else EMBEDDED,
                **({} if manifest else {"bm25_segments": []}),
            },
            added,
            removed=set(plan.removed),
        )
        _delete(collection, plan.removed, "replaced_removed")  # committed without them: no longer the index's
        bm25_s = time.perf_counter() - t0
    cached_index.cache_clear()
    return {
        "chunks_seen": len(plan.chunks),
        "chunks_added": len(new),
        "chunks_resumed": len(state.resumed),
        "chunks_total": total,
        "uncommitted_removed": state.removed,
        "chunks_removed": len(plan.removed),
        **{f"documents_{case}": count for case, count in plan.counts.items()},
        **{f"{case}_examples": examples for case, examples in plan.examples.items()},
        "replaced_other_source": plan.other_source,
        "input_renamed": given.renamed,
        "input_repeats": given.dropped,
        "embed_seconds": embed_s,
        "bm25_seconds": bm25_s,
        "seconds": time.perf_counter() - started,
    }


class DuplicateIdError(CorpusError):
    """Documents whose ids the index already holds with other text, refused (on_duplicate_id="error")."""

    def __init__(self, directory: Path, refused: list[tuple[Document, str]]):
        (doc, source), self.refused = refused[0], len(refused)
        self.examples = [f"{d.id} from {d.origin}" if d.origin else d.id for d, _ in refused[:EXAMPLES_KEPT]]
        super().__init__(
            (f"{doc.origin}: " if doc.origin else "")
            + f"document id {doc.id!r} is already indexed in {directory} with other text"
            + (f" (indexed from {source})" if source else "")
            + (f" ({self.refused - 1} more too, e.g. {', '.join(self.examples[1:])})" if self.refused > 1 else "")
            + "; nothing was written. --on-duplicate-id replace updates the indexed version, rename keeps both "
            "(the new one as id~2), skip keeps the indexed one"
        )


def describe_documents(stats: dict[str, Any]) -> str:
    """What `build_index` did with documents whose ids the index held, for people ("" when there were none)."""
    parts = []
    for case, said in (("replaced", "replaced"), ("renamed", "kept as id~N"), ("skipped", "skipped")):
        if count := stats.get(f"documents_{case}"):
            parts.append(f"{count} already indexed with other text {said}, e.g. {', '.join(stats[f'{case}_examples'])}")
            if case == "replaced" and (other := stats.get("replaced_other_source")):
                parts[-1] += (
                    f" ({other} of them had been indexed from another source: if they are other documents, index "
                    "that source again with --on-duplicate-id rename)"
                )
    if count := stats.get("documents_unchanged"):
        parts.append(f"{count} already indexed unchanged")
    if count := stats.get("input_renamed"):
        parts.append(f"{count} reused ids renamed id~N")
    if count := stats.get("input_repeats"):
        parts.append(f"{count} exact repeats dropped")
    return "; ".join(parts)


def _held_ids(documents: list[Document], committed: Iterable[str], policy: str) -> dict[str, dict[str, list[str]]]:
    """Committed chunk ids (`doc#start-end`) of the indexed documents these documents' ids meet, by id key and
    indexed id: the same ids and, under rename, their copies id~N."""
    keys = {id_key(doc.id) for doc in documents}
    bases = {id_key(doc.renamed_from or doc.id) for doc in documents} if policy == "rename" else set()
    held: dict[str, dict[str, list[str]]] = {}
    for cid in committed:
        doc_id = cid.rpartition("#")[0]
        key = id_key(doc_id)
        if key in keys or (
            bases and (key in bases or ("~" in key and (found := RENAMED.fullmatch(key)) and found[1] in bases))
        ):
            held.setdefault(key, {}).setdefault(doc_id, []).append(cid)
    return held


def _stored_chunks(collection: Any, ids: list[str]) -> dict[str, StoredChunk]:
    """The committed chunks `ids` as the vector store holds them; one it lacks with what its id tells."""
    stored = {}
    for cid in ids:
        found = CHUNK_ID.fullmatch(cid)
        stored[cid] = StoredChunk(cid, cid.rpartition("#")[0], *(map(int, found.groups()) if found else (-1, -1)))
    for start in range(0, len(ids), PAGE):
        got = collection.get(ids=ids[start : start + PAGE], include=["documents", "metadatas"])
        for cid, text, meta in zip(got["ids"], got["documents"], got["metadatas"]):
            stored[cid] = StoredChunk(
                cid,
                str(meta["doc_id"]),
                int(meta["start"]),
                int(meta["end"]),
                str(meta.get("title", "")),
                text,
                str(meta.get("source", "")),
            )
    return stored


def _check_settings(
    directory: Path,
    manifest: dict[str, Any],
    encoder: str,
    chunk_size: int,
    chunk_overlap: int,
    chroma_url: str | None,
) -> str | None:
    """Refuse to add to an index built with other settings or whose vectors live elsewhere; the Chroma server to
    build with (the one the index records when none is given)."""
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
    recorded = manifest.get(VECTOR_STORE) if manifest else None
    if recorded is None or recorded == EMBEDDED and not chroma_url:
        return chroma_url
    if not chroma_url:
        return recorded
    if recorded == EMBEDDED or public_url(chroma_url) != recorded:
        where = "the embedded store" if recorded == EMBEDDED else f"the Chroma server at {recorded}"
        raise IndexUnavailable(
            f"{directory} keeps its vectors in {where}, not at {public_url(chroma_url)}; add to it there "
            "(leave --chroma-url out) or use a new --index-dir"
        )
    return chroma_url


def _reconcile_for_build(
    directory: Path,
    collection: Any,
    committed: list[str] | None,
    wanted: dict[str, str],
    removed: set[str] | frozenset[str] = frozenset(),
) -> Reconciled:
    """Before adding: delete chunks an interrupted build left that this one does not want (`wanted`: id -> BM25
    text; it keeps the others, saving their embedding), and refuse when committed chunks are lost and neither
    re-added nor `removed` (replaced) now."""
    if committed is None or collection.count() == len(committed):
        return Reconciled(0, [], [])
    state = _reconcile(collection, committed, wanted)
    lost = [cid for cid in state.missing if cid not in wanted and cid not in removed]
    if lost:
        raise IndexUnavailable(_missing_message(directory, Reconciled(state.removed, [], lost), len(committed)))
    if state.removed:
        log.warning(
            "%s: removed %d chunks an interrupted build had left without committing them", directory, state.removed
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
