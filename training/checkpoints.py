"""Going on with an interrupted training (`resume: true`): which checkpoint, and whether it is this run's.

The trainer writes `checkpoint-N/` every `save_steps`. After it has written one, `CheckpointSettings` adds
`SETTINGS_FILE`, the run's settings, as the checkpoint's last file: a checkpoint without it was cut off by a
kill (or written by another tool) and is never resumed. `resume_checkpoint` picks the newest checkpoint whose
settings are this run's; checkpoints that all come from other settings are refused, naming what differs.
A run that starts from the beginning in a folder with checkpoints moves them aside (`CheckpointSettings`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ermedrag.tools.records.jsonl import replace_text
from ermedrag.training.config import GRPOTrainingConfig, comparable_settings
from ermedrag.training.metrics import METRICS_FILE
from ermedrag.training.rewards import reward_code_sha256

log = logging.getLogger(__name__)

SETTINGS_FILE = "ermedrag_settings.json"
PREFIX = "checkpoint-"
# What a resumed run may change: where it reports, how many checkpoints it keeps, which server it reaches, and
# recomputing activations (the usual answer to running out of memory). Anything else trains another model.
CHANGEABLE_ON_RESUME = frozenset(
    {
        "resume",
        "report_to",
        "log_completions",
        "save_total_limit",
        "vllm_server_base_url",
        "vllm_gpu_memory_utilization",
        "gradient_checkpointing",
        "chroma_url",
    }
)
PATH_FIELDS = ("model", "dataset", "output_dir")


def checkpoint_step(checkpoint: Path | None) -> int | None:
    return int(checkpoint.name.removeprefix(PREFIX)) if checkpoint else None


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"{PREFIX}{step}"


def check_resumable(trl_args: Any) -> None:
    """Refuse `resume: true` where a resume could not go on exactly where the run stopped: GRPO generates for
    `steps_per_generation` micro-batches and reuses them `num_iterations` times, and TRL does not save that buffer;
    `save_only_model` checkpoints hold no optimizer; with one checkpoint kept, rotation deletes the previous one
    before the new one is marked complete."""
    iterations = getattr(trl_args, "num_iterations", 1)
    per_generation = getattr(trl_args, "steps_per_generation", None)
    if iterations != 1 or per_generation not in (None, trl_args.gradient_accumulation_steps):
        raise ValueError(
            f"resume: true needs each GRPO step to generate its own completions (num_iterations 1, "
            f"steps_per_generation = gradient_accumulation_steps); this run has num_iterations "
            f"{iterations}, steps_per_generation {per_generation}"
        )
    if trl_args.save_only_model:
        raise ValueError("resume: true needs the optimizer and scheduler in each checkpoint: save_only_model is on")
    if trl_args.save_total_limit == 1:
        raise ValueError(
            "resume: true needs save_total_limit of 2 or more (or null): with 1, a kill while the "
            "newest checkpoint is being written leaves none to go on from"
        )


def settings_record(config: Any) -> dict[str, Any]:
    """The config as JSON reads it back, with local paths absolute, the number of processes, the precision it
    resolves to on this machine (`bf16: null` means bf16 on CUDA only: a GPU run resumed on a CPU would change it
    silently) and, for a GRPO run, the reward code it trains under (an upgrade that changes a reward's rule would
    otherwise go on training one model under two objectives)."""
    from accelerate import PartialState

    record = json.loads(json.dumps(comparable_settings(config), default=str))
    for name in PATH_FIELDS:  # the same folder however it is named (relative, through a link, not yet created)
        if isinstance(record.get(name), str) and (name != "model" or Path(record[name]).exists()):
            record[name] = str(Path(record[name]).resolve())
    rewards = {"reward_code_sha256": reward_code_sha256()} if isinstance(config, GRPOTrainingConfig) else {}
    return {
        **record,
        "resolved_bf16": config.resolved_bf16(),
        "resolved_dtype": config.resolved_dtype(),
        "processes": PartialState().num_processes,
        **rewards,
    }


def differing_settings(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return sorted(
        name
        for name in recorded.keys() | current.keys()
        if name not in CHANGEABLE_ON_RESUME and recorded.get(name) != current.get(name)
    )


def _recorded_settings(checkpoint: Path) -> dict[str, Any] | None:
    try:
        recorded = json.loads((checkpoint / SETTINGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def complete_checkpoints(output_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Checkpoints that carry their settings, newest first, with those settings."""
    found = [
        (folder, _recorded_settings(folder))
        for folder in output_dir.glob(PREFIX + "*")
        if folder.name.removeprefix(PREFIX).isdigit()
    ]
    return sorted(((f, s) for f, s in found if s is not None), key=lambda item: -checkpoint_step(item[0]))


def resume_checkpoint(config: Any) -> Path | None:
    """With `config.resume`, the newest complete checkpoint in `output_dir` trained with these settings; None
    without `resume` or without any checkpoint; an error naming the differing fields when every checkpoint
    there was trained with other settings (resuming one would mix two runs in one model and one metrics file)."""
    output_dir = Path(config.output_dir)
    if not config.resume or not output_dir.is_dir():
        return None
    current = settings_record(config)
    checkpoints = complete_checkpoints(output_dir)
    for folder, recorded in checkpoints:
        if not differing_settings(recorded, current):
            return folder
    if checkpoints:
        newest, recorded = checkpoints[0]
        raise ValueError(
            f"{output_dir} holds checkpoints of a run with other settings ({newest.name}: "
            f"{', '.join(differing_settings(recorded, current))} differ): resume with that run's "
            "config and reward code, or train into another output_dir"
        )
    return None


class CheckpointSettings(TrainerCallback):
    """Marks each checkpoint complete and this run's by writing the run's settings into it, last, once every
    process has saved its part and the files are on disk. A run that starts from the beginning first moves the
    checkpoints already in its folder into `earlier-run-<time>/`: it would overwrite them file by file, and a
    checkpoint mixing two runs' files must never be resumed."""

    def __init__(self, config: Any, resumed_from: Path | None):
        self.settings = settings_record(config)
        self.resumed_from = resumed_from

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.resumed_from is None:
            move_earlier_checkpoints(Path(args.output_dir))

    def on_save(self, args, state, control, **kwargs):
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # every process calls on_save after writing its own files
        folder = checkpoint_dir(Path(args.output_dir), state.global_step)
        if state.is_world_process_zero and folder.is_dir():
            os.sync()  # the checkpoint's files reach the disk before the mark that says they are complete
            replace_text(folder / SETTINGS_FILE, json.dumps(self.settings, indent=2))


def move_earlier_checkpoints(output_dir: Path) -> None:
    """The earlier run's checkpoints, with its logged steps (which this run's metrics file starts afresh), go
    into one `earlier-run-<time>/` folder."""
    earlier = sorted(d for d in output_dir.glob(PREFIX + "*") if d.is_dir())
    if not earlier:
        return
    aside = output_dir / time.strftime("earlier-run-%Y%m%dT%H%M%SZ", time.gmtime())
    aside.mkdir(parents=True, exist_ok=True)
    for path in [*earlier, output_dir / METRICS_FILE]:
        if path.exists():
            path.rename(aside / path.name)
    log.warning(
        "%s held %d checkpoint(s) of an earlier run; this run starts from the beginning, so they were moved to %s",
        output_dir,
        len(earlier),
        aside,
    )
