"""The graphs, by name: the one list that the CLI, the eval runner and `langgraph.json` (checked by a test) share.

Adding a graph = its module + one line in `GRAPHS` + one line in `langgraph.json`.

Each entry names the context fields that change the graph's answers (`settings`): an evaluation keys its
results by exactly those, so two runs of a graph compare only when everything it uses is equal, and a setting
a graph ignores (ER-MedRAG's snippet count for CoT) never splits its results.

What the code fixes rather than the context (the agents' prompts, examples and fixed budgets) is keyed by a
prompt version per agent (`PROMPT_VERSIONS`); a graph's `prompt_version` names the versions of the agents it
calls. Change what an agent's prompts say and bump its number here: every graph that calls it then answers its
questions again instead of mixing old and new answers in one result (tests/evals/test_eval_runner.py pins each
agent's rendered prompts to its version, so a forgotten bump fails a test).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # importing the registry stays cheap: a graph's module loads when it is asked for
    from langgraph.graph.state import CompiledStateGraph

# `answer_scores`: whether the answer's option probabilities (confidence, answer sets) are asked for and recorded.
RESPONDENT = ("respondent_model", "temperature", "respondent_max_new_tokens", "answer_extraction", "answer_scores")
RETRIEVAL = ("index_dir", "snippets_k", "coarse_k", "reranker")
EXTRACTOR = ("extractor_model", "extractor_max_new_tokens")
SEARCH_LOOP = ("reasoner_model", "max_searches", "search_k", "step_max_new_tokens", "max_total_tokens")
PANEL = (
    "specialties",
    "triage_mode",
    "default_specialty",
    "n_specialists",
    "attending_samples",
    "triage_model",
    "specialist_model",
    "attending_model",
    "specialist_retrieval",
    "triage_max_new_tokens",
    "specialist_max_new_tokens",
    "attending_max_new_tokens",
)
# The version of each agent's prompts (`ermedrag.agents.<name>`): bump one and the results of every graph calling
# that agent split from the old ones.
PROMPT_VERSIONS: dict[str, int] = {"respondent": 2, "extractor": 1, "reasoner": 2, "mmedagent": 3}


@dataclass(frozen=True)
class GraphSpec:
    """Where a graph lives (`module:attribute` under `ermedrag.graphs`), what it does, and what it uses."""

    target: str
    summary: str
    settings: tuple[str, ...]
    agents: tuple[str, ...]  # the agents whose prompts it sends (keys of PROMPT_VERSIONS)

    @property
    def module(self) -> str:
        return f"ermedrag.graphs.{self.target.partition(':')[0]}"

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2]

    @property
    def prompt_version(self) -> str:
        """The prompt versions of its agents, e.g. 'extractor@1,respondent@1': part of every result's key."""
        return ",".join(f"{agent}@{PROMPT_VERSIONS[agent]}" for agent in sorted(self.agents))


GRAPHS: dict[str, GraphSpec] = {
    "er_medrag": GraphSpec(
        "er_medrag:graph",
        "retrieve → extract triplets per snippet → respond",
        RESPONDENT + RETRIEVAL + EXTRACTOR,
        ("extractor", "respondent"),
    ),
    "vanilla_rag": GraphSpec(
        "baselines:vanilla_rag", "retrieve → respond from the raw snippets", RESPONDENT + RETRIEVAL, ("respondent",)
    ),
    "cot": GraphSpec("baselines:cot", "respond from the model's own knowledge", RESPONDENT, ("respondent",)),
    # The respondent's answer-extraction prompt reads the reasoner's text when its answer names no option.
    "med_r3": GraphSpec(
        "med_r3:graph",
        "reason, searching mid-reasoning in a bounded loop, then answer",
        ("respondent_model", "temperature", "answer_extraction", "answer_scores", "index_dir", "coarse_k", "reranker")
        + SEARCH_LOOP,
        ("reasoner", "respondent"),
    ),
    # Specialists use the respondent's template, example and answer extraction; triage and attending their own.
    "mmedagent": GraphSpec(
        "mmedagent.graph:graph",
        "triage picks a specialty → N specialists answer → an attending decides",
        ("respondent_model", "temperature", "answer_extraction", "answer_scores") + RETRIEVAL + PANEL,
        ("mmedagent", "respondent"),
    ),
}


def graph_spec(name: str) -> GraphSpec:
    if name not in GRAPHS:
        raise ValueError(f"unknown graph {name!r}; choose from {', '.join(GRAPHS)}")
    return GRAPHS[name]


def load_graph(name: str) -> CompiledStateGraph:
    """The compiled graph registered as `name` (its module is imported on first use)."""
    spec = graph_spec(name)
    return getattr(importlib.import_module(spec.module), spec.attribute)


def context_fields(name: str) -> set[str]:
    """The fields of the graph's context schema (what `graph.invoke(..., context=...)` accepts)."""
    return {f.name for f in dataclasses.fields(load_graph(name).context_schema)}


def resolved_settings(name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The graph's settings with `overrides` applied and every other field at its default (environment
    fallbacks included): what its answers depend on. Overrides of fields the graph does not have are ignored."""
    schema = load_graph(name).context_schema
    known = context_fields(name)
    context = schema(**{key: value for key, value in overrides.items() if key in known})
    return {setting: getattr(context, setting) for setting in graph_spec(name).settings}
