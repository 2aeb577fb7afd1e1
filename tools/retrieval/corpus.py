"""Read corpora into `Document`s and chunk them with provenance.

Sources: JSONL files in the shared schema (`{"id", "title", "text", "source", ...}`, also `.gz`), folders
of `.txt`/`.md` files (one document each), and Hugging Face datasets by name (`hf://name[:split]`).
Reading is strict: a bad line stops everything with the file and line named, before anything is written.
Nothing is lost silently: documents are kept whole whatever their length; files are decoded strictly
(UTF-8 unless told otherwise, a byte-order mark is skipped) and binary files are refused; renamed repeated
ids, dropped exact repeats, empty text files and files of other types in a folder are counted (`Corpus`).

Document ids are compared case-sensitively and otherwise exactly, except that two ids that render the same (the
same text in Unicode NFC and NFD, e.g. a macOS file name and the same name typed) are the same id (`id_key`); an
id is kept as given. A reused id within one input is renamed or refused here (`_IdAssigner`); a document whose id
the index already holds is settled by `build_index` under the same `on_duplicate_id` policy.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import unicodedata
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
DEFAULT_ENCODING = "utf-8-sig"  # UTF-8; a leading byte-order mark is skipped
# A text file is refused as binary when it holds a NUL or when more than this share of its characters are
# control characters other than tab, newlines, vertical tab and form feed (random bytes read as latin-1: ~23%).
MAX_CONTROL_SHARE = 0.10
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")
BINARY_SAMPLE = 65536  # bytes of an undecodable file looked at to tell binary from another encoding
UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
NON_BLANK = re.compile(r"\S")
# The splitter's sentence tokenizer (nltk punkt) runs each regex under a 5 s wall-clock limit over the text it is
# given: a 5 MB document timed out on 2 busy cores. It gets pieces this long at most, cut at a paragraph or line.
SPLIT_PIECE_CHARS = 100_000
EXAMPLES_KEPT = 3  # renamed ids shown as examples
# What happens to a document whose id is taken (`--on-duplicate-id`). Within one input, documents never displace
# each other: a reused id with other text is renamed id~2, id~3, ... under replace, rename and skip (neither text
# is an update of the other: MedQuAD reuses ids for 4k different passages), refused under error. A document whose
# id the index already holds: see `build_index`.
DUPLICATE_ID_POLICIES = ("replace", "rename", "skip", "error")
DEFAULT_ON_DUPLICATE_ID = "replace"


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
    renamed_from: str = ""  # the id it was given, when a reused id was renamed id~N


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


@dataclass(frozen=True)
class Corpus:
    """What `read_corpus` read, with everything it did not index as given counted."""

    documents: list[Document]
    renamed_ids: int = 0  # documents that reused an id with other text, indexed as `id~2`, `id~3`, ...
    dropped_repeats: int = 0  # exact repeats (same id, same text) left out
    empty_files: int = 0  # .txt/.md files with no text, left out
    ignored_files: int = 0  # files of other types inside the folders given
    renamed_examples: tuple[str, ...] = ()  # a few "new-id (file:line)" for the summary

    def summary(self) -> str:
        """What was left out or renamed, for people ("" when nothing was)."""
        parts = []
        if self.renamed_ids:
            examples = ", ".join(self.renamed_examples)
            parts.append(f"{self.renamed_ids} reused ids renamed id~N, e.g. {examples}")
        if self.dropped_repeats:
            parts.append(f"{self.dropped_repeats} exact repeats dropped")
        if self.empty_files:
            parts.append(f"{self.empty_files} empty files skipped")
        if self.ignored_files:
            parts.append(f"{self.ignored_files} files of other types ignored")
        return "; ".join(parts)


def id_key(doc_id: str) -> str:
    """What two ids must share to be the same id: their text in Unicode NFC (case and all else as given)."""
    return unicodedata.normalize("NFC", doc_id)


def read_documents(
    paths: Iterable[str | Path], on_duplicate_id: str = DEFAULT_ON_DUPLICATE_ID, encoding: str | None = None
) -> list[Document]:
    """The documents of `read_corpus` (for callers that do not report what was renamed or left out)."""
    return read_corpus(paths, on_duplicate_id, encoding).documents


def read_corpus(
    paths: Iterable[str | Path], on_duplicate_id: str = DEFAULT_ON_DUPLICATE_ID, encoding: str | None = None
) -> Corpus:
    """All documents of all `paths`, validated; raises CorpusError on the first bad record or file.

    Real corpora reuse ids for different passages (MedQuAD does, 4k times): a repeated id with different text
    becomes `id~2`, `id~3`, ... (in input order, so reading the same files again gives the same ids) and an
    exact repeat (same id, same text) is dropped, both counted; `on_duplicate_id="error"` refuses them instead,
    naming both places (replace, rename and skip differ only for ids the index already holds: `build_index`).
    `encoding` is the encoding of .txt/.md/.jsonl files (default UTF-8, read strictly: a file that is not valid
    in it is refused).
    """
    check_policy(on_duplicate_id)
    encoding = _checked_encoding(encoding)
    ids = _IdAssigner(on_duplicate_id)
    documents: list[Document] = []
    counts = {"empty_files": 0, "ignored_files": 0}
    for path in paths:
        read = 0
        for doc in _read_one(str(path), encoding, counts):
            read += 1
            kept = ids.assign(doc)
            if kept is not None:
                documents.append(kept)
        if not read:
            raise CorpusError(f"{path}: no documents in it")
    return Corpus(
        documents, ids.renamed, ids.dropped, counts["empty_files"], counts["ignored_files"], tuple(ids.examples)
    )


def check_policy(on_duplicate_id: str) -> None:
    if on_duplicate_id not in DUPLICATE_ID_POLICIES:
        raise ValueError(f"on_duplicate_id must be one of {', '.join(DUPLICATE_ID_POLICIES)}, not {on_duplicate_id!r}")


def assign_ids(documents: Iterable[Document], on_duplicate_id: str) -> tuple[list[Document], _IdAssigner]:
    """`documents` with each id once (see `_IdAssigner`), and the assigner with its counts."""
    check_policy(on_duplicate_id)
    ids = _IdAssigner(on_duplicate_id)
    return [kept for doc in documents if (kept := ids.assign(doc)) is not None], ids


class _IdAssigner:
    """Gives each document of one input a unique id: exact repeats are dropped, reused ids renamed `id~N` (or
    refused under "error"). Ids are compared by `id_key`.

    A rename never takes an id already used; a later document whose own id a rename took (a literal `x~2`)
    is renamed in turn. Repeats are found by (id, text hash), so many documents under one id stay linear."""

    def __init__(self, on_duplicate_id: str):
        self.on_duplicate_id = on_duplicate_id
        self.texts: dict[tuple[str, int], list[str]] = {}  # (id key, hash of text) -> texts kept
        self.first: dict[str, Document] = {}  # id key -> the document that took it first
        self.next_suffix: dict[str, int] = {}
        self.renamed = 0
        self.dropped = 0
        self.examples: list[str] = []

    def assign(self, doc: Document) -> Document | None:
        key = id_key(doc.id)
        same_hash = self.texts.setdefault((key, hash(doc.text)), [])
        if any(text == doc.text for text in same_hash):
            self.dropped += 1
            return None
        same_hash.append(doc.text)
        if key in self.first:
            if self.on_duplicate_id == "error":  # nothing is renamed in this mode: the id was read before
                first = self.first[key]
                raise CorpusError(
                    f"{_where(doc)}document id {doc.id!r} already used at {first.origin or 'an earlier document'}"
                    + (
                        f" (as {first.id!r}: the same id in another Unicode normalisation)"
                        if first.id != doc.id
                        else ""
                    )
                )
            n = self.next_suffix.get(key, 2)
            while id_key(f"{doc.id}~{n}") in self.first:
                n += 1
            self.next_suffix[key] = n + 1
            self.renamed += 1
            doc = replace(doc, id=f"{doc.id}~{n}", renamed_from=doc.renamed_from or doc.id)
            if len(self.examples) < EXAMPLES_KEPT:
                self.examples.append(shown_id(doc))
            key = id_key(doc.id)
        self.first[key] = doc
        return doc


def _where(doc: Document) -> str:
    return f"{doc.origin}: " if doc.origin else ""


def shown_id(doc: Document, doc_id: str = "") -> str:
    return (doc_id or doc.id) + (f" from {doc.origin}" if doc.origin else "")


# --- documents whose id the index already holds (`build_index`) ------------------------------------------------


def _checked_encoding(encoding: str | None) -> str:
    if encoding is None:
        return DEFAULT_ENCODING
    try:
        name = codecs.lookup(encoding).name
    except LookupError as err:
        raise CorpusError(f"unknown encoding {encoding!r} (e.g. utf-8, latin-1, cp1252, utf-16)") from err
    return DEFAULT_ENCODING if name == "utf-8" else encoding  # a BOM is skipped for UTF-8 however it is named


def _encoding_hint(encoding: str) -> str:
    return "UTF-8" if encoding == DEFAULT_ENCODING else encoding


def _read_one(path: str, encoding: str, counts: dict[str, int]) -> Iterator[Document]:
    if path.startswith("hf://"):
        yield from _read_hf_dataset(path.removeprefix("hf://"))
        return
    target = Path(path)
    if not target.exists():
        raise CorpusError(f"{path}: no such file or folder")
    if target.is_dir():
        files, others = [], 0
        for candidate in sorted(p for p in target.rglob("*") if p.is_file()):
            if candidate.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES):
                files.append(candidate)
            else:
                others += 1
        if not files:
            raise CorpusError(f"{path}: no .txt, .md or .jsonl[.gz] files inside")
        counts["ignored_files"] += others
        for file in files:
            yield from _read_file(file, target, encoding, counts)
    else:
        yield from _read_file(target, target.parent, encoding, counts)


def _read_file(file: Path, root: Path, encoding: str, counts: dict[str, int]) -> Iterator[Document]:
    if file.name.endswith(TEXT_SUFFIXES):
        text = read_text_file(file, encoding)
        if not text.strip():
            counts["empty_files"] += 1
            return
        rel = file.relative_to(root).as_posix()
        yield Document(id=rel, text=text, title=file.stem, source=rel, origin=str(file))
    elif file.name.endswith(JSONL_SUFFIXES):
        yield from _read_jsonl(file, encoding)
    else:
        raise CorpusError(f"{file}: unsupported file type (expected .txt, .md, .jsonl or .jsonl.gz)")


def read_text_file(file: Path, encoding: str = DEFAULT_ENCODING) -> str:
    """The whole text of a file, decoded strictly; CorpusError naming the file when it is binary or not in
    `encoding`."""
    try:
        data = file.read_bytes()
    except OSError as err:
        raise CorpusError(f"{file}: cannot read ({err})") from err
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as err:
        raise CorpusError(_undecodable(file, data, encoding, err)) from None
    del data  # only the text is kept: a large file is not held twice
    _refuse_binary(file, text)
    return text


def _undecodable(file: Path, data: bytes, encoding: str, err: UnicodeDecodeError) -> str:
    if data.startswith(UTF16_BOMS) and encoding == DEFAULT_ENCODING:
        return f"{file}: starts with a UTF-16 byte-order mark; pass --encoding utf-16 (encoding='utf-16')"
    nul = data.find(b"\x00", 0, BINARY_SAMPLE)
    if nul >= 0:
        return f"{file}: looks like a binary file, not text (NUL byte at offset {nul}); only text files are indexed"
    sample = data[:BINARY_SAMPLE].decode("latin-1")  # any bytes: C0 and C1 control bytes show as controls
    controls = len(CONTROL_CHARS.findall(sample))
    if controls > MAX_CONTROL_SHARE * len(sample):
        return (
            f"{file}: looks like a binary file, not text ({controls / len(sample):.0%} control bytes); only "
            "text files are indexed"
        )
    # utf-8-sig reports positions after the byte-order mark it skipped: count them from the file's start.
    offset = err.start + (
        len(codecs.BOM_UTF8) if encoding == DEFAULT_ENCODING and data.startswith(codecs.BOM_UTF8) else 0
    )
    return (
        f"{file}: not valid {_encoding_hint(encoding)} (byte 0x{data[offset]:02x} at offset {offset}); "
        "if you know its encoding, pass it: --encoding latin-1 (encoding='latin-1'), cp1252, ..."
    )


def _refuse_binary(file: Path, text: str) -> None:
    nul = text.find("\x00")
    if nul >= 0:
        raise CorpusError(
            f"{file}: looks like a binary file, not text (NUL character at offset {nul}); only text files are indexed"
        )
    controls = len(CONTROL_CHARS.findall(text)) if text else 0
    if controls > MAX_CONTROL_SHARE * len(text):
        raise CorpusError(
            f"{file}: looks like a binary file, not text ({controls / len(text):.0%} control "
            "characters); only text files are indexed"
        )


def _read_jsonl(file: Path, encoding: str) -> Iterator[Document]:
    try:
        for line_no, line in _decoded_lines(file, encoding):
            if line.strip():
                yield _record_to_document(_json_line(line, file, line_no), f"{file}:{line_no}")
    except (OSError, EOFError, zlib.error) as err:  # a truncated or corrupt .gz, an unreadable file
        raise CorpusError(f"{file}: cannot read ({err})") from err


def _decoded_lines(file: Path, encoding: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, decoded strictly. Lines are split on bytes and decoded one by one
    when the encoding writes newlines as ASCII (UTF-8, latin-1, cp1252, ...), so an error names its own line;
    otherwise (UTF-16, ...) the file is decoded as a stream and an error names the line after the last read."""
    ascii_newlines = "a\n".encode(encoding).endswith(b"a\n")
    opener: Any = gzip.open if file.suffix == ".gz" else open
    line_no = 0
    try:
        if ascii_newlines:
            with opener(file, "rb") as handle:
                for line_no, raw in enumerate(handle, 1):
                    yield line_no, raw.decode(encoding)
        else:
            with opener(file, "rt", encoding=encoding, errors="strict") as handle:
                for line_no, line in enumerate(handle, 1):
                    yield line_no, line
                line_no = 0
    except UnicodeDecodeError as err:
        where = line_no if ascii_newlines else line_no + 1
        raise CorpusError(
            f"{file}:{where}: not valid {_encoding_hint(encoding)} ({err.reason}); if you know its "
            "encoding, pass it: --encoding latin-1 (encoding='latin-1'), cp1252, ..."
        ) from None


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
    meta = {
        k: v
        for k, v in record.items()
        if k not in ("id", "_id", "text", "contents", "title", "source") and isinstance(v, (str, int, float, bool))
    }
    return Document(
        id=str(doc_id),
        text=text,
        title=str(record.get("title") or ""),
        source=str(record.get("source") or where.rsplit(":", 1)[0]),
        meta=meta,
        origin=where,
    )


