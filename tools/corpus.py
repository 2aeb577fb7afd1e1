"""Read corpora into `Document`s and chunk them with provenance.

Sources: JSONL files in the shared schema (`{"id", "title", "text", "source", ...}`, also `.gz`), folders
of `.txt`/`.md` files (one document each), and Hugging Face datasets by name (`hf://name[:split]`).
Reading is strict: a bad line stops everything with the file and line named, before anything is written.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
MAX_DOCUMENT_CHARS = 2_000_000


class CorpusError(ValueError):
    """A corpus that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str = ""
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # file:line (or dataset row) it was read from, for error messages


@dataclass(frozen=True)
class Chunk:
    """A piece of a document; `start`/`end` are character offsets into the document's text."""

    id: str
    doc_id: str
    text: str
    title: str
    source: str
    start: int
    end: int


def read_documents(paths: Iterable[str | Path], on_duplicate_id: str = "rename") -> list[Document]:
    """All documents of all `paths`, validated; raises CorpusError on the first bad record.

    Real corpora reuse ids for different passages (MedQuAD does, 4k times): by default a repeated id with
    different text becomes `id~2`, `id~3`, ... and an exact repeat (same id, same text) is dropped;
    `on_duplicate_id="error"` refuses them instead, naming both places.
    """
    if on_duplicate_id not in ("rename", "error"):
        raise ValueError(f"on_duplicate_id must be 'rename' or 'error', not {on_duplicate_id!r}")
    documents: list[Document] = []
    first: dict[str, Document] = {}
    repeats: dict[str, int] = {}
    for path in paths:
        read = list(_read_one(str(path)))
        if not read:
            raise CorpusError(f"{path}: no documents in it")
        for doc in read:
            earlier = first.get(doc.id)
            if earlier is None:
                first[doc.id] = doc
            elif earlier.text == doc.text:
                continue
            elif on_duplicate_id == "error":
                raise CorpusError(f"{doc.origin}: document id {doc.id!r} already used at {earlier.origin}")
            else:
                repeats[doc.id] = repeats.get(doc.id, 1) + 1
                doc = replace(doc, id=f"{doc.id}~{repeats[doc.id]}")
            documents.append(doc)
    return documents


def _read_one(path: str) -> Iterator[Document]:
    if path.startswith("hf://"):
        yield from _read_hf_dataset(path.removeprefix("hf://"))
        return
    target = Path(path)
    if not target.exists():
        raise CorpusError(f"{path}: no such file or folder")
    if target.is_dir():
        files = sorted(p for p in target.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES))
        if not files:
            raise CorpusError(f"{path}: no .txt, .md or .jsonl[.gz] files inside")
        for file in files:
            yield from _read_file(file, root=target)
    else:
        yield from _read_file(target, root=target.parent)


def _read_file(file: Path, root: Path) -> Iterator[Document]:
    if file.name.endswith(TEXT_SUFFIXES):
        text = file.read_text(encoding="utf-8", errors="replace")
        rel = file.relative_to(root).as_posix()
        yield Document(id=rel, text=text[:MAX_DOCUMENT_CHARS], title=file.stem, source=rel, origin=str(file))
    elif file.name.endswith(JSONL_SUFFIXES):
        yield from _read_jsonl(file)
    else:
        raise CorpusError(f"{file}: unsupported file type (expected .txt, .md, .jsonl or .jsonl.gz)")


def _read_jsonl(file: Path) -> Iterator[Document]:
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rt", encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if line.strip():
                    yield _record_to_document(_json_line(line, file, line_no), f"{file}:{line_no}")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise CorpusError(f"{file}: cannot read ({err})") from err


def _json_line(line: str, file: Path, line_no: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{file}:{line_no}: not valid JSON ({err.msg})") from err
    if not isinstance(record, dict):
        raise CorpusError(f"{file}:{line_no}: expected a JSON object, got {type(record).__name__}")
    return record


def _record_to_document(record: dict[str, Any], where: str) -> Document:
    text = record.get("text", record.get("contents"))
    if not isinstance(text, str) or not text.strip():
        raise CorpusError(f"{where}: missing or empty 'text'")
    doc_id = record.get("id", record.get("_id"))
    if doc_id is None or str(doc_id).strip() == "":
        raise CorpusError(f"{where}: missing 'id'")
    meta = {k: v for k, v in record.items() if k not in ("id", "_id", "text", "contents", "title", "source")
            and isinstance(v, (str, int, float, bool))}
    return Document(id=str(doc_id), text=text[:MAX_DOCUMENT_CHARS], title=str(record.get("title") or ""),
                    source=str(record.get("source") or where.rsplit(":", 1)[0]), meta=meta, origin=where)


def _read_hf_dataset(name: str) -> Iterator[Document]:
    """A hub dataset with `text` (or `contents`) and optional `id`/`title` columns, e.g. MedRAG/textbooks."""
    from datasets import load_dataset

    dataset_name, _, split = name.partition(":")
    rows = load_dataset(dataset_name, split=split or "train")
    for index, row in enumerate(rows):
        record = dict(row)
        record.setdefault("id", f"{dataset_name}/{index}")
        record.setdefault("source", dataset_name)
        yield _record_to_document(record, f"hf://{dataset_name} row {index}")


def chunk_documents(documents: Iterable[Document], chunk_size: int = 256, chunk_overlap: int = 32) -> list[Chunk]:
    """Split documents into token-bounded chunks (llama-index SentenceSplitter), keeping offsets."""
    from llama_index.core.node_parser import SentenceSplitter

    splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=chunk_overlap)
    chunks: list[Chunk] = []
    for doc in documents:
        cursor = 0
        for piece in splitter.split_text(doc.text):
            start = doc.text.find(piece, max(0, cursor - len(piece)))
            start = cursor if start < 0 else start
            end = start + len(piece)
            cursor = end
            chunks.append(Chunk(id=f"{doc.id}#{start}-{end}", doc_id=doc.id, text=piece, title=doc.title,
                                source=doc.source, start=start, end=end))
    return chunks
