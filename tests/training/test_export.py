"""Trace → training-data export on trace databases written by real graph runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from datasets import load_from_disk

from ermedrag.graphs.er_medrag import graph
from tests.conftest import SCRIPTED
from ermedrag.tools.records.jsonl import read_records
from ermedrag.tools.records.traces import TraceStore
from ermedrag.training.export import GRPOExportConfig, distractor_count, export_grpo

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
    counts = export_grpo(
        GRPOExportConfig(traces=scripted_traces, out=str(tmp_path), noise_fraction=0.25), progress=False
    )
    assert counts == {"processed": 4, "skipped_done": 0, "rows": 4}
    dataset = load_from_disk(str(tmp_path / "dataset"))
    assert len(dataset) == 4 and {"prompt", "gold", "options", "triplets", "run_id", "event_id"} <= set(
        dataset.features
    )
    store = TraceStore(scripted_traces)
    for row in dataset:
        assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "user"]
        own = [t for t in row["triplets"] if not t["distractor"]]
        distractors = [t for t in row["triplets"] if t["distractor"]]
        assert len(own) == 3 and len(distractors) == row["n_distractors"] == 1
        assert set(row["snippet_ids"]) == {t["snippet_id"] for t in own}
        # Distractors come from other runs' recorded triplets.
        other_snippets = {
            t["snippet_id"]
            for e in store.events(agent="extractor")
            if e["run_id"] != row["run_id"]
            for t in e["parsed"]["triplets"]
        }
        assert distractors[0]["snippet_id"] in other_snippets
        assert all(f"[{t['snippet_id']}]" in row["prompt"][-1]["content"] for t in row["triplets"])
        assert row["gold"] == store.run(row["run_id"])["gold"]
    # Same seed, same prompts; rerunning adds nothing.
    assert export_grpo(GRPOExportConfig(traces=scripted_traces, out=str(tmp_path)), progress=False) == {
        "processed": 0,
        "skipped_done": 4,
        "rows": 4,
    }
    again = tmp_path / "again"
    export_grpo(GRPOExportConfig(traces=scripted_traces, out=str(again), noise_fraction=0.25), progress=False)
    assert (again / "data.jsonl").read_text() == (tmp_path / "data.jsonl").read_text()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from ermedrag.testing.tiny_model import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny"))


def test_dpo_export_replays_recorded_prompts_through_a_real_model(scripted_traces, tiny_model, tmp_path):
    from ermedrag.training.export import DPOExportConfig, export_dpo

    config = DPOExportConfig(
        traces=scripted_traces,
        out=str(tmp_path),
        model=f"hf:{tiny_model}",
        samples=2,
        temperature=1.0,
        max_new_tokens=16,
        margin=0.1,
        limit=4,
    )
    counts = export_dpo(config, progress=False)
    assert counts["processed"] == 4 and counts["rows"] >= 1
    log = list(read_records(tmp_path / "log.jsonl"))
    store = TraceStore(scripted_traces)
    for record in log:
        event = next(e for e in store.events(agent="extractor") if e["event_id"] == record["event_id"])
        # The recorded completion is always a candidate; the tiny model's samples are the others.
        assert record["candidates"][0]["completion"] == event["completion"]
        assert {"structure", "faithfulness", "conciseness", "usefulness", "total"} <= set(
            record["candidates"][0]["components"]
        )
    dataset = load_from_disk(str(tmp_path / "dataset"))
    for row in dataset:
        assert row["chosen_reward"] - row["rejected_reward"] >= 0.1
        assert row["prompt"][0]["role"] == "system" and row["prompt"][-1]["role"] == "user"
        assert row["chosen"][0]["content"].startswith("[{")  # the scripted, well-formed extraction wins
        event = next(e for e in store.events(agent="extractor") if e["event_id"] == row["event_id"])
        assert row["prompt"][-1]["content"] == event["messages"][-1]["content"]
        assert row["snippet_id"] == event["inputs"]["snippet_id"]


class CutShortSampler:
    """A scripted sampler (graph-wiring stand-in for the model): every alternative runs past the token budget, or
    (finished) ends at the extractor's stop `}]`, which the backend cuts off and reports, as the real ones do."""

    LIST = '[{"condition": "metformin", "relation": "treats", "conclusion": "type 2 diabetes"}'

    def __init__(self, finished: bool = False):
        self.finished = finished

    def batch(self, messages, stop=None):
        from types import SimpleNamespace

        if self.finished:
            return [SimpleNamespace(text=self.LIST[:-1], response_metadata={"stop_sequence": "}]"})] * len(messages)
        cut = self.LIST + ', {"condition": "metformin", "relation": "caus'
        return [
            SimpleNamespace(text=cut + "e" * i, response_metadata={"finish_reason": "length"})
            for i in range(len(messages))
        ]


