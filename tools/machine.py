"""What this machine is, read once: the CPU (its flags decide the dtype, `precision`; its model decides whether
recorded greedy decodes repeat, benches/learning/seeds.py) and the one-line description every bench records
beside its figures."""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache
from pathlib import Path


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
