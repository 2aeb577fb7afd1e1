"""Every environment variable in one module (`tools.settings`): one rule for reading, the README's table generated
from it, and the same help on every context field Studio shows."""

from __future__ import annotations

import importlib.util
import dataclasses
from pathlib import Path

import pytest

from ermedrag.graphs.registry import GRAPHS, load_graph
from ermedrag.tools import settings
from tests.conftest import REPO
from tests.test_layers import FOLDERS


def test_the_readme_table_is_the_settings_module():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert settings.with_table(readme) == readme, (
        "README.md's settings table differs from tools/settings.py: run `python -m ermedrag.tools.settings README.md`"
    )


def test_every_setting_is_read_somewhere_and_named_once():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    sources = "\n".join(
        path.read_text(encoding="utf-8")
        for folder in FOLDERS
        for path in (REPO / folder).rglob("*.py")
        if path != REPO / "tools" / "settings.py"
    )
    unread = [n for n in names if n not in sources and not any(s.fallback == n for s in settings.SETTINGS)]
    assert not unread, f"settings nothing reads: {unread}"


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_every_context_field_falls_back_to_a_setting_and_studio_shows_its_help(graph):
    schema = load_graph(graph).context_schema
    properties = load_graph(graph).get_context_jsonschema()["properties"]
    for f in dataclasses.fields(schema):
        env = f.metadata.get("env")
        assert env in settings.BY_NAME, f"{graph} context field {f.name} has no environment setting"
        assert properties[f.name]["description"] == settings.description(env)


def test_one_rule_for_every_variable(monkeypatch):
    monkeypatch.setenv("ERMEDRAG_SNIPPETS_K", "  ")
    assert settings.read("ERMEDRAG_SNIPPETS_K") == 4  # blank = the default
    monkeypatch.setenv("ERMEDRAG_SNIPPETS_K", " 7 ")
    assert settings.read("ERMEDRAG_SNIPPETS_K") == 7
    for value, words in (("seven", "expected an integer"), ("-1", "expected a number of at least 0")):
        monkeypatch.setenv("ERMEDRAG_SNIPPETS_K", value)
        with pytest.raises(ValueError, match=f"environment variable ERMEDRAG_SNIPPETS_K='{value}': {words}"):
            settings.read("ERMEDRAG_SNIPPETS_K")
    monkeypatch.setenv("ERMEDRAG_TEMPERATURE", "nan")
    with pytest.raises(ValueError, match="expected a number from 0 to 2"):
        settings.read("ERMEDRAG_TEMPERATURE")
    for value, expected in (("Yes", True), ("off", False), ("", True)):
        monkeypatch.setenv("ERMEDRAG_ANSWER_EXTRACTION", value)
        assert settings.read("ERMEDRAG_ANSWER_EXTRACTION") is expected
    monkeypatch.setenv("ERMEDRAG_DTYPE", "BFloat16")
    assert settings.read("ERMEDRAG_DTYPE") == "bfloat16"
    monkeypatch.setenv("ERMEDRAG_DTYPE", "int8")
    with pytest.raises(ValueError, match="expected one of auto, float32, bfloat16, float16"):
        settings.read("ERMEDRAG_DTYPE")


def test_fallbacks_and_paths(monkeypatch):
    monkeypatch.delenv("ERMEDRAG_EXTRACTOR_MODEL", raising=False)
    monkeypatch.setenv("ERMEDRAG_MODEL", "openai:x")
    assert settings.read("ERMEDRAG_EXTRACTOR_MODEL") == "openai:x"
    monkeypatch.setenv("ERMEDRAG_EXTRACTOR_MODEL", "hf:y")
    assert settings.read("ERMEDRAG_EXTRACTOR_MODEL") == "hf:y"
    monkeypatch.setenv("ERMEDRAG_HOME", "")  # blank: the default, never the working folder
    assert settings.cache_home() == Path.home() / ".cache" / "ermedrag"
    monkeypatch.setenv("ERMEDRAG_TRACE_DB", "~/t.sqlite")
    assert settings.read("ERMEDRAG_TRACE_DB") == str(Path.home() / "t.sqlite")


@pytest.mark.parametrize("installed, expected", [(True, "llamacpp:gemma3-270m"), (False, "offline:gemma3-270m")])
def test_the_default_model_is_the_offline_one_on_the_fastest_backend_installed(monkeypatch, installed, expected):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (real("json") if installed else None) if name == "llama_cpp" else real(name, *a),
    )
    for name in ("ERMEDRAG_MODEL", "ERMEDRAG_EXTRACTOR_MODEL", "ERMEDRAG_RESPONDENT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    assert settings.default_model() == settings.read("ERMEDRAG_MODEL") == expected
    assert settings.read("ERMEDRAG_RESPONDENT_MODEL") == expected
    assert "`llamacpp:gemma3-270m` or `offline:gemma3-270m`" in settings.settings_table()  # the same on every machine
