"""Reading loses nothing silently: long documents are indexed whole, files that are not text in the given
encoding are refused with the file named, and renamed or dropped repeats are counted where the user sees them.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import time
from pathlib import Path

import pytest

from ermedrag.testing.vectors import HashVectors
from ermedrag.tools.retrieval.corpus import (
    CorpusError,
    Document,
    chunk_documents,
    read_corpus,
    read_documents,
    sections,
)
from ermedrag.tools.retrieval.index import build_index, open_index
from ermedrag.tools.retrieval.search import bm25_search

WORDS = (
    "patient dose renal hepatic clearance infusion therapy acute chronic trial cohort outcome risk "
    "diagnosis imaging biopsy lesion antibody receptor inhibitor café naïve"
).split()
LATIN1_TEXT = "Le café du patient: fièvre à 39 °C, traitée par paracétamol (½ comprimé)."


def _long_text(chars: int, seed: int = 7) -> str:
    """Paragraphs of sentences (some non-ASCII), `chars` long or a little more."""
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < chars:
        sentences = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))).capitalize() + "."
            for _ in range(rng.randint(2, 8))
        ]
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs)


def _assert_chunks_cover(text: str, spans: list[tuple[int, int]]) -> None:
    """Every non-blank character of `text` is inside some chunk."""
    spans = sorted(spans)
    assert not text[: spans[0][0]].strip() and not text[max(end for _, end in spans) :].strip()
    reach = 0
    for start, end in spans:
        assert not text[reach:start].strip(), f"characters {reach}-{start} are in no chunk"
        reach = max(reach, end)


# --- long documents ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chars", [pytest.param(2_100_000, id="2.1M-chars"), pytest.param(5_000_000, id="5MB", marks=pytest.mark.slow)]
)
def test_a_long_document_is_indexed_whole(tmp_path: Path, chars: int) -> None:
    """Longer than the 2,000,000 characters documents used to be cut at (the fast case) and 5 MB (slow: ~25 s
    on 2 busy cores, most of it the splitter and Chroma; the encoder is not loaded)."""
    text = _long_text(chars)
    marker_at = len(text) - 50_000
    text = text[:marker_at] + " Zorbitine toxicity turns fingernails blue. " + text[marker_at:]
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    assert path.stat().st_size > chars

    (doc,) = read_documents([path])
    assert doc.text == text  # whole: nothing cut at 2,000,000 characters any more
    started = time.perf_counter()
    stats = build_index([doc], tmp_path / "index", precomputed=HashVectors(), progress=False)
    seconds = time.perf_counter() - started
    index = open_index(tmp_path / "index")
    metas = index.collection.get(include=["metadatas"])["metadatas"]
    assert stats["chunks_total"] == len(metas) == len(index.bm25_ids) > chars // 2_000
    _assert_chunks_cover(text, [(m["start"], m["end"]) for m in metas])
    (hit, *_) = bm25_search(index, "zorbitine", 3)
    chunk = index.chunks([hit.chunk_id])[hit.chunk_id]
    assert chunk.start > 2_000_000 and "Zorbitine" in chunk.text == text[chunk.start : chunk.end]
    print(f"{len(text):,} characters: {stats['chunks_total']} chunks, build {seconds:.1f}s without the encoder")


def test_a_long_text_reaches_the_sentence_splitter_in_sections_that_join_back_to_it() -> None:
    """nltk's sentence regexes run under a 5 s wall-clock limit over what they are given: a 5 MB document in one
    piece timed out on 2 busy cores. Sections are bounded, cut at a paragraph, else a line, else a blank."""
    text = _long_text(50_000)
    cuts = list(sections(text, limit=4_000))
    assert "".join(cuts) == text and all(len(c) <= 4_000 for c in cuts) and len(cuts) > 12
    assert all(c.endswith("\n\n") for c in cuts[:-1])  # every paragraph here is shorter than half a section
    one_line = " ".join(["word"] * 3_000)
    assert all(c.endswith(" ") for c in list(sections(one_line, limit=1_000))[:-1])
    unbroken = "x" * 2_500
    assert list(sections(unbroken, limit=1_000)) == ["x" * 1_000, "x" * 1_000, "x" * 500]
    assert list(sections(text)) == [text] and list(sections("")) == [""]  # shorter than the default: one section


def test_chunk_offsets_are_exact_in_text_without_spaces_or_sentences() -> None:
    rng = random.Random(3)
    texts = {
        "no-spaces": "".join(rng.choice("abcdefgh") for _ in range(30_000)),
        "one-line": " ".join(rng.choice(WORDS) for _ in range(6_000)),
        "repeats": "Same sentence again. " * 2_000,
    }
    chunks = chunk_documents([Document(id=name, text=text) for name, text in texts.items()])
    for name, text in texts.items():
        mine = [c for c in chunks if c.doc_id == name]
        assert all(text[c.start : c.end] == c.text and c.id == f"{name}#{c.start}-{c.end}" for c in mine), name
        _assert_chunks_cover(text, [(c.start, c.end) for c in mine])


# --- encodings and binary files ------------------------------------------------------------------------------


def test_latin1_is_refused_without_an_encoding_and_read_right_with_it(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(LATIN1_TEXT.encode("latin-1"))
    offset = LATIN1_TEXT.encode("latin-1").index("é".encode("latin-1"))
    with pytest.raises(
        CorpusError,
        match=re.escape(f"{path}: not valid UTF-8 (byte 0xe9 at offset {offset}); ") + r".*--encoding latin-1",
    ) as err:
        read_documents([path])
    assert "\ufffd" not in str(err.value)
    (doc,) = read_documents([path], encoding="latin-1")
    assert doc.text == LATIN1_TEXT


def test_random_bytes_are_refused_as_binary(tmp_path: Path) -> None:
    rng = random.Random(11)
    with_nul = tmp_path / "random.txt"
    with_nul.write_bytes(bytes(rng.randrange(256) for _ in range(20_000)))
    no_nul = tmp_path / "random-no-nul.md"
    no_nul.write_bytes(bytes(rng.randrange(1, 256) for _ in range(20_000)))
    for path in (with_nul, no_nul):
        for encoding in (None, "latin-1"):  # latin-1 decodes any bytes: the control characters give it away
            with pytest.raises(CorpusError, match=re.escape(f"{path}: looks like a binary file, not text")):
                read_documents([path], encoding=encoding)


def test_a_file_with_a_nul_byte_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dump.md"
    path.write_bytes(b"# Notes\n\nMostly text, then a NUL:\x00 and more text.\n")
    with pytest.raises(
        CorpusError, match=re.escape(f"{path}: looks like a binary file, not text (NUL character at offset 33)")
    ):
        read_documents([path])


def test_boms_and_other_encodings(tmp_path: Path) -> None:
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfSalbutamol relieves bronchospasm.")
    assert read_documents([bom])[0].text == "Salbutamol relieves bronchospasm."
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text(LATIN1_TEXT, encoding="utf-16")
    with pytest.raises(
        CorpusError, match=re.escape(f"{utf16}: starts with a UTF-16 byte-order mark; pass --encoding utf-16")
    ):
        read_documents([utf16])
    assert read_documents([utf16], encoding="utf-16")[0].text == LATIN1_TEXT
    with pytest.raises(CorpusError, match="unknown encoding 'klingon'"):
        read_documents([bom], encoding="klingon")


def test_jsonl_and_gzip_are_strict_too(tmp_path: Path) -> None:
    record = json.dumps({"id": "a", "text": LATIN1_TEXT}, ensure_ascii=False)
    plain = tmp_path / "latin1.jsonl"
    plain.write_bytes(b'{"id": "z", "text": "fine"}\n' + record.encode("latin-1") + b"\n")
    gz = tmp_path / "latin1.jsonl.gz"
    with gzip.open(gz, "wb") as handle:
        handle.write(plain.read_bytes())
    for path in (plain, gz):
        with pytest.raises(CorpusError, match=re.escape(f"{path}:2: not valid UTF-8") + r".*--encoding latin-1"):
            read_documents([path])
        assert read_documents([path], encoding="latin-1")[1].text == LATIN1_TEXT
    truncated = tmp_path / "truncated.jsonl.gz"
    truncated.write_bytes(gz.read_bytes()[:-12])
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_bytes(plain.read_bytes())
    for path in (truncated, not_gzip):
        with pytest.raises(CorpusError, match=re.escape(f"{path}") + ".*cannot read"):
            read_documents([path])


# --- repeats, empty and other files: counted -----------------------------------------------------------------


def _records(*pairs: tuple[str, str]) -> str:
    return "".join(json.dumps({"id": i, "title": i, "text": t}) + "\n" for i, t in pairs)


def test_repeats_empty_and_ignored_files_are_counted(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text(
        _records(
            ("x", "Metformin first."),
            ("x", "Metformin first."),
            ("x", "Insulin later."),
            ("x~2", "A literal id."),
            ("x", "Sulfonylureas third."),
            ("y", "Epinephrine for anaphylaxis."),
        )
    )
    (folder / "empty.txt").write_text("  \n")
    (folder / "table.csv").write_text("a,b\n")
    corpus = read_corpus([folder])
    assert [d.id for d in corpus.documents] == ["x", "x~2", "x~2~2", "x~3", "y"]
    assert (corpus.renamed_ids, corpus.dropped_repeats, corpus.empty_files, corpus.ignored_files) == (3, 1, 1, 1)
    assert corpus.summary() == (
        f"3 reused ids renamed id~N, e.g. x~2 from {folder}/a.jsonl:3, x~2~2 from "
        f"{folder}/a.jsonl:4, x~3 from {folder}/a.jsonl:5; 1 exact repeats dropped; "
        "1 empty files skipped; 1 files of other types ignored"
    )
    assert read_corpus([folder / "a.jsonl"]).summary().startswith("3 reused ids")
    with pytest.raises(
        CorpusError, match=re.escape(f"{folder}/a.jsonl:3: document id 'x' already used at {folder}/a.jsonl:1")
    ):
        read_corpus([folder], on_duplicate_id="error")


def test_cli_index_names_the_file_takes_an_encoding_and_counts_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ermedrag.cli import main

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "notes.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (folder / "qa.jsonl").write_text(
        _records(
            ("q1", "Epinephrine treats anaphylaxis."),
            ("q1", "Amoxicillin treats pneumonia."),
            ("q1", "Epinephrine treats anaphylaxis."),
            ("q2", "Warfarin needs INR checks."),
        )
    )
    directory = tmp_path / "index"
    assert main(["index", str(folder), "--index-dir", str(directory)]) == 2
    err = capsys.readouterr().err
    assert f"error: {folder / 'notes.txt'}: not valid UTF-8" in err and "--encoding latin-1" in err
    assert not (directory / "manifest.json").exists()

    assert main(["index", str(folder), "--index-dir", str(directory), "--encoding", "latin-1"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"indexed 4 documents \(1 reused ids renamed id~N, e\.g\. q1~2 from {re.escape(str(folder))}"
        r"/qa\.jsonl:2; 1 exact repeats dropped\): 4 new chunks \(0 already indexed\), 4 in the "
        r"index; [0-9.]+s",
        summary,
    ), summary
    index = open_index(directory)
    assert LATIN1_TEXT in {c.text for c in index.chunks(index.bm25_ids).values()}


def test_a_byte_order_mark_before_latin_1_names_the_right_byte(tmp_path: Path) -> None:
    """utf-8-sig reports offsets after the mark it skipped: the message counts from the file's start."""
    from ermedrag.tools.retrieval.corpus import CorpusError

    latin = tmp_path / "notes.txt"
    latin.write_bytes(b"\xef\xbb\xbfCaf\xe9 au lait.")  # a UTF-8 mark, then Latin-1 text
    with pytest.raises(CorpusError, match=r"byte 0xe9 at offset 6\)"):
        read_documents([latin])


def test_a_hub_dataset_that_cannot_be_reached_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from ermedrag.tools.retrieval.corpus import CorpusError

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'MedRAG/textbooks' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(CorpusError, match=r"hf://MedRAG/textbooks: cannot load the Hugging Face dataset") as caught:
        read_documents(["hf://MedRAG/textbooks"])
    assert "index a local copy instead" in str(caught.value) and "\n" not in str(caught.value)
