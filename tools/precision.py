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
from typing import Any

from ermedrag.tools.machine import cpu_flags

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
    """The CPU has bfloat16 instructions (its /proc/cpuinfo flags; False where that file is missing).
    oneDNN's own check says yes on any AVX-512 CPU, where it emulates bfloat16 more slowly than float32."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


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
