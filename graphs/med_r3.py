"""Med-R³: the model reasons, searches mid-reasoning, and answers.

    reason ──(closed a <search>, budget left)──► search ──► reason ──► … ──► finish
       │ └─(step cut by its token limit, budget left)──► reason
       └──(no answer and no way on: budget spent, model stopped, bad search)──► force_answer ──► finish

`reason` generates until the model closes a search query or answers; `search` runs the same retrieval as
ER-MedRAG and appends the results inside <document> tags; `force_answer` appends the system's `<answer>` and
lets the model write only the answer (as Med-R³'s and Search-R1's inference do), so a question always ends
with the model's answer. The loop rule is `agents.reasoner.after_step`, shared with the training rollout;
the transcript is typed segments (`agents.reasoner.Segment`) and the answer is read only from the model's own
segments, never from a retrieved document.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from typing_extensions import TypedDict

from ermedrag.agents import reasoner
from ermedrag.agents.citations import EvidenceItem, cite, snippet_items
from ermedrag.agents.respondent import Answer
from ermedrag.graphs.context import Context
from ermedrag.graphs.steps import (
    begin_run,
    extract_if_unparsed,
    record_call,
    retrieve_recorded,
    trace_store,
    with_confidence,
)
from ermedrag.graphs.state import InputState, RunState, per_question
from ermedrag.tools.settings import context_field
from ermedrag.tools.retrieval.search import coarse_k_for

GRAPH_NAME = "med_r3"


@dataclass(kw_only=True)
class MedR3Context(Context):
    reasoner_model: str = context_field("ERMEDRAG_REASONER_MODEL")
    max_searches: int = context_field("ERMEDRAG_MAX_SEARCHES")
    search_k: int = context_field("ERMEDRAG_SEARCH_K")
    step_max_new_tokens: int = context_field("ERMEDRAG_STEP_MAX_NEW_TOKENS")
    max_total_tokens: int = context_field("ERMEDRAG_MAX_TOTAL_TOKENS")


class Search(TypedDict):
    query: str
    snippet_ids: list[str]


class State(RunState, total=False):
    transcript: str  # the segments' text, as the model reads it (for Studio and the trace)
    segments: Annotated[list[reasoner.Segment], per_question(operator.add)]
    searches: Annotated[list[Search], per_question(operator.add)]
    documents: Annotated[list[EvidenceItem], per_question(operator.add)]  # every document shown, numbered on
    pending_query: str | None
    next_action: reasoner.LoopAction
    forced_answer: reasoner.ForceReason | None  # why the system had to ask for the answer (None: the model gave it)
    generated_tokens: int
    forged_document: bool
    answer: Answer


def _model_spec(ctx: MedR3Context) -> str:
    return ctx.reasoner_model or ctx.respondent_model


def start(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    fresh = ("timings", "segments", "searches", "documents")
    return begin_run(state, runtime.context, GRAPH_NAME, fresh) | {
        "transcript": "",
        "generated_tokens": 0,
        "forged_document": False,
        "forced_answer": None,
    }


def _generate(
    state: State, ctx: MedR3Context, budget: int, stop: list[str], node: str
) -> tuple[reasoner.Step, str, int]:
    """One recorded call continuing the transcript: the parsed step, the completion and its token count."""
    transcript = state["transcript"]
    step, event = record_call(
        ctx,
        _model_spec(ctx),
        budget,
        reasoner.build_messages(state["question"], state.get("options"), transcript),
        reasoner.parse_step,
        agent="reasoner",
        node=node,
        run_id=state["run_id"],
        gold=state.get("gold"),
        stop=stop,
        inputs={"question": state["question"], "options": state.get("options"), "transcript": transcript},
    )
    return step, event.completion, (event.usage or {}).get("output_tokens", 0)


def _timed(state: State, key: str, started: float) -> dict[str, float]:
    return {key: state.get("timings", {}).get(key, 0.0) + time.perf_counter() - started}


def reason(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    ctx = runtime.context
    budget = max(0, min(ctx.step_max_new_tokens, ctx.max_total_tokens - state["generated_tokens"]))
    started = time.perf_counter()
    step, completion, tokens = _generate(state, ctx, budget, reasoner.STOP, "reason")
    generated = state["generated_tokens"] + tokens
    action, why = reasoner.after_step(
        step,
        hit_step_limit=budget > 0 and tokens >= budget,
        searches_done=len(state.get("searches", [])),
        generated_tokens=generated,
        max_searches=ctx.max_searches,
        max_total_tokens=ctx.max_total_tokens,
    )
    return {
        "transcript": state["transcript"] + completion,
        "segments": [reasoner.Segment(kind="model", text=completion)],
        "pending_query": step["query"] if action == "search" else None,
        "next_action": action,
        "forced_answer": why,
        "generated_tokens": generated,
        "forged_document": state["forged_document"] or step["forged_document"],
        "timings": _timed(state, "reason_s", started),
    }


def after_reason(state: State) -> Literal["search", "reason", "force_answer", "finish"]:
    return {"search": "search", "continue": "reason", "force_answer": "force_answer"}.get(
        state["next_action"], "finish"
    )


def search(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    ctx = runtime.context
    query = state["pending_query"]
    # The retrieval of `tools.retrieval.search` (what the training rollout runs), recorded in the trace.
    snippets, seconds = retrieve_recorded(
        ctx,
        query,
        run_id=state["run_id"],
        node="search",
        k=ctx.search_k,
        coarse_k=coarse_k_for(ctx.search_k, ctx.coarse_k),
    )
    first = len(state.get("documents", [])) + 1
    documents = reasoner.render_documents(snippets, first)
    return {
        "transcript": state["transcript"] + documents,
        "segments": [reasoner.Segment(kind="document", text=documents)],
        "searches": [Search(query=query, snippet_ids=[s["id"] for s in snippets])],
        "documents": snippet_items(snippets, first, kind="document"),
        "pending_query": None,
        "timings": {"search_s": state.get("timings", {}).get("search_s", 0.0) + seconds},
    }


def force_answer(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    """Append the system's `<answer>` and let the model write the answer (a small budget of its own)."""
    prompt = reasoner.force_answer_prompt(reasoner.model_text(state.get("segments", [])))
    prompted = {**state, "transcript": state["transcript"] + prompt}
    started = time.perf_counter()
    _, completion, tokens = _generate(
        prompted, runtime.context, reasoner.ANSWER_MAX_NEW_TOKENS, [reasoner.ANSWER_STOP], "force_answer"
    )
    return {
        "transcript": prompted["transcript"] + completion,
        "segments": [reasoner.Segment(kind="prompt", text=prompt), reasoner.Segment(kind="model", text=completion)],
        "generated_tokens": state["generated_tokens"] + tokens,
        "timings": _timed(state, "reason_s", started),
    }


