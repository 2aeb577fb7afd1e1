"""Baselines in the same harness as ER-MedRAG, recorded the same way.

- `cot`: the respondent alone, no retrieval (chain of thought in <think>).
- `vanilla_rag`: the same retrieval, raw snippets straight to the respondent (MedRAG-style).
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from ermedrag.agents.citations import snippet_items
from ermedrag.agents.respondent import render_snippets
from ermedrag.graphs.context import Context
from ermedrag.graphs.steps import begin_run, respond_with, retrieve_evidence
from ermedrag.graphs.state import InputState
from ermedrag.graphs.er_medrag import State

NO_RETRIEVAL = "(none: answer from your own knowledge)"


def cot_respond(state: State, runtime: Runtime[Context]) -> dict[str, Any]:
    update = begin_run(state, runtime.context, "cot")
    return update | respond_with({**state, **update}, runtime.context, NO_RETRIEVAL)


def rag_retrieve(state: State, runtime: Runtime[Context]) -> dict[str, Any]:
    update = begin_run(state, runtime.context, "vanilla_rag")
    return update | retrieve_evidence(runtime.context, update["question"], run_id=update["run_id"], node="retrieve")


def rag_respond(state: State, runtime: Runtime[Context]) -> dict[str, Any]:
    snippets = state.get("snippets", [])
    return respond_with(state, runtime.context, render_snippets(snippets), snippet_items(snippets))


cot_builder = StateGraph(State, context_schema=Context, input_schema=InputState)
cot_builder.add_node("respond", cot_respond)
cot_builder.add_edge(START, "respond")
cot_builder.add_edge("respond", END)
cot = cot_builder.compile(name="CoT")

rag_builder = StateGraph(State, context_schema=Context, input_schema=InputState)
rag_builder.add_node("retrieve", rag_retrieve)
rag_builder.add_node("respond", rag_respond)
rag_builder.add_edge(START, "retrieve")
rag_builder.add_edge("retrieve", "respond")
rag_builder.add_edge("respond", END)
vanilla_rag = rag_builder.compile(name="Vanilla RAG")
