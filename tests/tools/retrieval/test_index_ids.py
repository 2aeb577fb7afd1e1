"""A document whose id the index already holds, in any later run: replaced, renamed, refused or skipped by
`on_duplicate_id`, a no-op when its text is the same, never lost or doubled; a replace commits with the crash
protocol (real kills of real processes), and BM25 after it scores as one BM25 over the final chunks.

Indexes are real (Chroma on disk, BM25 segments, the manifest); vectors come from `HashVectors` (no encoder),
except where the CLI runs, which refuses before it would embed anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ermedrag.tools.retrieval.bm25 import SegmentedBM25, load_segment, merge_segments, write_segment
from ermedrag.tools.retrieval.corpus import CorpusError, read_corpus, read_documents
from ermedrag.tools.retrieval.index import DuplicateIdError, build_index, describe_documents, open_index
from ermedrag.tools.retrieval.index_files import BM25_PARAMS, PAUSE_ENV, chunk_texts
from ermedrag.tools.retrieval.search import bm25_search
from tests.conftest import REPO
from tests.tools.retrieval.test_bm25_segments import reference_scores, weighted_terms
from ermedrag.testing.vectors import HashVectors
from tests.tools.retrieval.test_index_durability import (
    CHILD,
    CHILD_TIMEOUT_S,
    _drop_chroma_clients,
    _env,
    _kill,
    _wait_for_line,
)

POLICIES = ("replace", "rename", "skip", "error")
# One document, three later versions: the same text; a text of the same length (its chunk spans the same offsets,
# so its chunk id is the same: the case the issue found indexed nothing); a longer one.
FIRST = "Zorbitine toxicity turns the fingernails blue."
LATER = {
    "same_text": FIRST,
    "same_length": "Zorbitine toxicity turns the fingernails gold.",
    "other_length": "Zorbitine toxicity turns the fingernails a deep violet.",
}
OTHER = "Warfarin needs regular INR monitoring."


def _jsonl(path: Path, *records: tuple[str, str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "title": "", "text": t}) + "\n" for i, t in records))
    return path


def _build(paths: list[Path], directory: Path, policy: str = "replace") -> dict[str, Any]:
    documents = read_documents(paths, on_duplicate_id=policy)
    return build_index(documents, directory, precomputed=HashVectors(), progress=False, on_duplicate_id=policy)


def held(directory: str | Path) -> dict[str, Any]:
    """What opening the index gives (it may repair it first): each document's chunk texts by offset, after
    checking that BM25, Chroma and the manifest list the same chunks, each once."""
    index = open_index(directory)
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    chroma = index.collection.get(include=[])["ids"]
    assert len(index.bm25_ids) == len(set(index.bm25_ids)) == manifest["chunks"], "a chunk listed twice"
    assert set(index.bm25_ids) == set(chroma), sorted(set(index.bm25_ids) ^ set(chroma))[:5]
    docs: dict[str, list[tuple[int, str]]] = {}
    for chunk in index.chunks(index.bm25_ids).values():
        docs.setdefault(chunk.doc_id, []).append((chunk.start, chunk.text))
    return {doc_id: [text for _, text in sorted(chunks)] for doc_id, chunks in docs.items()}


def _bm25_docs(directory: Path, query: str) -> set[str]:
    index = open_index(directory)
    return {hit.chunk_id.rpartition("#")[0] for hit in bm25_search(index, query, 10)}


def _files(directory: Path) -> dict[str, bytes]:
    """manifest.json and the BM25 segments, byte for byte."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in [directory / "manifest.json", *(directory / "bm25").rglob("*")]
        if p.is_file() and p.name != ".lock"
    }


# --- every policy across two runs ---------------------------------------------------------------------------


