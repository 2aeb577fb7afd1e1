"""Is a parser linear on a hostile input? One rule for the reliability bench's parser cases (which CI runs in
tests/benches/test_reliability.py) and the test that checks the rule itself.

Timed in CPU time of the calling thread, so a call preempted on a shared CI core does not count as a slow one, and
judged by growth: linear parsing costs ~4x on 4x the input, quadratic ~16x. A fixed wall-clock limit alone flakes
under load (a linear 40 ms parser measured 53 ms on a busy CI core) and misses a small quadratic term.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Callable

CPU_LIMIT_S = 0.25  # on 1 MB: far above any linear parser here (the slowest takes ~45 ms), far below a quadratic one
MAX_GROWTH_FOR_4X_INPUT = 8.0
RATIO_FLOOR_S = 0.010  # below this on the whole input, timer and cache noise dominate the ratio: not checked
ROUNDS, CONFIRM_ROUNDS = 3, 7


def cpu_seconds(parse: Callable[[str], object], text: str) -> float:
    started = time.thread_time()
    parse(text)
    return time.thread_time() - started


def best_of_alternate_runs(
    parse: Callable[[str], object], quarter: str, whole: str, rounds: int
) -> tuple[float, float]:
    """Best CPU seconds on the quarter and on the whole over `rounds` rounds of one run each, with the garbage
    collector paused. Alternating matters: CPU time itself stretches on a busy machine (shared caches and
    hyperthreads; a linear 5 ms quarter and 44 ms whole read 8.6x in CI at a414d90), so the runs of one size must
    not all fall in a busy spell and the other's in a calm one. Stops after a run over the limit (a quadratic parser
    would take minutes per megabyte)."""
    best_quarter = best_whole = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            best_quarter = min(best_quarter, cpu_seconds(parse, quarter))
            if best_quarter > CPU_LIMIT_S / 4:
                break
            best_whole = min(best_whole, cpu_seconds(parse, whole))
            if best_whole > CPU_LIMIT_S:
                break
    finally:
        gc.enable()
    return best_quarter, best_whole


def growth_over_limits(quarter_s: float, whole_s: float) -> str | None:
    """Why these times are not linear, or None."""
    if quarter_s > CPU_LIMIT_S / 4:
        return f"{quarter_s * 1000:.0f} ms of CPU on a quarter of the input"
    if whole_s > CPU_LIMIT_S:
        return f"{whole_s * 1000:.0f} ms of CPU"
    # A quarter timed under a quarter of the floor is noise too: 2 ms against 19 ms on a busy core read 8.9x
    # for a parser that only measures a length (CI at 416960e). A quadratic parser still grows ~16x from there.
    growth = whole_s / max(quarter_s, RATIO_FLOOR_S / 4)
    if whole_s >= RATIO_FLOOR_S and growth > MAX_GROWTH_FOR_4X_INPUT:
        return f"{growth:.1f}x the time of a quarter of the input ({whole_s * 1000:.0f} ms)"
    return None


def superlinear(parse: Callable[[str], object], quarter: str, whole: str) -> tuple[str | None, float]:
    """(Why parsing `whole` is not linear or None, its CPU seconds), given the same input built at a quarter of
    the size. The quarter goes first, so a quadratic parser fails fast. A verdict is measured once more, over
    more rounds, before it stands: a quadratic parser grows ~16x every time, a busy spell does not."""
    quarter_s, whole_s = best_of_alternate_runs(parse, quarter, whole, ROUNDS)
    why = growth_over_limits(quarter_s, whole_s)
    if why:
        quarter_s, whole_s = best_of_alternate_runs(parse, quarter, whole, CONFIRM_ROUNDS)
        why = growth_over_limits(quarter_s, whole_s)
    return why, whole_s if math.isfinite(whole_s) else quarter_s  # the whole is not run after a slow quarter


def limits_text() -> str:
    return (
        f"at most {CPU_LIMIT_S * 1000:.0f} ms of CPU on 1 MB and {MAX_GROWTH_FOR_4X_INPUT:.0f}x the time of a "
        "quarter MB"
    )
