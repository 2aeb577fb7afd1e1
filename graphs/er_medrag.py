"""ER-MedRAG: retrieve → extract ×k (one call per snippet, concurrent) → respond.

    graph.invoke({"question": "...", "options": {"A": "...", "B": "..."}})
    graph.invoke(inputs, context={"respondent_model": "openai:Qwen/Qwen3-8B", "base_url": "http://127.0.0.1:8000/v1"})
"""

from __future__ import annotations

import operator
import time
import uuid
from typing import Annotated, Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send
from typing_extensions import TypedDict

from agents import extractor, respondent
from agents.base import call_agent
from graphs.common import Context, chat_model, index_for, sampling, trace_store, validate_question
from tools.retrieval import retrieve as retrieve_snippets

GRAPH_NAME = "er_medrag"


class InputState(TypedDict, total=False):
    question: str
    options: dict[str, str] | None
    gold: str | None
    run_id: str


class State(InputState, total=False):
    snippets: list[dict[str, Any]]
    extractions: Annotated[list[extractor.Extraction], operator.add]
    answer: respondent.Answer
    timings: Annotated[dict[str, float], operator.or_]
    stage_started_at: float


class ExtractTask(TypedDict):
    run_id: str
    question: str
    snippet: dict[str, Any]
    gold: str | None


def retrieve(state: State, runtime: Runtime[Context]) -> dict[str, Any]:
    question, options = validate_question(state)
    run_id = state.get("run_id") or uuid.uuid4().hex
    started = time.perf_counter()
    index = index_for(runtime.context)
    snippets = retrieve_snippets(index, question, k=runtime.context.snippets_k, coarse_k=runtime.context.coarse_k)
    trace_store(runtime.context).start_run(
        run_id, GRAPH_NAME, {"question": question, "options": options}, state.get("gold"))
    return {
        "run_id": run_id,
        "options": options,
        "snippets": [s.to_dict() for s in snippets],
        "timings": {"retrieve_s": time.perf_counter() - started},
        "stage_started_at": time.time(),
    }


def fan_out(state: State) -> list[Send] | str:
    if not state.get("snippets"):
        return "respond"
    return [
        Send("extract", ExtractTask(run_id=state["run_id"], question=state["question"], snippet=s,
                                    gold=state.get("gold")))
        for s in state["snippets"]
    ]


def extract(task: ExtractTask, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    snippet = task["snippet"]
    parsed, event = call_agent(
        chat_model(ctx, ctx.extractor_model, ctx.extractor_max_new_tokens),
        extractor.build_messages(task["question"], snippet["text"]),
        lambda completion: extractor.parse_triplets(completion, snippet["id"]),
        agent="extractor", node="extract", run_id=task["run_id"], gold=task.get("gold"),
        sampling=sampling(ctx, ctx.extractor_model, ctx.extractor_max_new_tokens), stop=extractor.STOP,
    )
    trace_store(ctx).add_event(event)
    return {"extractions": [parsed]}


def respond(state: State, runtime: Runtime[Context]) -> dict[str, Any]:
    ctx = runtime.context
    extract_s = time.time() - state["stage_started_at"]
    by_snippet = {e["snippet_id"]: e for e in state.get("extractions", [])}
    # Keep retrieval order (the fan-out finishes in any order).
    triplets = [t for s in state.get("snippets", []) for t in by_snippet.get(s["id"], {}).get("triplets", [])]
    started = time.perf_counter()
    answer, event = call_agent(
        chat_model(ctx, ctx.respondent_model, ctx.respondent_max_new_tokens),
        respondent.build_messages(state["question"], state.get("options"), triplets),
        lambda completion: respondent.parse_answer(completion, state.get("options")),
        agent="respondent", node="respond", run_id=state["run_id"], gold=state.get("gold"),
        sampling=sampling(ctx, ctx.respondent_model, ctx.respondent_max_new_tokens), stop=respondent.STOP,
    )
    store = trace_store(ctx)
    store.add_event(event)
    store.finish_run(state["run_id"], dict(answer))
    return {"answer": answer, "timings": {"extract_s": extract_s, "respond_s": time.perf_counter() - started}}


builder = StateGraph(State, context_schema=Context, input_schema=InputState)
builder.add_node(retrieve)
builder.add_node(extract)
builder.add_node(respond)
builder.add_edge(START, "retrieve")
builder.add_conditional_edges("retrieve", fan_out, ["extract", "respond"])
builder.add_edge("extract", "respond")
builder.add_edge("respond", END)
graph = builder.compile(name="ER-MedRAG")