@pytest.mark.parametrize("later", list(LATER))
@pytest.mark.parametrize("policy", POLICIES)
def test_a_document_indexed_again_under_each_policy(tmp_path: Path, policy: str, later: str) -> None:
    """Run 1 indexes d1 and d2 from notes.jsonl; the file is edited and run 2 indexes it again."""
    corpus, directory = tmp_path / "notes.jsonl", tmp_path / "index"
    _build([_jsonl(corpus, ("d1", FIRST), ("d2", OTHER))], directory, policy)
    before, files = held(directory), _files(directory)
    chroma = open_index(directory).collection.get(include=["documents"])
    _jsonl(corpus, ("d1", LATER[later]))
    if later == "same_text":  # a no-op under every policy
        stats = _build([corpus], directory, policy)
        assert (stats["documents_unchanged"], stats["chunks_added"], stats["chunks_removed"]) == (1, 0, 0)
        assert held(directory) == before
        assert describe_documents(stats) == "1 already indexed unchanged"
        return
    if policy == "error":
        with pytest.raises(DuplicateIdError) as refused:
            _build([corpus], directory, policy)
        message = str(refused.value)
        assert message.startswith(f"{corpus}:1: document id 'd1' is already indexed in {directory} with other text")
        assert "nothing was written" in message and "--on-duplicate-id replace" in message
        assert _files(directory) == files  # byte for byte
        _drop_chroma_clients()
        assert open_index(directory).collection.get(include=["documents"]) == chroma
        assert held(directory) == before
        return
    stats = _build([corpus], directory, policy)
    expected = {
        "replace": {"d1": [LATER[later]], "d2": [OTHER]},
        "rename": {"d1": [FIRST], "d1~2": [LATER[later]], "d2": [OTHER]},
        "skip": {"d1": [FIRST], "d2": [OTHER]},
    }[policy]
    assert held(directory) == expected
    outcome = {"replace": "replaced", "rename": "renamed", "skip": "skipped"}[policy]
    assert stats[f"documents_{outcome}"] == 1 and stats["documents_new"] == stats["documents_unchanged"] == 0
    shown = "d1~2" if policy == "rename" else "d1"
    assert stats[f"{outcome}_examples"] == [f"{shown} from {corpus}:1"]
    said = {"replace": "replaced", "rename": "kept as id~N", "skip": "skipped"}[policy]
    assert describe_documents(stats) == f"1 already indexed with other text {said}, e.g. {shown} from {corpus}:1"
    new_word, old_word = LATER[later].split()[-1].rstrip("."), "blue"
    assert _bm25_docs(directory, new_word) == (
        {"d1"} if policy == "replace" else {"d1~2"} if policy == "rename" else set()
    )
    assert _bm25_docs(directory, old_word) == (set() if policy == "replace" else {"d1"})
    if policy == "replace":
        (chunk_id,) = [cid for cid in open_index(directory).bm25_ids if cid.startswith("d1#")]
        end = len(LATER[later])
        # Same offsets: the new text cannot take the committed chunk's id (Chroma holds one text per id).
        assert chunk_id == (f"d1#0-{end}~2" if later == "same_length" else f"d1#0-{end}")
        assert (stats["chunks_added"], stats["chunks_removed"]) == (1, 1)


def test_replace_updates_a_document_again_and_again(tmp_path: Path) -> None:
    """A chunk on the same offsets alternates between `doc#s-e` and `doc#s-e~2`: the id its old version had is
    free again after the commit that replaced it."""
    corpus, directory = tmp_path / "notes.jsonl", tmp_path / "index"
    ids = []
    for text in (FIRST, LATER["same_length"], FIRST.replace("blue", "pink"), FIRST):
        _build([_jsonl(corpus, ("d1", text))], directory)
        assert held(directory) == {"d1": [text]}
        ids.append(open_index(directory).bm25_ids)
    end = len(FIRST)
    assert ids == [[f"d1#0-{end}"], [f"d1#0-{end}~2"], [f"d1#0-{end}"], [f"d1#0-{end}~2"]]


def test_a_long_document_edited_in_one_place_embeds_only_its_changed_chunks(tmp_path: Path) -> None:
    sentences = [f"Sentence {i} says that drug number {i} treats condition number {i} well." for i in range(120)]
    corpus, directory = tmp_path / "book.jsonl", tmp_path / "index"
    first = _build([_jsonl(corpus, ("book", " ".join(sentences)))], directory)
    before = set(open_index(directory).bm25_ids)
    assert first["chunks_added"] >= 4
    sentences[-2] = sentences[-2].replace("well", "fast")  # same length, near the end
    stats = _build([_jsonl(corpus, ("book", " ".join(sentences)))], directory)
    after = set(open_index(directory).bm25_ids)
    assert stats["documents_replaced"] == 1 and 1 <= stats["chunks_added"] == stats["chunks_removed"] <= 2
    assert len(before & after) == first["chunks_added"] - stats["chunks_removed"]  # the others keep their ids
    assert "".join(held(directory)["book"]).count("fast") == 1
    assert stats["chunks_seen"] == first["chunks_added"] == stats["chunks_total"]


