"""Which dtype in-process models compute in: one rule for the generative models and the retrieval encoder.

`ERMEDRAG_DTYPE` (auto | float32 | bfloat16 | float16) overrides it. `auto`: bfloat16 on an accelerator; on a CPU,
bfloat16 only where the CPU computes it natively (AVX512-BF16 / AMX: emulated it would be slower), and then

- a generative model only when its checkpoint is stored in bfloat16: greedy decoding turns small numeric
  differences into different tokens that compound, so nothing is computed below the precision it was stored in;
  the offline Gemma 270M (stored in bfloat16) then needs 0.5 instead of 1.1 GB (benches/eval_memory.py);
- the retrieval encoder always: one forward pass compared by cosine. In a one-off probe bfloat16 moved MiniLM query
  vectors by at most 0.002 of cosine and cut a 250-token query from 35 to 20 ms on one core; the retrieval bench
  found every quality figure unchanged (benches/README.md, retrieval).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def inference_dtype(device: str, stored_dtype: str | None, *, single_pass: bool = False) -> Any:
    """The torch dtype for a model on `device` whose checkpoint is stored in `stored_dtype` (None: unknown);
    `single_pass`: an encoder (one forward pass per input), not a generator."""
    import torch

    choice = os.environ.get("ERMEDRAG_DTYPE", "auto").strip().lower() or "auto"
    if choice not in DTYPE_CHOICES:
        raise ValueError(f"ERMEDRAG_DTYPE={choice!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    if choice != "auto":
        return getattr(torch, choice)
    if device != "cpu":
        return torch.bfloat16
    if (single_pass or stored_dtype == "bfloat16") and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16 / AMX, Arm's BF16 extension


def cpu_has_native_bf16() -> bool:
    """The CPU has bfloat16 instructions (read from /proc/cpuinfo's flags; False where that file is missing).
    oneDNN's own check says yes on any AVX-512 CPU, where it emulates bfloat16 more slowly than float32."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def checkpoint_dtype(source: str) -> str | None:
    """The dtype a checkpoint's config says its weights are stored in ("bfloat16", "float32", ...); None when it
    cannot tell (a hub id not in the local cache, a config without it)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return None
    for candidate in (config, getattr(config, "text_config", None)):
        stored = getattr(candidate, "dtype", None) or getattr(candidate, "torch_dtype", None)
        if stored is not None:
            return str(stored).removeprefix("torch.")
    return None


OUTPUT_LAYER_CHOICES = ("same", "int8")


def output_layer_choice() -> str:
    """`ERMEDRAG_OUTPUT_LAYER`: `same` (default: the output layer computes in the model's dtype) or `int8`
    (bfloat16 models on a CPU)."""
    choice = os.environ.get("ERMEDRAG_OUTPUT_LAYER", "same").strip().lower() or "same"
    if choice not in OUTPUT_LAYER_CHOICES:
        raise ValueError(f"ERMEDRAG_OUTPUT_LAYER={choice!r}: expected one of {', '.join(OUTPUT_LAYER_CHOICES)}")
    return choice


def quantize_output_layer(model: Any) -> bool:
    """With `ERMEDRAG_OUTPUT_LAYER=int8`, a CPU model's output layer computes from int8 weights (one scale per
    vocabulary row) instead of its own. For Gemma 3 270M that layer is 168M of the 268M weights (a 262k
    vocabulary), read in full at every decoded token: reading half the bytes speeds up single-stream decoding
    (benches/cpu_inference.py). Opt-in, since greedy decoding can turn its small logit differences into other
    tokens (the bench counts how often). Memory grows by the int8 copy (168 MB for Gemma 270M) where the
    bfloat16 weights stay as the input embedding they are tied to. Only bfloat16: torch's int8 kernel is vectorised for
    bfloat16 activations. True when the layer was replaced."""
    if output_layer_choice() != "int8":
        return False
    import torch

    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or weight.device.type != "cpu" \
            or weight.dtype != torch.bfloat16:
        found = (f"a {type(head).__name__}" + (f" in {weight.dtype} on {weight.device}" if weight is not None else "")
                 + (" with a bias" if getattr(head, "bias", None) is not None else ""))
        raise ValueError("ERMEDRAG_OUTPUT_LAYER=int8 needs a bfloat16 model on the CPU whose output layer is a linear "
                         f"layer without bias; this output layer is {found}")
    model.set_output_embeddings(int8_output_layer_class()(weight))
    return True


@lru_cache(maxsize=1)
def int8_output_layer_class() -> type:
    """The int8 output layer's module class (defined on first use: this module does not import torch)."""
    import torch

    class Int8OutputLayer(torch.nn.Module):
        """logits = x · Wᵀ with W stored as int8 rows and a scale per row (symmetric, round to nearest), through
        torch's weight-only int8 kernel in the activations' dtype."""

        def __init__(self, weight: torch.Tensor, rows_per_chunk: int = 16384):
            super().__init__()
            self.out_features, self.in_features = weight.shape
            qweight = torch.empty(weight.shape, dtype=torch.int8)
            scales = torch.empty(self.out_features, dtype=weight.dtype)
            with torch.no_grad():  # in chunks: a float32 copy of Gemma's whole head would be 0.7 GB
                for start in range(0, self.out_features, rows_per_chunk):
                    rows = weight[start:start + rows_per_chunk].float()
                    # The scale is rounded to the dtype it is stored in first, so that rows round to nearest
                    # against the very scale the kernel multiplies by.
                    scale = (rows.abs().amax(dim=1).clamp(min=1e-12) / 127).to(weight.dtype)
                    scales[start:start + rows_per_chunk] = scale
                    qweight[start:start + rows_per_chunk] = rows.div_(scale.float()[:, None]).round_().clamp_(-127, 127)
            self.register_buffer("qweight", qweight)
            self.register_buffer("scales", scales)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            # generate() passes the last position of a batch: a strided view; older kernels want it contiguous.
            rows = hidden.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
            return torch._weight_int8pack_mm(rows, self.qweight, self.scales).reshape(*hidden.shape[:-1], -1)

    return Int8OutputLayer
