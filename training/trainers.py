"""Run TRL's DPOTrainer / GRPOTrainer from a project config, and record what they log.

    from ermedrag.training.config import GRPOTrainingConfig, load_config
    from ermedrag.training.trainers import train_grpo
    summary = train_grpo(load_config("training/configs/grpo_respondent.yaml", GRPOTrainingConfig),
                         reward_funcs=[correctness_reward, format_reward], reward_weights=[1.0, 0.2])

Each run writes to `config.output_dir`:
- the final LoRA adapter (or the full model when `use_lora: false`) and the tokenizer, loadable with
  `peft.AutoPeftModelForCausalLM` / `transformers.AutoModelForCausalLM`;
- `metrics.jsonl`: every dict the trainer logs, one JSON line each, with `step` added (loss, learning rate,
  for GRPO `reward`, `rewards/<func>/mean|std`, `kl` when beta > 0, `entropy`, `completions/mean_length`...;
  for DPO `rewards/chosen|rejected|margins|accuracies`, `logps/*`, `entropy`);
- `curves.png`: those curves, one panel per family;
- `training_config.json`: the project config the run used.

Datasets are folders written by `datasets.Dataset.save_to_disk`, in TRL's conversational format:
- DPO: `prompt` (list of messages), `chosen` and `rejected` (each a list with one assistant message), plus
  any provenance columns (dropped before tokenisation);
- GRPO: `prompt` (list of messages) plus whatever columns the reward functions read (`gold`, `options`...):
  TRL passes every extra column to each reward function as a keyword argument (a list, one per completion).

GPU recipe (vLLM generation, bf16, several GPUs). Precision is automatic (bf16 on CUDA); pick the
distribution strategy with an accelerate config file (DDP, DeepSpeed ZeRO-2/3, or FSDP; TRL ships examples
in its repository under `examples/accelerate_configs/`):

    # one node, vLLM inside the training processes (set in the YAML: use_vllm: true, vllm_mode: colocate)
    accelerate launch --config_file deepspeed_zero2.yaml -m ermedrag train grpo --config grpo.yaml

    # or a separate vLLM server on its own GPU (use_vllm: true, vllm_mode: server,
    # vllm_server_base_url: http://HOST:8000), started first with
    CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model MODEL --port 8000
    CUDA_VISIBLE_DEVICES=1,2,3 accelerate launch --config_file fsdp.yaml --num_processes 3 \
        -m ermedrag train grpo --config grpo.yaml

    accelerate launch --config_file ... -m ermedrag train dpo --config dpo.yaml

Only the main process writes metrics.jsonl and curves.png; TRL/accelerate handle the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ermedrag.training.config import DPOTrainingConfig, GRPOTrainingConfig, _TrainingConfig

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
CONFIG_FILE = "training_config.json"

# Columns a DPO row must have; anything else is provenance and is dropped before TRL tokenises.
DPO_COLUMNS = ("prompt", "chosen", "rejected")


class MetricsRecorder(TrainerCallback):
    """Append every dict the trainer logs to a JSON-lines file (main process only), with the step number."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("", encoding="utf-8")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        record = {"step": state.global_step, **{k: _jsonable(v) for k, v in logs.items()}}
        self.records.append(record)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def train_dpo(config: DPOTrainingConfig) -> dict[str, Any]:
    """Train with DPO on the preference pairs in `config.dataset`; return a summary of the run."""
    from trl import DPOTrainer

    dataset = _load_dataset(config.dataset)
    missing = [c for c in DPO_COLUMNS if c not in dataset.column_names]
    if missing:
        raise ValueError(f"DPO dataset {config.dataset} lacks column(s) {missing}; it has {dataset.column_names}")
    dataset = dataset.select_columns(list(DPO_COLUMNS))

    model_path = config.model_path()
    tokenizer = _load_tokenizer(model_path)
    recorder = MetricsRecorder(Path(config.output_dir) / METRICS_FILE)
    # The model goes in by path: with LoRA the reference is the base model with the adapter disabled; without
    # it TRL loads a second copy from the same path as the frozen reference.
    trainer = DPOTrainer(
        model=model_path,
        args=config.to_trl(),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=config.lora_config(),
        callbacks=[recorder],
    )
    return _run(trainer, config, recorder, kind="dpo")