# --- rename across runs; two corpora that both number their ids 0, 1, 2 ------------------------------------


def test_rename_across_runs_looks_at_what_the_index_holds(tmp_path: Path) -> None:
    corpus, directory = tmp_path / "notes.jsonl", tmp_path / "index"
    texts = [f"Version {n} of the note on zorbitine." for n in range(5)]
    for run, text in enumerate(texts[:3]):
        stats = _build([_jsonl(corpus, ("d1", text))], directory, "rename")
        assert stats["documents_renamed" if run else "documents_new"] == 1
    assert held(directory) == {"d1": [texts[0]], "d1~2": [texts[1]], "d1~3": [texts[2]]}
    # A text one of its copies holds is there already, under any of them.
    stats = _build([_jsonl(corpus, ("d1", texts[1]))], directory, "rename")
    assert (stats["documents_unchanged"], stats["chunks_added"]) == (1, 0)
    # Within one input d1 is read twice: d1 and d1~2 (as read_corpus renames); each meets the index by its text.
    stats = _build(
        [_jsonl(corpus, ("d1", texts[2]), ("d1", texts[3]), ("d1", texts[4]), ("d1", texts[0]))], directory, "rename"
    )
    # d1 (texts 2) and d1~4 (texts 0) are there as d1~3 and d1; d1~2 and d1~3 hold other texts: their texts
    # take the first ids neither the index nor this input has.
    assert (stats["documents_unchanged"], stats["documents_renamed"], stats["documents_new"]) == (2, 2, 0)
    final = held(directory)
    assert sorted(text for chunks in final.values() for text in chunks) == sorted(texts)  # each text once
    assert final == {"d1": [texts[0]], "d1~2": [texts[1]], "d1~3": [texts[2]], "d1~5": [texts[3]], "d1~6": [texts[4]]}


def test_two_corpora_numbering_ids_0_1_2(tmp_path: Path) -> None:
    first = _jsonl(tmp_path / "first.jsonl", *[(str(i), f"First corpus, passage {i} on asthma.") for i in range(3)])
    second = _jsonl(tmp_path / "second.jsonl", *[(str(i), f"Second corpus, passage {i} on gout.") for i in range(3)])
    every = {f"First corpus, passage {i} on asthma." for i in range(3)} | {
        f"Second corpus, passage {i} on gout." for i in range(3)
    }
    directory = tmp_path / "kept"
    _build([first], directory, "rename")
    stats = _build([second], directory, "rename")
    assert stats["documents_renamed"] == 3 and stats["renamed_examples"][0] == f"0~2 from {second}:1"
    for corpus in (second, first):  # again: nothing changes
        assert _build([corpus], directory, "rename")["documents_unchanged"] == 3
    assert sorted(t for chunks in held(directory).values() for t in chunks) == sorted(every)

    directory = tmp_path / "replaced"  # the default replaces, and says the replaced ones came from elsewhere
    _build([first], directory)
    stats = _build([second], directory)
    assert (stats["documents_replaced"], stats["replaced_other_source"]) == (3, 3)
    assert stats["replaced_examples"][0] == f"0 from {second}:1 (indexed from {first})"
    assert "3 of them had been indexed from another source" in describe_documents(stats)
    assert "--on-duplicate-id rename" in describe_documents(stats)
    _build([first], directory, "rename")  # what the summary advises brings the first corpus back
    assert sorted(t for chunks in held(directory).values() for t in chunks) == sorted(every)


# --- ids that render the same -------------------------------------------------------------------------------


