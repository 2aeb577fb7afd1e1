"""The ER-MedRAG graph wired with the scripted model: fan-out, concurrency, traces, bad input."""

from __future__ import annotations

import asyncio
import pytest

from ermedrag.graphs.er_medrag import graph
from tests.conftest import SCRIPTED
from ermedrag.tools.records.traces import TraceStore

QUESTION = {
    "question": "Which drug is first-line for type 2 diabetes with normal kidney function?",
    "options": {"A": "Insulin glargine", "B": "Metformin", "C": "Glipizide"},
    "gold": "B",
}


def test_runs_end_to_end_and_records_every_call(scripted_context):
    state = graph.invoke(QUESTION, context=scripted_context)

    assert len(state["snippets"]) == 4
    assert {e["snippet_id"] for e in state["extractions"]} == {s["id"] for s in state["snippets"]}
    assert all(e["ok"] and e["triplets"] for e in state["extractions"])
    assert state["answer"] == {
        "answer": "A",
        "reasoning": "Scripted reasoning.",
        "ok": True,
        "well_formed": True,
        "error": None,
        "citations": [],
        "option_probs": None,
        "confidence": None,
        "confidence_source": state["answer"]["confidence_source"],
    }
    assert state["answer"]["confidence_source"].startswith("none: this backend cannot score")
    assert set(state["timings"]) == {"retrieve_s", "extract_s", "respond_s"}

    store = TraceStore(scripted_context["trace_db"])
    run = store.run(state["run_id"])
    assert run["gold"] == "B" and run["answer"]["answer"] == "A" and run["finished_at"]
    events = list(store.events(run_id=state["run_id"]))
    assert [e["agent"] for e in events].count("extractor") == 4
    assert events[-1]["agent"] == "respondent" and events[-1]["seq"] == 4
    respondent = events[-1]
    assert respondent["gold"] == "B" and respondent["model"] == SCRIPTED
    assert respondent["parsed"]["answer"] == "A"
    # The respondent saw every triplet, with the snippet it came from.
    for extraction in state["extractions"]:
        assert f"[{extraction['snippet_id']}]" in respondent["messages"][-1]["content"]


def test_loading_is_timed_apart_from_the_stages(scripted_context, monkeypatch):
    """What a run loads (its models, the index and its encoder) happens before its stages, in parallel, and is
    timed apart (`setup`), in the state and in the trace: a stage's time is its own work."""
    import time

    from ermedrag.graphs import steps

    loaded = []

    def slow_index(ctx):  # a first open that takes time, as loading an index and its encoder does
        if not loaded:
            time.sleep(0.5)
            loaded.append(True)
        return real_index(ctx)

    real_index = steps.index_for
    monkeypatch.setattr(steps, "index_for", slow_index)
    state = graph.invoke(QUESTION, context=scripted_context)
    setup = state["setup"]
    assert set(setup) == {f"model {SCRIPTED}_s", "index_s", "setup_s"} and setup["index_s"] >= 0.5
    assert setup["setup_s"] >= setup["index_s"] and state["timings"]["retrieve_s"] < setup["index_s"]
    assert TraceStore(scripted_context["trace_db"]).run(state["run_id"])["setup"] == setup


def test_extractor_calls_run_concurrently(scripted_context):
    delay = 1.0
    graph.invoke(QUESTION, context={**scripted_context, "snippets_k": 1})  # warm caches (encoder, index)
    slow = f"{SCRIPTED}?delay={delay}"
    state = graph.invoke(QUESTION, context={**scripted_context, "snippets_k": 6, "extractor_model": slow})
    elapsed = state["timings"]["extract_s"]
    assert len(state["extractions"]) == 6
    # Six extractor calls of 1 s each, run concurrently: about one delay, far from six.
    assert delay <= elapsed < 3 * delay, elapsed


def test_async_invoke_gives_the_same_answer(scripted_context):
    state = asyncio.run(graph.ainvoke(QUESTION, context=scripted_context))
    assert state["answer"]["answer"] == "A" and len(state["extractions"]) == 4


def test_free_text_question_without_options(scripted_context):
    state = graph.invoke({"question": "What treats anaphylaxis?"}, context=scripted_context)
    assert state["answer"]["ok"] and state["answer"]["answer"] == "unknown"


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"question": ""}, "'question' must be a non-empty string"),
        ({"question": "   "}, "'question' must be a non-empty string"),
        ({"question": 42}, "'question' must be a non-empty string"),
        ({"question": "q?", "options": ["yes", "no"]}, "'options' must be a mapping"),
        ({"question": "q?", "options": {"A": None}}, "keys must be non-empty strings"),
    ],
)
def test_bad_input_is_refused_before_anything_is_recorded(scripted_context, inputs, message):
    with pytest.raises(ValueError, match=message):
        graph.invoke(inputs, context=scripted_context)
    assert TraceStore(scripted_context["trace_db"]).runs() == []


def test_unknown_model_provider_is_a_clear_error(scripted_context):
    with pytest.raises(ValueError, match="unknown model provider 'nope'"):
        graph.invoke(QUESTION, context={**scripted_context, "extractor_model": "nope:model"})


def test_baselines_share_the_harness(scripted_context):
    from ermedrag.graphs.baselines import cot, vanilla_rag

    cot_state = cot.invoke(QUESTION, context=scripted_context)
    rag_state = vanilla_rag.invoke(QUESTION, context=scripted_context)
    assert cot_state["answer"]["answer"] == rag_state["answer"]["answer"] == "A"
    assert "snippets" not in cot_state and len(rag_state["snippets"]) == 4
    store = TraceStore(scripted_context["trace_db"])
    assert {r["graph"] for r in store.runs()} == {"cot", "vanilla_rag"}
    rag_prompt = list(store.events(run_id=rag_state["run_id"]))[0]["messages"][-1]["content"]
    assert all(f"[{s['id']}]" in rag_prompt for s in rag_state["snippets"])
    cot_prompt = list(store.events(run_id=cot_state["run_id"]))[0]["messages"][-1]["content"]
    assert "answer from your own knowledge" in cot_prompt