def train_grpo(
    config: GRPOTrainingConfig,
    reward_funcs: Sequence[Callable[..., list[float | None]]],
    reward_weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Train with GRPO on the prompts in `config.dataset`, scoring completions with `reward_funcs`.

    Each reward function is a TRL reward callable, `f(prompts, completions, completion_ids, **columns) ->
    list[float | None]`; its `__name__` names its curve (`rewards/<name>/mean`). `reward_weights` (else
    `config.reward_weights`, else all 1) weights them in the total reward.
    """
    from trl import GRPOTrainer

    reward_funcs = list(reward_funcs)
    if not reward_funcs:
        raise ValueError("train_grpo needs at least one reward function")
    weights = list(reward_weights) if reward_weights is not None else config.reward_weights
    if weights is not None and len(weights) != len(reward_funcs):
        raise ValueError(f"{len(weights)} reward weights for {len(reward_funcs)} reward functions")

    dataset = _load_dataset(config.dataset)
    if "prompt" not in dataset.column_names:
        raise ValueError(f"GRPO dataset {config.dataset} has no `prompt` column; it has {dataset.column_names}")

    model_path = config.model_path()
    tokenizer = _load_tokenizer(model_path)
    args = config.to_trl()
    args.reward_weights = [float(w) for w in weights] if weights is not None else None
    recorder = MetricsRecorder(Path(config.output_dir) / METRICS_FILE)
    extra: dict[str, Any] = {}
    if config.stop_strings and not config.use_vllm:  # vLLM stops by itself (GRPOTrainingConfig.to_trl)
        from ermedrag.training.med_r3 import make_med_r3_rollout

        extra["rollout_func"] = make_med_r3_rollout(None, end_stops=config.stop_strings,
                                                    step_max_new_tokens=config.max_completion_length)
    # By path, so that beta > 0 without LoRA can rebuild the reference model (TRL reloads it from the path).
    with warnings.catch_warnings():  # rollout_func is marked experimental in TRL 1.16
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
        trainer = GRPOTrainer(
            model=model_path,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=config.lora_config(),
            callbacks=[recorder],
            **extra,
        )
    summary = _run(trainer, config, recorder, kind="grpo")
    summary["reward_functions"] = list(trainer.reward_func_names)
    return summary


def train_from_file(kind: str, config_path: str | Path) -> dict[str, Any]:
    """What `ermedrag train dpo|grpo --config FILE` runs: load the YAML and train.

    GRPO uses the respondent's rewards (`training.rewards.respondent_reward_funcs`: correctness, format,
    length, evidence use) with their default weights unless the YAML sets `reward_weights`.
    """
    from ermedrag.training.config import load_config

    if kind == "dpo":
        return train_dpo(load_config(config_path, DPOTrainingConfig))
    if kind == "grpo":
        from ermedrag.training.rewards import respondent_reward_funcs

        config = load_config(config_path, GRPOTrainingConfig)
        funcs, weights = respondent_reward_funcs()
        return train_grpo(config, funcs, config.reward_weights or weights)
    raise ValueError(f"unknown trainer {kind!r}: expected 'dpo' or 'grpo'")


# --- shared pieces -----------------------------------------------------------------------------------------


def _load_dataset(path: str):
    from datasets import DatasetDict, load_from_disk

    if not Path(path).exists():
        raise FileNotFoundError(f"dataset folder not found: {path}")
    dataset = load_from_disk(path)
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise ValueError(f"dataset {path} is a DatasetDict without a `train` split: {list(dataset)}")
        dataset = dataset["train"]
    if len(dataset) == 0:
        raise ValueError(f"dataset {path} is empty")
    return dataset


def _load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer of {model_path} has no chat template; the conversational datasets need one "
            "(tools.offline_model adds one to the offline default)"
        )
    return tokenizer


def _run(trainer, config: _TrainingConfig, recorder: MetricsRecorder, *, kind: str) -> dict[str, Any]:
    output_dir = Path(config.output_dir)
    started = time.perf_counter()
    result = trainer.train()
    trainer.save_model(str(output_dir))  # the adapter with LoRA, the full model without; also the tokenizer
    summary: dict[str, Any] = {
        "trainer": kind,
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "wall_seconds": round(time.perf_counter() - started, 2),
        "output_dir": str(output_dir),
        "model_dir": str(output_dir),
        "adapter": config.use_lora,
        "metrics_path": str(output_dir / METRICS_FILE),
        "plot_path": None,
    }
    step_records = [r for r in recorder.records if "loss" in r]
    summary["final_metrics"] = step_records[-1] if step_records else {}
    if trainer.is_world_process_zero():
        (output_dir / CONFIG_FILE).write_text(
            json.dumps(dataclasses.asdict(config), indent=2, default=str), encoding="utf-8"
        )
        plot = plot_curves(recorder.records, output_dir / PLOT_FILE, title=f"{kind.upper()} {Path(config.model).name}")
        summary["plot_path"] = str(plot) if plot else None
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