def _read_hf_dataset(name: str) -> Iterator[Document]:
    """A hub dataset with `text` (or `contents`) and optional `id`/`title` columns, e.g. MedRAG/textbooks."""
    from datasets import load_dataset

    dataset_name, _, split = name.partition(":")
    try:
        rows = load_dataset(dataset_name, split=split or "train")
    except (OSError, ValueError) as err:  # no network or HF_HUB_OFFLINE (ConnectionError is an OSError), no dataset
        cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise CorpusError(
            f"hf://{name}: cannot load the Hugging Face dataset {dataset_name!r} ({cause}); without internet, "
            "index a local copy instead (JSONL with id and text, or a folder of .txt/.md files)"
        ) from err
    for index, row in enumerate(rows):
        record = dict(row)
        record.setdefault("id", f"{dataset_name}/{index}")
        record.setdefault("source", dataset_name)
        yield _record_to_document(record, f"hf://{dataset_name} row {index}")


def iter_chunks(documents: Iterable[Document], chunk_size: int = 256, chunk_overlap: int = 32) -> Iterator[Chunk]:
    """Token-bounded chunks of each whole document (llama-index SentenceSplitter), with exact offsets.

    The splitter is linear in the text (a 5 MB document: 5-15 s), so documents are not cut to a maximum
    length; it is given a long document in consecutive sections (`sections`), and no chunk spans two. Its
    pieces are stripped spans of the text; each is found in a window after the previous one (`_locate`;
    bounded, so a long document stays linear)."""
    from llama_index.core.node_parser import SentenceSplitter

    splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=chunk_overlap)
    for doc in documents:
        try:
            pieces = [piece for section in sections(doc.text) for piece in splitter.split_text(section)]
        except (ValueError, TimeoutError) as err:  # "Single token exceeded chunk size"; a regex over its limit
            raise CorpusError(f"{doc.origin or doc.id}: cannot be chunked ({err})") from err
        previous_start, previous_end = -1, 0
        for piece in pieces:
            start = _locate(doc, piece, previous_start, previous_end)
            end = start + len(piece)
            previous_start, previous_end = start, end
            yield Chunk(
                id=f"{doc.id}#{start}-{end}",
                doc_id=doc.id,
                text=piece,
                title=doc.title,
                source=doc.source,
                start=start,
                end=end,
            )


