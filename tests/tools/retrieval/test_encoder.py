"""The dense encoder without sentence-transformers (`MeanPooledEncoder`) gives the very vectors sentence-transformers
gives for the same model: indexes built before it, and by either, stay valid. Checked on the packaged MiniLM with
texts of every length (empty, one letter, past the 256-token limit, batches padded), in float32 and in bfloat16."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ermedrag.tools.data.starter_kb import PASSAGES
from ermedrag.tools.retrieval.bert import bert_config
from ermedrag.tools.retrieval.encoder import (
    DEFAULT_ENCODER,
    MeanPooledEncoder,
    encoder_path,
    mean_pooled_shape,
)


def _texts() -> list[str]:
    passages = [json.loads(line)["text"] for line in PASSAGES.read_text().splitlines() if line.strip()][:24]
    rng = random.Random(0)
    cut = [text[: rng.randint(1, len(text))] for text in passages]
    return [*passages, *cut, " ".join(passages[:6]), "", "a", "Which drug is first-line for type 2 diabetes?"]


def _other_activation(tmp_path: Path) -> str:
    """The packaged MiniLM with another activation: not the plain BERT `tools.retrieval.bert` runs, so transformers'."""
    folder = tmp_path / "minilm-gelu-new"
    shutil.copytree(encoder_path(DEFAULT_ENCODER), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu_new"}))
    return str(folder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", ["packaged", "through_transformers"])
def test_the_same_vectors_as_sentence_transformers(dtype, model, tmp_path):
    from sentence_transformers import SentenceTransformer

    path = encoder_path(DEFAULT_ENCODER) if model == "packaged" else _other_activation(tmp_path)
    assert (bert_config(Path(path)) is not None) == (model == "packaged")
    texts = _texts()
    ours = MeanPooledEncoder(path, *mean_pooled_shape(Path(path)), device="cpu", dtype=dtype)
    theirs = SentenceTransformer(path, device="cpu").to(dtype)
    expected = theirs.encode(texts, batch_size=16, convert_to_numpy=True, show_progress_bar=False).astype(np.float32)
    assert np.array_equal(ours.encode(texts, batch_size=16), expected)
    assert ours.max_seq_length == theirs.max_seq_length == 256
    assert ours.get_sentence_embedding_dimension() == theirs.get_sentence_embedding_dimension() == 384


def test_the_packaged_model_loads_without_sentence_transformers_or_transformers_modeling():
    """What the first answer pays for (benches/results/first_answer.json): checked in a fresh process."""
    code = (
        "import sys; from ermedrag.tools.retrieval.encoder import encode_queries, load_encoder; "
        "encode_queries(['which drug first?']); print(type(load_encoder()).__name__, "
        "[m for m in ('sentence_transformers', 'transformers.modeling_utils') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["MeanPooledEncoder", "[]"]


def _folder(tmp_path: Path, modules: list[str], pooling: dict, bert: dict) -> Path:
    (tmp_path / "1_Pooling").mkdir(parents=True)
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    entries = [
        {"idx": i, "name": str(i), "path": paths[kind], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(modules)
    ]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert))
    return tmp_path


MEAN = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
PLAIN = {"max_seq_length": 128, "do_lower_case": False}


@pytest.mark.parametrize(
    "modules, pooling, bert, shape",
    [
        (["Transformer", "Pooling", "Normalize"], MEAN, PLAIN, (128, True)),
        (["Transformer", "Pooling"], MEAN, PLAIN, (128, False)),
        (["Transformer", "Pooling", "Dense"], MEAN, PLAIN, None),  # a projection after pooling
        (["Transformer", "Pooling"], {"pooling_mode_cls_token": True}, PLAIN, None),
        (["Transformer", "Pooling"], MEAN | {"pooling_mode_max_tokens": True}, PLAIN, None),
        (["Transformer", "Pooling"], MEAN, PLAIN | {"do_lower_case": True}, None),
        (["Transformer", "Pooling"], MEAN, PLAIN | {"model_args": {"trust_remote_code": True}}, None),
        (["Transformer", "Pooling"], MEAN, {"do_lower_case": False}, None),  # no token limit
    ],
)
def test_only_the_shape_it_reproduces_skips_sentence_transformers(tmp_path, modules, pooling, bert, shape):
    assert mean_pooled_shape(_folder(tmp_path, modules, pooling, bert)) == shape


def test_a_hub_id_or_an_unreadable_folder_goes_to_sentence_transformers(tmp_path):
    assert mean_pooled_shape(Path("ncbi/MedCPT-Query-Encoder")) is None
    (tmp_path / "modules.json").write_text("{not json")
    assert mean_pooled_shape(tmp_path) is None