@pytest.mark.parametrize("close", [False, True])
def test_dpo_export_can_close_lists_the_budget_cut(scripted_traces, tmp_path, close):
    from ermedrag.training.export import DPOExportConfig, _dpo_record
    from ermedrag.training.rewards.extraction import extractor_reward

    store = TraceStore(scripted_traces)
    event = next(iter(store.events(agent="extractor")))
    event = {**event, "completion": "I cannot extract anything."}  # the recorded call: unparseable
    config = DPOExportConfig(
        traces=scripted_traces, out=str(tmp_path), samples=2, usefulness=False, close_cut_lists=close
    )
    record = _dpo_record(event, store.run(event["run_id"]) or {}, CutShortSampler(), config, extractor_reward)
    origins = [c["origin"] for c in record["candidates"]]
    closed = [c for c in record["candidates"] if c["origin"].startswith("closed")]
    assert len(closed) == (1 if close else 0)  # both samples close to the same list: one candidate
    if close:
        assert closed[0]["components"]["structure"] == 1.0 and record["pair"]["chosen"][0]["content"].endswith("}]")
        assert record["candidates"][0] is closed[0]  # strict JSON, same triplet: ranked first
    else:
        assert all(c["components"]["structure"] < 1.0 for c in record["candidates"]), origins


def test_dpo_export_scores_a_sample_that_ended_at_its_stop_as_the_whole_list_it_is(scripted_traces, tmp_path):
    from ermedrag.training.export import DPOExportConfig, _dpo_record
    from ermedrag.training.rewards.extraction import extractor_reward

    store = TraceStore(scripted_traces)
    event = {**next(iter(store.events(agent="extractor"))), "completion": "I cannot extract anything."}
    config = DPOExportConfig(
        traces=scripted_traces, out=str(tmp_path), samples=2, usefulness=False, close_cut_lists=True
    )
    record = _dpo_record(
        event, store.run(event["run_id"]) or {}, CutShortSampler(finished=True), config, extractor_reward
    )
    best = record["candidates"][0]
    assert best["completion"] == CutShortSampler.LIST + "]" and best["components"]["structure"] == 1.0
    assert [c["origin"] for c in record["candidates"]] == ["recorded or sampled"] * 2  # nothing to close


def test_pairs_are_reselected_from_an_exports_scored_candidates(scripted_traces, tmp_path):
    import json

    from ermedrag.training.export import CLOSED, reselect_pairs

    events = list(TraceStore(scripted_traces).events(agent="extractor"))[:2]
    scores = [
        [(0.9, CLOSED), (0.6, "recorded or sampled"), (0.2, "recorded or sampled")],
        [(0.55, CLOSED), (0.5, "recorded or sampled")],
    ]
    export = tmp_path / "export"
    export.mkdir()
    with open(export / "log.jsonl", "w") as log:
        for event, candidates in zip(events, scores):
            scored = [{"completion": f"c{r}", "reward": r, "components": {}, "origin": o} for r, o in candidates]
            log.write(json.dumps({"event_id": event["event_id"], "pair": None, "candidates": scored}) + "\n")
    assert reselect_pairs(scripted_traces, export, tmp_path / "all", margin=0.1) == {"rows": 1}
    assert reselect_pairs(scripted_traces, export, tmp_path / "open", margin=0.1, closed=False) == {"rows": 1}
    assert reselect_pairs(scripted_traces, export, tmp_path / "wide", margin=0.5) == {"rows": 1}
    chosen = {
        name: [json.loads(line)["chosen"][0]["content"] for line in (tmp_path / name / "data.jsonl").open()]
        for name in ("all", "open", "wide")
    }
    assert chosen == {"all": ["c0.9"], "open": ["c0.6"], "wide": ["c0.9"]}
    assert reselect_pairs(scripted_traces, export, tmp_path / "none", margin=0.8) == {"rows": 0}


def test_killed_dpo_export_resumes_without_loss_or_duplicates(scripted_traces, tmp_path):
    n_events = len(list(TraceStore(scripted_traces).events(agent="extractor")))
    command = [
        sys.executable,
        "-m",
        "ermedrag",
        "export",
        "dpo",
        "--traces",
        scripted_traces,
        "--out",
        str(tmp_path),
        "--model",
        f"{SCRIPTED}?delay=0.3",
        "--samples",
        "2",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(read_records(tmp_path / "log.jsonl"))) < 3:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list(read_records(tmp_path / "log.jsonl")))
    assert 3 <= done_before < n_events, "the kill should land mid-export"
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    ids = [r["event_id"] for r in read_records(tmp_path / "log.jsonl")]
    assert len(ids) == len(set(ids)) == n_events


def test_one_chat_mapping_for_langchain_messages_and_recorded_prompts():
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from ermedrag.agents.base import to_chat, to_langchain

    messages = [SystemMessage(content="s"), HumanMessage(content="u"), AIMessage(content="a")]
    recorded = [{"role": "system", "content": "s"}, {"role": "human", "content": "u"}, {"role": "ai", "content": "a"}]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert to_chat(messages) == to_chat(recorded) == to_chat(chat) == chat
    assert to_chat([{"role": "tool", "content": "t"}]) == [{"role": "user", "content": "t"}]
    assert to_langchain(recorded) == to_langchain(chat) == messages
