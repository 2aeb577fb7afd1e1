"""BERT's forward pass in plain torch, for the dense encoder (`tools.retrieval.encoder.MeanPooledEncoder`).

Why: transformers' modeling stack (`BertModel` and what it imports: masking utilities, the kernels hub, distributed
tensors) costs 2 s of every `ermedrag ask` on 2 cores, to run a 6-layer encoder over one query. This is the same
computation, operation for operation, so its token vectors are transformers' to the bit
(tests/tools/retrieval/test_encoder.py): embeddings summed word + token type, then position, and layer-normed;
each layer's attention through `scaled_dot_product_attention` (a boolean mask where a batch has padding, none
where it has not), its output and feed-forward sums layer-normed on their residuals, exact GELU between.

Only the BERT that sentence-transformers encoders use (`bert_config` says which): absolute positions, GELU, a
`model.safetensors` file. Any other model loads through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLAIN_BERT = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
CONFIG_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "layer_norm_eps")


def bert_config(folder: Path) -> dict[str, Any] | None:
    """The config of a plain BERT checkpoint in `folder` that `BertEncoder` runs, else None."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    plain = all(config.get(key, value) == value for key, value in PLAIN_BERT.items()) and "model_type" in config
    if not plain or not (folder / "model.safetensors").is_file() or not all(k in config for k in CONFIG_FIELDS):
        return None
    return config


class BertEncoder:
    """A BERT checkpoint's weights in `dtype` on `device`; calling it gives the last layer's token vectors."""

    def __init__(self, folder: Path, config: dict[str, Any], device: str, dtype: Any):
        from safetensors.torch import load_file

        weights = load_file(str(folder / "model.safetensors"), device=device)
        self.weights = {name.removeprefix("bert."): tensor.to(dtype) for name, tensor in weights.items()}
        self.heads, self.layers = config["num_attention_heads"], config["num_hidden_layers"]
        self.hidden, self.eps = config["hidden_size"], config["layer_norm_eps"]
        self.dtype, self.device = dtype, device

    def __call__(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
        import torch

        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        hidden = self._embedding("word_embeddings", input_ids) + self._embedding("token_type_embeddings", types)
        hidden = self._norm(hidden + self._embedding("position_embeddings", positions), "embeddings.LayerNorm")
        batch, length = input_ids.shape
        padded = not bool(attention_mask.all())
        mask = attention_mask.bool()[:, None, None, :].expand(batch, 1, length, length) if padded else None
        for layer in range(self.layers):
            prefix = f"encoder.layer.{layer}."
            attended = self._attention(hidden, mask, prefix + "attention.self.")
            hidden = self._norm(
                self._linear(attended, prefix + "attention.output.dense") + hidden,
                prefix + "attention.output.LayerNorm",
            )
            inner = torch.nn.functional.gelu(self._linear(hidden, prefix + "intermediate.dense"))
            hidden = self._norm(self._linear(inner, prefix + "output.dense") + hidden, prefix + "output.LayerNorm")
        return hidden

    def _attention(self, hidden: Any, mask: Any, prefix: str) -> Any:
        import torch

        batch, length, _ = hidden.shape
        size = self.hidden // self.heads
        q, k, v = (
            self._linear(hidden, prefix + name).view(batch, length, -1, size).transpose(1, 2)
            for name in ("query", "key", "value")
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=size**-0.5, is_causal=False
        )
        return out.transpose(1, 2).contiguous().reshape(batch, length, -1).contiguous()

    def _embedding(self, name: str, ids: Any) -> Any:
        import torch

        return torch.nn.functional.embedding(ids, self.weights[f"embeddings.{name}.weight"])

    def _linear(self, x: Any, name: str) -> Any:
        import torch

        return torch.nn.functional.linear(x, self.weights[name + ".weight"], self.weights[name + ".bias"])

    def _norm(self, x: Any, name: str) -> Any:
        import torch

        weight, bias = self.weights[name + ".weight"], self.weights[name + ".bias"]
        return torch.nn.functional.layer_norm(x, (self.hidden,), weight, bias, self.eps)
