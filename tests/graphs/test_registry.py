"""The graph registry: one list of graphs, the same in langgraph.json, the CLI and the eval runner."""

from __future__ import annotations

import dataclasses
import json

import pytest
from langgraph.graph.state import CompiledStateGraph

from ermedrag.evals.rows import EvalConfig, parse_overrides
from ermedrag.graphs.registry import GRAPHS, context_fields, load_graph, resolved_settings
from tests.conftest import REPO


def test_langgraph_json_serves_exactly_the_registered_graphs():
    served = json.loads((REPO / "langgraph.json").read_text())["graphs"]
    expected = {name: f"{spec.module}:{spec.attribute}" for name, spec in GRAPHS.items()}
    assert served == expected


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_each_graph_loads_and_its_settings_are_context_fields(name):
    graph = load_graph(name)
    assert isinstance(graph, CompiledStateGraph)
    assert set(GRAPHS[name].settings) <= context_fields(name)
    assert dataclasses.is_dataclass(graph.context_schema)


def test_a_result_key_changes_only_with_what_the_graph_uses():
    base = {"respondent_model": "scripted:ermedrag.testing.scripted", "extractor_model": "scripted:x"}
    cot, cot_more_snippets = (EvalConfig.for_graph("cot", {**base, "snippets_k": k}) for k in (4, 9))
    rag, rag_more_snippets = (EvalConfig.for_graph("er_medrag", {**base, "snippets_k": k}) for k in (4, 9))
    assert cot.key() == cot_more_snippets.key() and "snippets_k" not in cot.settings
    assert rag.key() != rag_more_snippets.key() and rag_more_snippets.settings["snippets_k"] == 9
    searches = EvalConfig.for_graph("med_r3", {**base, "max_searches": 2})
    assert searches.settings["max_searches"] == 2 and "extractor_model" not in searches.settings
    assert cot.model == "scripted:ermedrag.testing.scripted"
    # A field that does not change answers (where the vectors are served) reaches the graph, not the key.
    served = EvalConfig.for_graph("vanilla_rag", {**base, "chroma_url": "http://127.0.0.1:8000"})
    assert served.context(None, "t.db")["chroma_url"] == "http://127.0.0.1:8000"
    assert served.key() == EvalConfig.for_graph("vanilla_rag", base).key()


def test_settings_fall_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("ERMEDRAG_SNIPPETS_K", "7")
    assert resolved_settings("vanilla_rag", {})["snippets_k"] == 7
    assert resolved_settings("vanilla_rag", {"snippets_k": 3, "max_searches": 1})["snippets_k"] == 3


def test_overrides_are_typed_and_unknown_keys_are_named():
    assert parse_overrides(["max_searches=2", "temperature=0.5", "reranker=x/y"], ["med_r3"]) == {
        "max_searches": 2,
        "temperature": 0.5,
        "reranker": "x/y",
    }
    with pytest.raises(ValueError, match="max_searches"):
        parse_overrides(["max_searches=two"], ["med_r3"])
    with pytest.raises(ValueError, match="KEY among"):
        parse_overrides(["max_searches=2"], ["cot"])
    with pytest.raises(ValueError, match="needs --temperature"):
        EvalConfig.for_graph("cot", {"temperature": 0.0}, samples=3)
