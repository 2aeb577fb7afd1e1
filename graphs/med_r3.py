"""Med-R³: the model reasons, searches mid-reasoning, and answers.

    reason ──(closed a <search>, budget left)──► search ──► reason ──► … ──► finish

`reason` generates until the model closes a search query or answers; `search` runs the same retrieval as
ER-MedRAG and appends the results inside <document> tags; the loop is bounded by the search budget and
the total generated tokens.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from typing_extensions import TypedDict

from ermedrag.agents import reasoner
from ermedrag.tools.agent_calls import call_agent
from ermedrag.agents.respondent import Answer
from ermedrag.graphs.common import Context, begin_run, chat_model, env_int, retrieve_recorded, sampling, trace_store
from ermedrag.graphs.er_medrag import InputState
from ermedrag.tools.retrieval import SEARCH_K, search_coarse_k

GRAPH_NAME = "med_r3"


@dataclass(kw_only=True)
class MedR3Context(Context):
    reasoner_model: str = field(default="")
    """Reasoning model; empty = respondent_model."""
    max_searches: int = env_int("ERMEDRAG_MAX_SEARCHES", reasoner.MAX_SEARCHES)
    """Searches allowed per question (Med-R³ uses 4)."""
    search_k: int = env_int("ERMEDRAG_SEARCH_K", SEARCH_K)
    """Snippets returned per search (Med-R³ uses the top 5). Env ERMEDRAG_SEARCH_K."""
    step_max_new_tokens: int = env_int("ERMEDRAG_STEP_MAX_NEW_TOKENS", reasoner.STEP_MAX_NEW_TOKENS)
    """Generation budget of one reasoning step (until a search closes or the answer ends)."""
    max_total_tokens: int = env_int("ERMEDRAG_MAX_TOTAL_TOKENS", reasoner.MAX_TOTAL_TOKENS)
    """Generated tokens allowed over all steps; then the model must answer with what it has."""


class Search(TypedDict):
    query: str
    snippet_ids: list[str]


class State(InputState, total=False):
    transcript: str
    segments: Annotated[list[dict[str, Any]], operator.add]  # {"kind": "model"|"document", "text": ...}
    searches: Annotated[list[Search], operator.add]
    pending_query: str | None
    generated_tokens: int
    forged_document: bool
    answer: Answer
    timings: Annotated[dict[str, float], operator.or_]


def _model_spec(ctx: MedR3Context) -> str:
    return ctx.reasoner_model or ctx.respondent_model


def start(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    return begin_run(state, runtime.context, GRAPH_NAME) | {"transcript": "", "generated_tokens": 0,
                                                             "forged_document": False}


def reason(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    ctx = runtime.context
    budget = min(ctx.step_max_new_tokens, ctx.max_total_tokens - state["generated_tokens"])
    transcript = state["transcript"]
    started = time.perf_counter()
    step, event = call_agent(
        chat_model(ctx, _model_spec(ctx), budget),
        reasoner.build_messages(state["question"], state.get("options"), transcript),
        reasoner.parse_step,
        agent="reasoner", node="reason", run_id=state["run_id"], gold=state.get("gold"),
        sampling=sampling(ctx, _model_spec(ctx), budget), stop=reasoner.STOP,
        inputs={"question": state["question"], "options": state.get("options"), "transcript": transcript},
    )
    trace_store(ctx).add_event(event)
    tokens = (event.usage or {}).get("output_tokens", 0)
    return {
        "transcript": transcript + event.completion,
        "segments": [{"kind": "model", "text": event.completion}],
        "pending_query": step["query"],
        "generated_tokens": state["generated_tokens"] + tokens,
        "forged_document": state["forged_document"] or step["forged_document"],
        "timings": {"reason_s": state.get("timings", {}).get("reason_s", 0.0) + time.perf_counter() - started},
    }


def after_reason(state: State, runtime: Runtime[MedR3Context]) -> Literal["search", "finish"]:
    ctx = runtime.context
    action = reasoner.after_step(state.get("pending_query"), searches_done=len(state.get("searches", [])),
                                 generated_tokens=state["generated_tokens"], max_searches=ctx.max_searches,
                                 max_total_tokens=ctx.max_total_tokens)
    return "search" if action == "search" else "finish"


def search(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    ctx = runtime.context
    query = state["pending_query"]
    # The retrieval of `tools.retrieval.search` (what the training rollout runs), recorded in the trace.
    snippets, seconds = retrieve_recorded(ctx, query, run_id=state["run_id"], node="search", k=ctx.search_k,
                                          coarse_k=search_coarse_k(ctx.search_k, ctx.coarse_k))
    documents = reasoner.render_documents(snippets)
    return {
        "transcript": state["transcript"] + documents,
        "segments": [{"kind": "document", "text": documents}],
        "searches": [Search(query=query, snippet_ids=[s["id"] for s in snippets])],
        "pending_query": None,
        "timings": {"search_s": state.get("timings", {}).get("search_s", 0.0) + seconds},
    }


def finish(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    answer = reasoner.parse_final(state["transcript"], state.get("options"))
    if state.get("forged_document"):
        answer = {**answer, "well_formed": False, "error": answer["error"] or "model wrote its own <document>"}
    trace_store(runtime.context).finish_run(
        state["run_id"], dict(answer) | {"searches": state.get("searches", []), "transcript": state["transcript"]})
    return {"answer": answer}


builder = StateGraph(State, context_schema=MedR3Context, input_schema=InputState)
builder.add_node(start)
builder.add_node(reason)
builder.add_node(search)
builder.add_node(finish)
builder.add_edge(START, "start")
builder.add_edge("start", "reason")
builder.add_conditional_edges("reason", after_reason)
builder.add_edge("search", "reason")
builder.add_edge("finish", END)
graph = builder.compile(name="Med-R3")
