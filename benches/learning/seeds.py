"""Several training seeds against one fixed before: what the learning benches report per metric.

The held-out prompts and the base model's greedy replies to them are the same for every seed (measured once), so
the spread over seeds is the training's own (LoRA initialisation, data order, sampled rollouts), not the prompts'.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ermedrag.evals.metrics import wilson_interval


def over_seeds(before: dict[str, float], afters: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Per numeric metric of `before`: its value before, and after training its mean ± sd over the seeds, each
    seed's value, and in how many seeds it ended higher than before (better for rates and rewards, not for
    lengths)."""
    summary: dict[str, Any] = {"n": len(afters)}
    for name, value in before.items():
        values = [after[name] for after in afters if isinstance(after.get(name), (int, float))]
        if not isinstance(value, (int, float)) or not values:
            continue
        summary[name] = {
            "before": round(value, 4),
            "after": {"mean": round(statistics.fmean(values), 4),
                      "sd": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
                      "values": [round(v, 4) for v in values]},
            "seeds_higher_after": sum(v > value for v in values),
        }
    return summary


def accuracy_interval(accuracy: float, n: int) -> dict[str, Any]:
    """Held-out accuracy with its Wilson 95% interval (n prompts)."""
    low, high = wilson_interval(round(accuracy * n), n)
    return {"accuracy": round(accuracy, 4), "n": n, "wilson_95": [round(low, 4), round(high, 4)]}


def gain(summary: dict[str, Any], metric: str) -> dict[str, float] | None:
    """after − before of one metric, mean and sd over the seeds."""
    entry = summary.get(metric)
    if not entry:
        return None
    gains = [v - entry["before"] for v in entry["after"]["values"]]
    return {"mean": round(statistics.fmean(gains), 4),
            "sd": round(statistics.stdev(gains), 4) if len(gains) > 1 else 0.0}
