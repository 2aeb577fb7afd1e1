"""What this machine is, read once, and what in-process models compute in on it: the CPU (its flags decide the dtype,
`inference_dtype`; its model decides whether recorded greedy decodes repeat, benches/learning/seeds.py) and the
one-line description every bench records beside its figures."""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from ermedrag.tools import settings


@lru_cache(maxsize=1)
def cpuinfo_fields() -> dict[str, str]:
    """This machine's `parse_cpuinfo`; empty where /proc/cpuinfo is missing."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return {}


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields (name -> value): every processor repeats the same block."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() and fields:
            break
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    info = cpuinfo_fields()
    return frozenset((info.get("flags") or info.get("Features", "")).split())  # x86 names them flags, Arm Features


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it. Greedy float32 decoding goes another way near ties on another kind of
    CPU, so recorded traces, hence a bench's before, repeat only on the same kind."""
    return cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
        return int(line.split()[1]) / 1024 / 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def describe_machine() -> str:
    """One line for a bench's record, taken when it starts: CPU, cores, memory, OS, Python, torch's threads when
    torch is loaded (never imported here), and the load average, which says whether the figures shared the cores."""
    parts = [cpu_model(), platform.machine(), f"{os.cpu_count()} CPUs"]
    memory = memory_gib()
    if memory is not None:
        parts.append(f"{memory:.0f} GiB RAM")
    parts += [f"{platform.system()} {platform.release()}", f"Python {platform.python_version()}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__} with {torch.get_num_threads()} threads")
    parts.append("load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + " at start")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------- dtypes
# Which dtype in-process models compute in: one rule for the generative models and the retrieval encoder.
#
# `ERMEDRAG_DTYPE` (auto | float32 | bfloat16 | float16) overrides it. `auto`: bfloat16 on an accelerator; on a CPU,
# bfloat16 only where the CPU computes it natively (AVX512-BF16 / AMX: emulated it would be slower), and then
#
# - a generative model only when its checkpoint is stored in bfloat16: greedy decoding turns small numeric
#   differences into different tokens that compound, so nothing is computed below the precision it was stored in;
#   the offline Gemma 270M (stored in bfloat16) then needs 0.5 instead of 1.1 GB (benches/eval_memory.py);
# - the retrieval encoder always: one forward pass compared by cosine. In a one-off probe bfloat16 moved MiniLM query
#   vectors by at most 0.002 of cosine and cut a 250-token query from 35 to 20 ms on one core; the retrieval bench
#   found every quality figure unchanged (benches/README.md, retrieval).

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def inference_dtype(device: str, stored_dtype: str | None, *, single_pass: bool = False) -> Any:
    """The torch dtype for a model on `device` whose checkpoint is stored in `stored_dtype` (None: unknown);
    `single_pass`: an encoder (one forward pass per input), not a generator."""
    import torch

    choice = settings.read("ERMEDRAG_DTYPE")
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