def test_ids_that_differ_only_in_unicode_normalisation_are_one_id(tmp_path: Path) -> None:
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    assert nfc != nfd
    one = tmp_path / "one.jsonl"
    _jsonl(one, (nfc, FIRST), (nfd, FIRST), (nfd, OTHER))
    corpus = read_corpus([one])
    assert [d.id for d in corpus.documents] == [nfc, f"{nfd}~2"] and corpus.dropped_repeats == 1
    with pytest.raises(CorpusError, match="another Unicode normalisation"):
        read_corpus([one], on_duplicate_id="error")

    directory = tmp_path / "index"
    _build([_jsonl(tmp_path / "a.jsonl", (nfc, FIRST))], directory)
    assert _build([_jsonl(tmp_path / "b.jsonl", (nfd, FIRST))], directory)["documents_unchanged"] == 1
    assert held(directory) == {nfc: [FIRST]}  # kept as first given
    stats = _build([_jsonl(tmp_path / "b.jsonl", (nfd, OTHER))], directory)
    assert stats["documents_replaced"] == 1 and held(directory) == {nfd: [OTHER]}  # the id as given now
    with pytest.raises(DuplicateIdError):
        _build([_jsonl(tmp_path / "c.jsonl", (nfc, FIRST))], directory, "error")
    assert _build([_jsonl(tmp_path / "c.jsonl", (nfc, FIRST))], directory, "rename")["renamed_examples"] == [
        f"{nfc}~2 from {tmp_path / 'c.jsonl'}:1"
    ]


# --- BM25 after a replace ------------------------------------------------------------------------------------


def test_bm25_after_replacing_documents_in_every_segment_equals_one_bm25(tmp_path: Path) -> None:
    """Three builds leave three segments; then documents of each are replaced (same offsets, other lengths, and
    every document of the newest segment): the segments holding them are written again without them, and every
    score equals one bm25s index over the final chunks, bit for bit. A term only a replaced text had is gone."""
    directory = tmp_path / "index"

    def note(i: int, version: str) -> tuple[str, str]:
        topic = ["asthma inhaler", "gout colchicine", "anaphylaxis epinephrine", "warfarin INR"][i % 4]
        return (f"n{i}", f"Note {i:02d} ({version}): {topic}; marker{version}{i} appears once.")

    for stop in (40, 50, 54):
        _build([_jsonl(tmp_path / "notes.jsonl", *[note(i, "old") for i in range(stop)])], directory)
    sizes = [s["chunks"] for s in json.loads((directory / "manifest.json").read_text())["bm25_segments"]]
    assert sizes == [40, 10, 4]
    assert "markerold3" in open_index(directory).bm25
    replaced = [3, 17, 39, 41, 49, 50, 51, 52, 53]
    records = [note(i, "new") for i in replaced]  # "new" and "old" have the same length: same offsets
    records[1] = ("n17", "Note 17 rewritten at another length: gout colchicine flare.")
    stats = _build([_jsonl(tmp_path / "edit.jsonl", *records)], directory)
    assert stats["documents_replaced"] == len(replaced) and stats["chunks_removed"] == len(replaced)
    manifest = json.loads((directory / "manifest.json").read_text())
    names = [s["name"] for s in manifest["bm25_segments"]]
    assert manifest["chunks"] == 54 and not {"s000001", "s000002", "s000003"} & set(names)  # all written again
    index = open_index(directory)
    assert "markerold3" not in index.bm25 and "markernew3" in index.bm25
    text_of = dict(zip(*chunk_texts(index.collection)))
    texts = [text_of[cid] for cid in index.bm25_ids]
    assert sum("(new)" in t for t in texts) == len(replaced) - 1
    assert not [cid for cid in index.bm25_ids if int(cid[1:].partition("#")[0]) in replaced and "(old)" in text_of[cid]]
    for query in ("gout colchicine flare", "asthma inhaler marker", "anaphylaxis epinephrine warfarin INR note"):
        weights = weighted_terms(index.bm25, query)
        np.testing.assert_array_equal(index.bm25.scores(weights), reference_scores(texts, weights))


