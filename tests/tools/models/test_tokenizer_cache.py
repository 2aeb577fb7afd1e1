"""Tokenizers kept between processes (`tools.models.tokenizer_cache`): the kept one tokenizes and renders chats as a
fresh `from_pretrained` does, and an edited tokenizer file, a damaged kept file or a hub id never hands back a stale
or broken one."""

from __future__ import annotations

import pickle
import shutil

import pytest
from transformers import AutoTokenizer

from ermedrag.agents import respondent
from ermedrag.agents.base import continuation, to_chat
from ermedrag.tools.models import tokenizer_cache
from ermedrag.tools.models.tokenizer_cache import load_tokenizer

TEXTS = ["Which drug is first-line for type 2 diabetes?", "  <answer>B</answer>\n\n", "ünïcode — 漢字 🙂", ""]
CONVERSATION = respondent.extraction_messages("First-line drug?", {"A": "Insulin", "B": "Metformin"}, "metformin")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ERMEDRAG_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def folder(tiny_model, tmp_path):
    copy = tmp_path / "tokenizer"
    shutil.copytree(tiny_model, copy)
    return copy


def _same(kept, fresh) -> None:
    for text in TEXTS:
        assert kept(text)["input_ids"] == fresh(text)["input_ids"]
        assert kept.decode(fresh(text)["input_ids"]) == fresh.decode(fresh(text)["input_ids"])
    chat = to_chat(CONVERSATION)
    flags = continuation(CONVERSATION)
    assert kept.apply_chat_template(chat, tokenize=False, **flags) == fresh.apply_chat_template(
        chat, tokenize=False, **flags
    )
    assert (kept.eos_token, kept.bos_token, kept.pad_token) == (fresh.eos_token, fresh.bos_token, fresh.pad_token)
    assert kept.all_special_ids == fresh.all_special_ids and len(kept) == len(fresh)


def test_a_kept_tokenizer_is_the_one_from_pretrained_loads(home, folder):
    fresh = AutoTokenizer.from_pretrained(folder)
    first = load_tokenizer(str(folder))
    assert len(list((home / "tokenizers").glob("*.pickle"))) == 1
    kept = load_tokenizer(str(folder))
    _same(first, fresh)
    _same(kept, fresh)
    assert kept is not first  # the second came from the file, not from this process's memory


def test_an_edited_tokenizer_file_is_loaded_afresh(home, folder):
    load_tokenizer(str(folder))
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 77}', 1))
    assert load_tokenizer(str(folder)).model_max_length == 77
    assert len(list((home / "tokenizers").glob("*.pickle"))) == 2  # one key per version of the files


def test_a_damaged_kept_file_is_replaced(home, folder):
    load_tokenizer(str(folder))
    (kept_file,) = (home / "tokenizers").glob("*.pickle")
    kept_file.write_bytes(b"not a pickle")
    _same(load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder))
    assert pickle.loads(kept_file.read_bytes()) is not None  # written again, whole


def test_only_a_local_source_is_kept(home, folder):
    assert tokenizer_cache._kept_path("google/gemma-3-270m", {}) is None  # the hub cache's business
    assert tokenizer_cache._kept_path(str(folder), {}).parent == home / "tokenizers"
    assert tokenizer_cache._kept_path(str(folder), {"gguf_file": "m.gguf"}) != tokenizer_cache._kept_path(
        str(folder), {}
    )


def test_a_cache_that_cannot_be_written_still_loads(tmp_path, monkeypatch, folder):
    home = tmp_path / "not-a-folder"
    home.write_text("")  # no folder can be made under it, whoever runs the test
    monkeypatch.setenv("ERMEDRAG_HOME", str(home))
    _same(load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder))
