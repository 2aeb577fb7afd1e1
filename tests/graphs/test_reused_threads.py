"""A thread that answered one question and is asked another (Studio, a reused `thread_id`): the second question
gets its own run, and none of the first one's documents, segments or opinions."""

from __future__ import annotations

import dataclasses

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from ermedrag.graphs.registry import load_graph
from ermedrag.tools.records.traces import TraceStore
from tests.conftest import SCRIPTED

FIRST = {
    "question": "Which drug is first-line for type 2 diabetes? #answers=A,A,A",
    "options": {"A": "Metformin", "B": "Insulin"},
}
SECOND = {
    "question": "Which vitamin deficiency causes rickets? #answers=B,B,B",
    "options": {"A": "Vitamin C", "B": "Vitamin D"},
}


@pytest.mark.parametrize("system", ["er_medrag", "med_r3", "mmedagent"])
def test_a_second_question_on_a_thread_starts_clean(system, tmp_path):
    graph = load_graph(system).builder.compile(checkpointer=InMemorySaver())
    model = "scripted:ermedrag.testing.scripted.panel" if system == "mmedagent" else SCRIPTED
    context = {"respondent_model": model, "extractor_model": SCRIPTED, "trace_db": str(tmp_path / "t.sqlite")}
    known = {f.name for f in dataclasses.fields(load_graph(system).context_schema)} & set(context)
    config = {"configurable": {"thread_id": "reused"}}
    first = graph.invoke(FIRST, config=config, context={k: context[k] for k in known})
    second = graph.invoke(SECOND, config=config, context={k: context[k] for k in known})
    assert second["run_id"] != first["run_id"]
    store = TraceStore(str(tmp_path / "t.sqlite"))
    assert store.run(first["run_id"])["question"]["question"] == FIRST["question"]
    assert store.run(second["run_id"])["question"]["question"] == SECOND["question"]
    for channel in ("extractions", "segments", "searches", "opinions", "attending_answers"):
        if channel in first:
            assert len(second[channel]) == len(first[channel]), channel  # emptied, then filled once
    if system == "med_r3":
        assert "rickets" in "".join(s["text"] for s in second["segments"]).lower() or second["searches"]
        assert all("diabetes" not in s["text"].lower() for s in second["segments"] if s["kind"] == "model")
    if system == "mmedagent":
        assert second["answer"]["answer"] == "B" and [o["answer"] for o in second["opinions"]] == ["B"] * 3