def test_merging_a_segment_without_some_chunks_equals_writing_it_without_them(tmp_path: Path) -> None:
    ids = ["a", "b", "c", "d"]
    texts = ["aspirin bleeding risk", "warfarin only here", "aspirin and insulin", "insulin dose"]
    (tmp_path / "all").mkdir()
    write_segment(tmp_path / "all", ids, texts)
    (tmp_path / "kept").mkdir()
    merge_segments(tmp_path / "kept", [load_segment(tmp_path / "all")], drop={"b", "d"})
    (tmp_path / "fresh").mkdir()
    write_segment(tmp_path / "fresh", ["a", "c"], [texts[0], texts[2]])
    kept, fresh = load_segment(tmp_path / "kept"), load_segment(tmp_path / "fresh")
    assert kept.ids == ["a", "c"] and kept.lengths.tolist() == fresh.lengths.tolist()
    assert set(kept.terms) == set(fresh.terms) and "warfarin" not in kept.terms
    weights = {"aspirin": 1.0, "insulin": 2.0, "bleed": 0.5}
    np.testing.assert_array_equal(
        SegmentedBM25([kept], **BM25_PARAMS).scores(weights), SegmentedBM25([fresh], **BM25_PARAMS).scores(weights)
    )


# --- refused: nothing written, a clear message, from the command line too ---------------------------------


def _cli_offers(policy: str) -> bool:
    from ermedrag.cli import _parser

    try:
        _parser().parse_args(["index", "x", "--index-dir", "i", "--on-duplicate-id", policy])
    except SystemExit:
        return False
    return True


def test_cli_refuses_a_reused_id_naming_it_and_writes_nothing(tmp_path: Path) -> None:
    if not _cli_offers("skip"):
        pytest.skip("ermedrag index does not offer --on-duplicate-id replace|rename|skip|error yet")
    corpus, directory = tmp_path / "notes.jsonl", tmp_path / "index"
    _build([_jsonl(corpus, ("d1", FIRST), ("d2", OTHER))], directory)
    files = _files(directory)
    _jsonl(corpus, ("d2", OTHER), ("d1", LATER["same_length"]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ermedrag",
            "index",
            str(corpus),
            "--index-dir",
            str(directory),
            "--on-duplicate-id",
            "error",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-3000:])
    assert f"{corpus}:2: document id 'd1' is already indexed" in proc.stderr and "Traceback" not in proc.stderr
    assert _files(directory) == files
    assert held(directory) == {"d1": [FIRST], "d2": [OTHER]}


# --- a replace killed at any point: the old version or the new one, never both, never neither ---------------

N_DOCS = 16
REPLACED = range(0, 12, 2)  # same offsets, other text
LONGER = 13  # other length
NEW_DOC = "extra"


def _versions(tmp_path: Path) -> tuple[Path, Path, dict[str, list[str]], dict[str, list[str]]]:
    """Two files: the first indexes N_DOCS notes; the second replaces some (same offsets, and one longer), gives
    one unchanged, adds one; and what the index holds after each."""
    old = {f"n{i:02d}": f"Note {i:02d}: anaphylaxis epinephrine, version blue." for i in range(N_DOCS)}
    changed = {f"n{i:02d}": old[f"n{i:02d}"].replace("blue", "gold") for i in REPLACED}
    changed[f"n{LONGER}"] = f"Note {LONGER}: anaphylaxis epinephrine, a much longer version gold."
    edit = {**changed, "n15": old["n15"], NEW_DOC: "A new note: epinephrine auto-injector, gold."}
    first = _jsonl(tmp_path / "v1.jsonl", *old.items())
    second = _jsonl(tmp_path / "v2.jsonl", *edit.items())
    return first, second, {k: [v] for k, v in old.items()}, {k: [v] for k, v in {**old, **edit}.items()}


OPEN_CHILD = r"""
import json, sys
from tests.tools.retrieval.test_index_ids import held
print(json.dumps(held(sys.argv[1])))
"""


