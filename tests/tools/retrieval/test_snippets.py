"""Snippets have a minimum length: a title line is merged with the window after it, never a snippet alone (issue 38).

A passage that is short as a whole stays one snippet: BioASQ's gold snippets include 37-character ones, and
dropping them cost recall on the retrieval bench. The index test builds a real index (Chroma on disk, the
packaged MiniLM, bm25s) from three small .txt files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ermedrag.tools.retrieval.corpus import read_documents
from ermedrag.tools.retrieval.index import build_index, open_index
from ermedrag.tools.retrieval.search import (
    DEFAULT_CONFIG,
    RetrievalConfig,
    merge_short_windows,
    retrieve,
    sentence_windows,
)

MIN = DEFAULT_CONFIG.min_snippet_chars
ASTHMA = (
    "Asthma\n\n"
    "Asthma is a chronic inflammatory disease of the airways with episodes of wheeze and breathlessness. "
    "Inhaled corticosteroids are the mainstay of persistent asthma control.\n\n"
    "Severe asthma attacks are treated with oxygen, nebulised salbutamol and systemic steroids.\n\n"
    "See also"
)


def _texts(text: str, **options: int) -> list[str]:
    return [text[s:e] for s, e in sentence_windows(text, **options)]


def test_the_minimum_is_a_config_field_and_is_checked():
    assert 20 <= MIN <= 80
    assert RetrievalConfig(min_snippet_chars=0).min_snippet_chars == 0
    with pytest.raises(ValueError):
        RetrievalConfig(min_snippet_chars=-1)


def test_a_title_line_leads_the_next_window_and_a_last_short_line_joins_the_one_before():
    windows = _texts(ASTHMA)
    assert windows[0].startswith("Asthma\n\nAsthma is a chronic")
    assert windows[-1].endswith("systemic steroids.\n\nSee also")
    assert all(len(w.strip()) >= MIN for w in windows)
    # Off (0): the old windows, the title alone among them.
    assert "Asthma" in _texts(ASTHMA, min_chars=0)


def test_a_text_shorter_than_the_minimum_is_one_window_and_a_blank_one_none():
    short = "PD-1 has two ligands. PD-L1 and PD-L2."
    assert len(short) < MIN and sentence_windows(short, window=0) == [(0, len(short))]
    assert sentence_windows("Asthma") == [(0, 6)]
    assert sentence_windows("   \n") == []


def test_merged_windows_keep_the_maximum_length():
    text = "Title\n\n" + "A sentence that runs on for a while. " * 10
    for max_chars in (40, 100, 600):
        windows = sentence_windows(text, max_chars=max_chars)
        assert windows and all(e - s <= max_chars for s, e in windows)
    # Shorts in a row are joined until they reach the minimum.
    assert merge_short_windows("ab cd ef gh", [(0, 2), (3, 5), (6, 8), (9, 11)], 5, 100) == [(0, 5), (6, 11)]


def test_a_corpus_with_a_title_line_never_yields_a_shorter_snippet(tmp_path: Path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "asthma.txt").write_text(ASTHMA + "\n")
    (folder / "pd1.txt").write_text("PD-1 has two ligands PD-L1 and PD-L2.\n")  # short, whole: one snippet
    (folder / "copd.txt").write_text(
        "COPD\n\nChronic obstructive pulmonary disease is a progressive airflow limitation, mostly from smoking. "
        "Long-acting bronchodilators relieve its symptoms.\n"
    )
    build_index(read_documents([folder]), tmp_path / "index", progress=False)
    index = open_index(tmp_path / "index")
    for question in ("Asthma", "What is asthma?", "COPD"):
        snippets = retrieve(index, question, k=10)
        assert snippets, question
        long_docs = [s for s in snippets if s.doc_id != "pd1.txt"]
        assert long_docs and all(len(s.text) >= MIN for s in long_docs), [s.text for s in snippets]
    assert [s.text for s in retrieve(index, "ligands of PD-1", k=1)] == ["PD-1 has two ligands PD-L1 and PD-L2."]
    best = retrieve(index, "Asthma", k=1)[0]
    assert best.doc_id == "asthma.txt" and best.text.startswith("Asthma\n\nAsthma is a chronic")
    # Without the minimum the title line comes back as a snippet of its own (what issue 38 found).
    unmerged = retrieve(index, "Asthma", k=10, config=dataclasses.replace(DEFAULT_CONFIG, min_snippet_chars=0))
    assert "Asthma" in [s.text for s in unmerged]
