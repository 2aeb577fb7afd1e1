"""What a training run records: every dict the trainer logs, as JSON lines, and the curves plotted from them.

- `metrics.jsonl` (`MetricsRecorder`): one JSON line per log call, with `step` added (loss, learning rate,
  for GRPO `reward`, `rewards/<func>/mean|std`, `kl` when beta > 0, `entropy`, `completions/mean_length`...;
  for DPO `rewards/chosen|rejected|margins|accuracies`, `logps/*`, `entropy`). Only the main process writes.
- `curves.png` (`plot_curves`): those curves, one panel per metric family.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ermedrag.tools.records.jsonl import read_records, replace_text

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"


class MetricsRecorder(TrainerCallback):
    """Append every dict the trainer logs to a JSON-lines file (main process only), with the step number.

    A run resumed from a checkpoint (`keep_up_to_step`) keeps the lines the interrupted run logged up to that
    step, in the file and in `records`, and drops the later ones: those steps are trained again."""

    def __init__(self, path: str | Path, *, keep_up_to_step: int | None = None):
        self.path = Path(path)
        self.keep_up_to_step = keep_up_to_step
        self.records: list[dict[str, Any]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.start()

    def start(self) -> None:
        """An empty file, or for a resumed run the earlier run's complete lines up to its checkpoint."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = self.keep_up_to_step
        self.records = (
            []
            if kept is None
            else [r for r in read_records(self.path) if isinstance(r.get("step"), int) and r["step"] <= kept]
        )
        replace_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        record = {"step": state.global_step, **{k: _jsonable(v) for k, v in logs.items()}}
        self.records.append(record)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def zero_variance_steps(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How many GRPO steps carried no learning signal: a group whose completions all got the same reward has no
    advantage to follow, and TRL logs the share of such groups per step as `frac_reward_zero_std`. A step where
    it is 1 taught nothing. With dynamic sampling, also how many batches a step drew and set aside. None when the
    run logged no such figure (DPO, or no step logged)."""
    shares = [
        float(r["frac_reward_zero_std"])
        for r in records
        if isinstance(r.get("frac_reward_zero_std"), (int, float)) and math.isfinite(r["frac_reward_zero_std"])
    ]
    if not shares:
        return None
    silent = sum(share >= 1.0 - 1e-9 for share in shares)
    summary = {
        "logged_steps": len(shares),
        "steps_without_signal": silent,
        "share": round(silent / len(shares), 4),
        "mean_frac_reward_zero_std": round(sum(shares) / len(shares), 4),
    }
    resampled = [float(r["resampled_batches"]) for r in records if isinstance(r.get("resampled_batches"), (int, float))]
    if resampled:  # dynamic sampling (training.grpo): steps whose first batch was silent, and the
        # batches set aside per step on average (steps_without_signal counts the steps that found none)
        summary["steps_resampled"] = sum(count >= 1 for count in resampled)
        summary["mean_resampled_batches"] = round(sum(resampled) / len(resampled), 4)
    return summary


# Panels of the curve plot: title and a predicate on metric names. A metric goes to the first panel it fits.
_PANELS: list[tuple[str, Callable[[str], bool]]] = [
    ("loss", lambda k: k == "loss"),
    ("reward (total and per function)", lambda k: k == "reward" or (k.startswith("rewards/") and k.endswith("/mean"))),
    ("DPO implicit rewards", lambda k: k in ("rewards/chosen", "rewards/rejected", "rewards/margins")),
    ("DPO preference accuracy", lambda k: k == "rewards/accuracies"),
    ("KL to reference", lambda k: k in ("kl", "objective/kl")),
    ("entropy", lambda k: k == "entropy"),
    ("completion length (tokens)", lambda k: k in ("completions/mean_length", "completions/mean_terminated_length")),
]


def plot_curves(records: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path | None:
    """Plot the logged training curves (one panel per metric family present) to a PNG; None if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        step = record.get("step")
        for key, value in record.items():
            if key == "step" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if math.isfinite(value):
                series.setdefault(key, []).append((step, float(value)))
    panels: list[tuple[str, list[str]]] = []
    used: set[str] = set()
    for name, fits in _PANELS:
        keys = sorted(k for k in series if k not in used and fits(k))
        if keys:
            panels.append((name, keys))
            used.update(keys)
    if not panels:
        return None
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            steps, values = zip(*series[key])
            ax.plot(steps, values, marker="o", markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _jsonable(value: Any) -> Any:
    """A logged value as strict JSON: numbers stay numbers, NaN/inf become null, anything else a string."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(number):
        return None
    return value if isinstance(value, int) else number