@pytest.mark.parametrize(
    ("point", "expect"),
    [
        ("vectors_added", "old"),  # some new chunks in Chroma, uncommitted
        ("bm25_rewritten", "old"),  # the segment holding replaced chunks written again, uncommitted
        ("manifest_staged", "old"),  # the new manifest written, not renamed
        ("committed", "new"),  # committed; every old chunk still in Chroma
        ("replaced_removed", "new"),  # committed; 2 old chunks deleted from Chroma, the others not yet
    ],
)
def test_a_replace_killed_leaves_the_old_or_the_new_version(tmp_path: Path, point: str, expect: str) -> None:
    first, second, old, new = _versions(tmp_path)
    directory = tmp_path / "index"
    _build([first], directory)
    _drop_chroma_clients()
    proc = subprocess.Popen(  # the durability tests' child: ADD_BATCH 4; PAGE 2 (deletes in batches of 2)
        [sys.executable, "-c", CHILD, "build", str(second), str(directory), "99", "2"],
        cwd=REPO,
        env=_env(**{PAUSE_ENV: f"{point}:60"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _wait_for_line(proc, f"{PAUSE_ENV} {point}")
    assert _kill(proc), "the child finished before the kill"
    opened = subprocess.run(  # a fresh process opens it (and repairs it)
        [sys.executable, "-c", OPEN_CHILD, str(directory)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert opened.returncode == 0, opened.stderr[-4000:]
    state = json.loads(opened.stdout.strip().splitlines()[-1])
    assert state == {"old": old, "new": new}[expect], point
    if point in ("committed", "replaced_removed"):
        assert "removed" in opened.stderr and "interrupted build" in opened.stderr  # the old chunks, uncommitted
    assert _bm25_docs(directory, "gold") == {doc_id for doc_id, texts in state.items() if "gold" in texts[0]}
    assert len(_bm25_docs(directory, "gold")) == (0 if expect == "old" else len(REPLACED) + 2)
    stats = _build([second], directory)  # the same build again completes it
    assert held(directory) == new
    outcomes = (stats["documents_replaced"], stats["documents_unchanged"], stats["documents_new"])
    assert outcomes == ((len(REPLACED) + 1, 1, 1) if expect == "old" else (0, len(REPLACED) + 3, 0))
    committed = {s["name"] for s in json.loads((directory / "manifest.json").read_text())["bm25_segments"]}
    assert {p.name for p in (directory / "bm25").iterdir()} - {".lock"} == committed
    assert not (directory / "manifest.json.tmp").exists()


# --- replacing in indexes that need a repair or a conversion ------------------------------------------------


def test_a_replace_in_an_index_from_before_segments(tmp_path: Path) -> None:
    """Its next build writes one segment of every chunk read back from Chroma: without the replaced ones."""
    from tests.tools.retrieval.test_bm25_segments import as_one_bm25s_index

    corpus, directory = tmp_path / "notes.jsonl", tmp_path / "index"
    _build([_jsonl(corpus, ("d1", FIRST), ("d2", OTHER))], directory)
    as_one_bm25s_index(directory, "g000004")
    stats = _build([_jsonl(corpus, ("d1", LATER["same_length"]))], directory)
    assert stats["documents_replaced"] == 1
    assert held(directory) == {"d1": [LATER["same_length"]], "d2": [OTHER]}
    assert _bm25_docs(directory, "blue") == set() and _bm25_docs(directory, "gold") == {"d1"}


def test_a_replace_of_a_document_whose_vectors_were_lost(tmp_path: Path) -> None:
    """Opening refuses an index whose store lost committed chunks; indexing the document again, changed,
    replaces it (the lost chunks leave the commit) and the index opens again."""
    from ermedrag.tools.retrieval.index import _client
    from ermedrag.tools.retrieval.index_files import IndexUnavailable

    corpus, directory = tmp_path / "notes.jsonl", tmp_path / "index"
    _build([_jsonl(corpus, ("d1", FIRST), ("d2", OTHER))], directory)
    _client(directory, None).get_collection("chunks").delete(ids=[f"d1#0-{len(FIRST)}"])
    with pytest.raises(IndexUnavailable, match="lacks 1 of the 2"):
        open_index(directory)
    stats = _build([_jsonl(corpus, ("d1", LATER["other_length"]))], directory)
    assert (stats["documents_replaced"], stats["chunks_removed"]) == (1, 1)
    assert held(directory) == {"d1": [LATER["other_length"]], "d2": [OTHER]}
