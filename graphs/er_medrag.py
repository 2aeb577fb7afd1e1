"""ER-MedRAG: retrieve → extract ×k (one call per snippet, concurrent) → respond.

graph.invoke({"question": "...", "options": {"A": "...", "B": "..."}})
graph.invoke(inputs, context={"respondent_model": "openai:Qwen/Qwen3-8B", "base_url": "http://127.0.0.1:8000/v1"})
"""

from __future__ import annotations

import operator
import time
from typing import Annotated, Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send
from typing_extensions import TypedDict

from ermedrag.agents import extractor, respondent
from ermedrag.agents.citations import triplet_items
from ermedrag.graphs.context import Context
from ermedrag.graphs.steps import begin_run, record_call, respond_with, retrieve_evidence
from ermedrag.graphs.state import InputState, RunState, per_question

GRAPH_NAME = "er_medrag"


class State(RunState, total=False):
    snippets: list[dict[str, Any]]
    extractions: Annotated[list[extractor.Extraction], per_question(operator.add)]
    answer: respondent.Answer
    stage_started_at: float


class ExtractTask(TypedDict):
    run_id: str
    question: str
    snippet: dict[str, Any]
    gold: str | None


def retrieve(state: State, runtime: Runtime[Context]) -> dict[str, Any]:
    update = begin_run(state, runtime.context, GRAPH_NAME, fresh=("timings", "extractions"))
    evidence = retrieve_evidence(runtime.context, update["question"], run_id=update["run_id"], node="retrieve")
    return update | evidence | {"stage_started_at": time.time()}


def fan_out(state: State) -> list[Send] | str:
    if not state.get("snippets"):
        return "respond"
    return [
        Send(
            "extract",
            ExtractTask(run_id=state["run_id"], question=state["question"], snippet=s, gold=state.get("gold")),
        )
        for s in state["snippets"]
    ]


def extract(task: ExtractTask, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    snippet = task["snippet"]
    parsed, _ = record_call(
        ctx,
        ctx.extractor_model,
        ctx.extractor_max_new_tokens,
        extractor.build_messages(task["question"], snippet["text"]),
        lambda completion: extractor.parse_triplets(completion, snippet["id"]),
        agent="extractor",
        node="extract",
        run_id=task["run_id"],
        gold=task.get("gold"),
        stop=extractor.STOP,
        inputs={"question": task["question"], "snippet_id": snippet["id"], "snippet": snippet["text"]},
    )
    return {"extractions": [parsed]}


def respond(state: State, runtime: Runtime[Context]) -> dict[str, Any]:
    extract_s = time.time() - state["stage_started_at"]
    by_snippet = {e["snippet_id"]: e for e in state.get("extractions", [])}
    # Keep retrieval order (the fan-out finishes in any order).
    triplets = [t for s in state.get("snippets", []) for t in by_snippet.get(s["id"], {}).get("triplets", [])]
    shown = triplet_items(triplets, state.get("snippets", []))
    update = respond_with(state, runtime.context, extractor.render_triplets(triplets), shown)
    return update | {"timings": update["timings"] | {"extract_s": extract_s}}


builder = StateGraph(State, context_schema=Context, input_schema=InputState)
builder.add_node(retrieve)
builder.add_node(extract)
builder.add_node(respond)
builder.add_edge(START, "retrieve")
builder.add_conditional_edges("retrieve", fan_out, ["extract", "respond"])
builder.add_edge("extract", "respond")
builder.add_edge("respond", END)
graph = builder.compile(name="ER-MedRAG")