def sections(text: str, limit: int = SPLIT_PIECE_CHARS) -> Iterator[str]:
    """Consecutive pieces of `text` that join back to it, each at most `limit` characters: cut after the last
    paragraph break in the second half of the window, else the last line break, else the last blank, else at
    the limit."""
    start = 0
    while len(text) - start > limit:
        low, high = start + limit // 2, start + limit
        cut = next(
            (
                found + len(separator)
                for separator in ("\n\n", "\n", " ")
                if (found := text.rfind(separator, low, high - len(separator) + 1)) >= 0
            ),
            high,
        )
        yield text[start:cut]
        start = cut
    yield text[start:]


def _locate(doc: Document, piece: str, previous_start: int, previous_end: int) -> int:
    """Where `piece` starts. A chunk starts after the previous one's start and no later than the first
    non-blank character after its end (chunks overlap or follow each other; the splitter strips blanks).
    The latest match in that window is taken: in repetitive text an earlier one would drift backwards and
    leave the document's end in no chunk."""
    next_text = NON_BLANK.search(doc.text, previous_end)
    latest = next_text.start() if next_text else len(doc.text)
    start = doc.text.rfind(piece, previous_start + 1, latest + len(piece))
    if start < 0:  # not expected from the splitter: a little further back, then the rest once; never a guess
        start = doc.text.rfind(piece, max(0, previous_start - 4 * len(piece)), latest + len(piece))
    if start < 0:
        start = doc.text.find(piece, previous_start + 1)
    if start < 0:
        raise CorpusError(
            f"{doc.origin or doc.id}: the chunker returned text that is not in the document "
            f"(after offset {previous_start}); please report this"
        )
    return start


def chunk_documents(documents: Iterable[Document], chunk_size: int = 256, chunk_overlap: int = 32) -> list[Chunk]:
    """All chunks of `documents` (see `iter_chunks`)."""
    return list(iter_chunks(documents, chunk_size, chunk_overlap))
