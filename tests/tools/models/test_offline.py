"""The offline model's tokenizer prepared alone (`offline_tokenizer_dir`, what the llamacpp: default needs on first
use) is the converted model's tokenizer and generation config, without converting the weights."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, GenerationConfig

from ermedrag.agents import respondent
from ermedrag.agents.base import continuation, to_chat
from ermedrag.tools.models.offline import CHAT_READY_MARKER, offline_model_dir, offline_tokenizer_dir

CONVERSATION = respondent.build_messages("First-line drug?", {"A": "Insulin", "B": "Metformin"}, "1. [x] a — b — c")


@pytest.mark.slow  # reads the GGUF's vocabulary: half a minute
def test_the_tokenizer_alone_is_the_converted_models(tmp_path, monkeypatch):
    converted = offline_model_dir()  # the shared cache's conversion (made once per machine)
    monkeypatch.setenv("ERMEDRAG_HOME", str(tmp_path))
    alone = offline_tokenizer_dir()
    assert alone == tmp_path / "models" / "gemma3-270m-tokenizer" and (alone / CHAT_READY_MARKER).exists()
    assert not list(alone.glob("*.safetensors"))  # no weights
    ours, theirs = AutoTokenizer.from_pretrained(alone), AutoTokenizer.from_pretrained(converted)
    chat, flags = to_chat(CONVERSATION), continuation(CONVERSATION)
    rendered = ours.apply_chat_template(chat, tokenize=False, **flags)
    assert rendered == theirs.apply_chat_template(chat, tokenize=False, **flags)
    assert ours(rendered)["input_ids"] == theirs(rendered)["input_ids"]
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == (theirs.eos_token, theirs.bos_token, theirs.pad_token)
    generation = {
        key: GenerationConfig.from_pretrained(folder).to_dict()
        for key, folder in (("alone", alone), ("converted", converted))
    }
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert generation["alone"][field] == generation["converted"][field], field
    assert json.loads((alone / "generation_config.json").read_text())["eos_token_id"][0] == ours.eos_token_id


def test_once_the_model_is_converted_its_folder_serves_the_tokenizer(tmp_path, monkeypatch):
    converted = offline_model_dir()
    monkeypatch.setenv("ERMEDRAG_HOME", str(converted.parent.parent))
    assert offline_tokenizer_dir() == converted
