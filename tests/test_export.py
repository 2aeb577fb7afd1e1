"""Trace → training-data export on trace databases written by real graph runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from datasets import load_from_disk

from graphs.er_medrag import graph
from tests.conftest import SCRIPTED
from tools.jsonl import read_records
from tools.traces import TraceStore
from training.export import GRPOExportConfig, distractor_count, export_grpo

QUESTIONS = [
    ("Which drug is first-line for type 2 diabetes?", {"A": "Metformin", "B": "Insulin"}, "A"),
    ("What is the first treatment of anaphylaxis?", {"A": "Antihistamine", "B": "IM epinephrine"}, "B"),
    ("Which antibiotic treats strep pharyngitis?", {"A": "Penicillin", "B": "Vancomycin"}, "A"),
    ("What reverses opioid overdose?", {"A": "Flumazenil", "B": "Naloxone"}, "B"),
]


@pytest.fixture(scope="module")
def scripted_traces(tmp_path_factory) -> str:
    """A trace db of four ER-MedRAG runs with gold answers (scripted model: fast, well-formed output)."""
    db = str(tmp_path_factory.mktemp("traces") / "traces.sqlite")
    context = {"extractor_model": SCRIPTED, "respondent_model": SCRIPTED, "trace_db": db, "snippets_k": 3}
    for question, options, gold in QUESTIONS:
        graph.invoke({"question": question, "options": options, "gold": gold}, context=context)
    return db


def test_distractor_count():
    assert [distractor_count(n, 0.25) for n in (0, 3, 6, 9)] == [1, 1, 2, 3]
    assert distractor_count(5, 0.0) == 0


def test_grpo_export_rebuilds_prompts_with_noise_and_provenance(scripted_traces, tmp_path):
    counts = export_grpo(GRPOExportConfig(traces=scripted_traces, out=str(tmp_path), noise_fraction=0.25),
                         progress=False)
    assert counts == {"processed": 4, "skipped_done": 0, "rows": 4}
    dataset = load_from_disk(str(tmp_path / "dataset"))
    assert len(dataset) == 4 and {"prompt", "gold", "options", "triplets", "run_id", "event_id"} <= set(dataset.features)
    store = TraceStore(scripted_traces)
    for row in dataset:
        assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "user"]
        own = [t for t in row["triplets"] if not t["distractor"]]
        distractors = [t for t in row["triplets"] if t["distractor"]]
        assert len(own) == 3 and len(distractors) == row["n_distractors"] == 1
        assert set(row["snippet_ids"]) == {t["snippet_id"] for t in own}
        # Distractors come from other runs' recorded triplets.
        other_snippets = {t["snippet_id"] for e in store.events(agent="extractor") if e["run_id"] != row["run_id"]
                          for t in e["parsed"]["triplets"]}
        assert distractors[0]["snippet_id"] in other_snippets
        assert all(f"[{t['snippet_id']}]" in row["prompt"][-1]["content"] for t in row["triplets"])
        assert row["gold"] == store.run(row["run_id"])["gold"]
    # Same seed, same prompts; rerunning adds nothing.
    assert export_grpo(GRPOExportConfig(traces=scripted_traces, out=str(tmp_path)), progress=False) == {
        "processed": 0, "skipped_done": 4, "rows": 4}
    again = tmp_path / "again"
    export_grpo(GRPOExportConfig(traces=scripted_traces, out=str(again), noise_fraction=0.25), progress=False)
    assert (again / "data.jsonl").read_text() == (tmp_path / "data.jsonl").read_text()