def finish(state: State, runtime: Runtime[MedR3Context]) -> dict[str, Any]:
    ctx = runtime.context
    segments = state.get("segments", [])
    answer = reasoner.parse_final(segments, state.get("options"))
    if state.get("forced_answer") or state.get("forged_document"):
        answer = {**answer, "well_formed": False}  # the answer stands, the format was not the model's own
    answer = extract_if_unparsed(state, ctx, _model_spec(ctx), answer, reasoner.model_text(segments))
    answer = with_confidence(
        state,
        ctx,
        _model_spec(ctx),
        reasoner.build_messages(state["question"], state.get("options"), ""),
        state["transcript"],
        answer,
    )
    answer = {**answer, "citations": cite(answer["reasoning"], state.get("documents", []))}
    trace_store(ctx).finish_run(
        state["run_id"],
        dict(answer)
        | {
            "searches": state.get("searches", []),
            "transcript": state["transcript"],
            "forced_answer": state.get("forced_answer"),
            "forged_document": state.get("forged_document", False),
        },
    )
    return {"answer": answer}


builder = StateGraph(State, context_schema=MedR3Context, input_schema=InputState)
builder.add_node(start)
builder.add_node(reason)
builder.add_node(search)
builder.add_node(force_answer)
builder.add_node(finish)
builder.add_edge(START, "start")
builder.add_edge("start", "reason")
builder.add_conditional_edges("reason", after_reason)
builder.add_edge("search", "reason")
builder.add_edge("force_answer", "finish")
builder.add_edge("finish", END)
graph = builder.compile(name="Med-R3")
