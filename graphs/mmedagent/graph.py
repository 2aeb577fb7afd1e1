"""MMedAgent-RL: a triage doctor picks a specialty, N specialists answer, an attending physician decides.

    intake ─► [retrieve] ─► triage ─► specialist ×N ─► collect ─► attending ×M ─► finish

`triage` asks the triage model for one specialty of the list (or takes the case's gold specialty, or a fixed
one: `triage_mode`); each `specialist` is one recorded call with the same prompt (independent opinions: they
differ only by sampling); `collect` computes the specialists' agreement with the gold answer, the curriculum
bucket and their majority; `attending` reads the opinions (defused) and answers, M times when
`attending_samples` > 1 (then a majority vote); `finish` closes the run. With `specialist_retrieval` the
question's evidence is retrieved once (ER-MedRAG's retrieval, recorded) and every specialist reads it.

    graph.invoke({"question": "...", "options": {"A": "...", "B": "..."}, "gold": "B"},
                 context={"respondent_model": "openai:Qwen/Qwen3-8B", "n_specialists": 3})

Images: the input's `images` (file paths, http(s) URLs or data URIs; at most 8) are checked in `intake` and go,
as references, to every role: the triage doctor, each specialist and the attending see them with the case. Every
role's model must be able to see (`tools.chat_models.require_image_support`): one that cannot (a text-only hf
model, offline:gemma3-270m, a scripted model without `?vision=1`, openai: with ERMEDRAG_OPENAI_VISION=0) refuses
the question in `intake`, naming the role's context field, before a run is opened or any weights load. A data URI
is written once to the image cache (`tools.images.cache_data_uris`: <ERMEDRAG_HOME>/images/<sha256>.<ext>) and the
state, every fan-out task and every checkpoint carry its path, never the base64. File paths are read only inside
the allowed image folders (env ERMEDRAG_IMAGE_ROOTS: `tools.images.image_roots`). Traces keep the images as
references with their sha256 (a data URI as `data:<mime>;sha256=<hash>`), never the pixels.
"""

from __future__ import annotations

from langgraph.graph import END, START, StateGraph

from ermedrag.graphs.mmedagent.context import MMedAgentContext
from ermedrag.graphs.mmedagent.state import MMedAgentInput, State
from ermedrag.graphs.mmedagent.steps import (
    after_intake,
    attending,
    collect,
    consult_attending,
    consult_specialists,
    finish,
    intake,
    retrieve,
    specialist,
    triage,
)

builder = StateGraph(State, context_schema=MMedAgentContext, input_schema=MMedAgentInput)
builder.add_node(intake)
builder.add_node(retrieve)
builder.add_node(triage)
builder.add_node(specialist)
builder.add_node(collect)
builder.add_node(attending)
builder.add_node(finish)
builder.add_edge(START, "intake")
builder.add_conditional_edges("intake", after_intake, ["retrieve", "triage"])
builder.add_edge("retrieve", "triage")
builder.add_conditional_edges("triage", consult_specialists, ["specialist"])
builder.add_edge("specialist", "collect")
builder.add_conditional_edges("collect", consult_attending, ["attending"])
builder.add_edge("attending", "finish")
builder.add_edge("finish", END)
graph = builder.compile(name="MMedAgent-RL")
