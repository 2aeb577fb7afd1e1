"""Run TRL's DPOTrainer / SFTTrainer / GRPOTrainer from a project config; every GRPO trainer is built by
`build_grpo_trainer`.

    from ermedrag.training.config import GRPOTrainingConfig, load_config
    from ermedrag.training.trainers import train_grpo
    summary = train_grpo(load_config("training/configs/grpo_respondent.yaml", GRPOTrainingConfig))
    # CLI: ermedrag train grpo --config training/configs/grpo_respondent.yaml   (and: ermedrag train dpo|sft ...)

GRPO rewards are named (`training.rewards`): `train_grpo(config)` trains with `config.rewards`, the
respondent's defaults when unset; `train_grpo(config, reward_funcs=[f, g])` trains with your own functions
instead, each weighted by its `__name__` in `config.rewards` (1 when not named). Rollouts end at
`config.stop_strings` (a `training.rollouts` rollout function without search; vLLM stops by itself).

Each run writes to `config.output_dir`:
- the final LoRA adapter (or the full model when `use_lora: false`) and the tokenizer, loadable with
  `peft.AutoPeftModelForCausalLM` / `transformers.AutoModelForCausalLM`;
- `metrics.jsonl` and `curves.png` (`training.metrics`);
- `training_config.json`: the project config the run used.

Datasets are folders written by `datasets.Dataset.save_to_disk`, in TRL's conversational format:
- DPO: `prompt` (list of messages), `chosen` and `rejected` (each a list with one assistant message), plus
  any provenance columns (dropped before tokenisation);
- GRPO: `prompt` (list of messages) plus whatever columns the reward functions read (`gold`, `options`...):
  TRL passes every extra column to each reward function as a keyword argument (a list, one per completion);
- SFT (a warm start): `prompt` and `reference_reply` (a string, or null for a row that has none: skipped), e.g.
  the very dataset `ermedrag export grpo --questions` (respondent) or `export mmedagent` (its `triage/`) wrote, so
  one export serves both trainers.

GPU recipe (vLLM generation, bf16, several GPUs). Precision is automatic (bf16 on CUDA); pick the
distribution strategy with an accelerate config file (DDP, DeepSpeed ZeRO-2/3, or FSDP; TRL ships examples
in its repository under `examples/accelerate_configs/`):

    # one node, vLLM inside the training processes (set in the YAML: use_vllm: true, vllm_mode: colocate)
    accelerate launch --config_file deepspeed_zero2.yaml -m ermedrag train grpo --config grpo.yaml

    # or a separate vLLM server on its own GPU (use_vllm: true, vllm_mode: server,
    # vllm_server_base_url: http://HOST:8000), started first with
    CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model MODEL --port 8000
    CUDA_VISIBLE_DEVICES=1,2,3 accelerate launch --config_file fsdp.yaml --num_processes 3 \\
        -m ermedrag train grpo --config grpo.yaml

    accelerate launch --config_file ... -m ermedrag train dpo --config dpo.yaml

Only the main process writes metrics.jsonl and curves.png; TRL/accelerate handle the rest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ermedrag.tools.records.jsonl import replace_text
from ermedrag.training.checkpoints import (
    CheckpointSettings,
    check_resumable,
    checkpoint_dir,
    checkpoint_step,
    resume_checkpoint,
)
from ermedrag.training.config import (
    DPOTrainingConfig,
    GRPOTrainingConfig,
    SFTTrainingConfig,
    _TrainingConfig,
    load_config,
)
from ermedrag.training.stages import stage_model
from ermedrag.training.metrics import METRICS_FILE, PLOT_FILE, MetricsRecorder, plot_curves, zero_variance_steps
from ermedrag.training.rewards.text import RewardFunc
from ermedrag.training.rewards import RESPONDENT_REWARDS, WeightedReward, named_weights, resolve_rewards
from ermedrag.training.grpo.rollouts import RolloutFunc, make_search_rollout

CONFIG_FILE = "training_config.json"
log = logging.getLogger(__name__)

# Columns a DPO row must have; anything else is provenance and is dropped before TRL tokenises.
DPO_COLUMNS = ("prompt", "chosen", "rejected")
SFT_COLUMNS = ("prompt", "reference_reply")


def train_dpo(config: DPOTrainingConfig) -> dict[str, Any]:
    """Train with DPO on the preference pairs in `config.dataset`; return a summary of the run."""
    from trl import DPOTrainer

    dataset = _load_dataset(config.dataset)
    _require_columns(dataset, DPO_COLUMNS, f"DPO dataset {config.dataset}")
    dataset = dataset.select_columns(list(DPO_COLUMNS))

    model_path = config.model_path()
    tokenizer = _load_tokenizer(model_path)
    recorder, callbacks = _callbacks(config)
    # The model goes in by path: with LoRA the reference is the base model with the adapter disabled; without
    # it TRL loads a second copy from the same path as the frozen reference.
    trainer = DPOTrainer(
        model=model_path,
        args=config.to_trl(),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=config.lora_config(),
        callbacks=callbacks,
    )
    return _run(trainer, config, recorder, kind="dpo")


def train_sft(config: SFTTrainingConfig) -> dict[str, Any]:
    """Supervised warm start on the reference replies in `config.dataset` (rows without one are skipped); the
    loss is on the reply only. With LoRA the adapter is also merged into `OUTPUT/merged/`, the folder a GRPO
    config's `model` names to go on from it. Returns a summary of the run: `rows` trained on, `start_model`."""
    from accelerate import PartialState
    from trl import SFTTrainer

    dataset = sft_dataset(_load_dataset(config.dataset), config.dataset, config.balance_answers)
    model_path = config.model_path()
    recorder, callbacks = _callbacks(config)
    trainer = SFTTrainer(
        model=model_path,
        args=config.to_trl(),
        train_dataset=dataset,
        processing_class=_load_tokenizer(model_path),
        peft_config=config.lora_config(),
        callbacks=callbacks,
    )
    summary = _run(trainer, config, recorder, kind="sft")
    _, start_model = stage_model(config, PartialState())
    return {**summary, "rows": len(dataset), "start_model": str(start_model)}


def sft_dataset(dataset, source: str, balance_answers: bool = False):
    """TRL's conversational prompt–completion rows from the rows of `dataset` that have a reference reply; with
    `balance_answers`, as many of each gold answer (`balanced_by_gold`)."""
    _require_columns(
        dataset,
        SFT_COLUMNS,
        f"SFT dataset {source}",
        hint=" (`ermedrag export grpo --questions` and `ermedrag export mmedagent` write reference replies)",
    )
    with_reply = dataset.filter(lambda row: bool(row["reference_reply"]))
    if len(with_reply) == 0:
        raise ValueError(f"SFT dataset {source} has no row with a reference reply (all {len(dataset)} are null)")
    if balance_answers:
        with_reply = balanced_by_gold(with_reply, source)
    return with_reply.map(
        lambda row: {"completion": [{"role": "assistant", "content": row["reference_reply"]}]},
        remove_columns=[c for c in with_reply.column_names if c != "prompt"],
    )


def balanced_by_gold(dataset, source: str):
    """The rows of `dataset`, in their order, keeping of each gold answer as many as the rarest one has."""
    _require_columns(dataset, ("gold",), f"SFT dataset {source} (balance_answers)")
    positions: dict[str, list[int]] = {}
    for index, gold in enumerate(dataset["gold"]):
        positions.setdefault(str(gold), []).append(index)
    each = min(len(indices) for indices in positions.values())
    return dataset.select(sorted(i for indices in positions.values() for i in indices[:each]))


def train_grpo(config: GRPOTrainingConfig, reward_funcs: Sequence[RewardFunc] | None = None) -> dict[str, Any]:
    """Train with GRPO on the prompts in `config.dataset`; return a summary of the run.

    Rewards: `config.rewards` over the registry (`training.rewards.REWARDS`, the respondent's defaults when
    unset); or, given `reward_funcs` (TRL reward callables, each named by its `__name__`), those functions,
    weighted by name in `config.rewards` (1 when not named)."""
    if reward_funcs is None:
        rewards = resolve_rewards(config.rewards, RESPONDENT_REWARDS, settings=config.reward_settings())
    else:
        registry = _by_name(reward_funcs)
        rewards = resolve_rewards(config.rewards, dict.fromkeys(registry, 1.0), registry=registry)
    return run_grpo(config, rewards)


def run_grpo(
    config: GRPOTrainingConfig,
    rewards: Sequence[WeightedReward],
    *,
    rollout_func: RolloutFunc | None = None,
    kind: str = "grpo",
) -> dict[str, Any]:
    """Build the trainer (`build_grpo_trainer`), train, save; the summary names the rewards and their weights."""
    trainer, recorder = build_grpo_trainer(config, rewards, rollout_func=rollout_func)
    summary = _run(trainer, config, recorder, kind=kind)
    summary["reward_functions"] = list(trainer.reward_func_names)
    summary["reward_weights"] = named_weights(list(rewards))
    return summary


def build_grpo_trainer(
    config: GRPOTrainingConfig, rewards: Sequence[WeightedReward], *, rollout_func: RolloutFunc | None = None
):
    """A `trl.GRPOTrainer` for `config` and its `MetricsRecorder`: the dataset checked, the model's tokenizer,
    TRL's config with the rewards' weights, and a rollout function: `rollout_func`, else one that ends at
    `config.stop_strings` (none with vLLM, which stops by itself: `GRPOTrainingConfig.to_trl`)."""
    from ermedrag.training.grpo.sampling import SignalCountingGRPOTrainer

    dataset = _load_dataset(config.dataset)
    if "prompt" not in dataset.column_names:
        raise ValueError(f"GRPO dataset {config.dataset} has no `prompt` column; it has {dataset.column_names}")
    model_path = config.model_path()
    recorder, callbacks = _callbacks(config)
    if rollout_func is None and config.stop_strings and not config.use_vllm:
        rollout_func = make_search_rollout(
            None, end_stops=config.stop_strings, force_answer=False, step_max_new_tokens=config.max_completion_length
        )
    trainer_class, resampling = SignalCountingGRPOTrainer, {}
    if config.resample_zero_variance_batches:
        from ermedrag.training.grpo.sampling import ResamplingGRPOTrainer

        trainer_class, resampling = ResamplingGRPOTrainer, {"resample_attempts": config.resample_zero_variance_batches}
    with warnings.catch_warnings():  # rollout_func is marked experimental in TRL 1.16: said once, in training.rollouts
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
        # By path, so that beta > 0 without LoRA can rebuild the reference model (TRL reloads it from the path).
        trainer = trainer_class(
            model=model_path,
            reward_funcs=[reward.func for reward in rewards],
            args=config.to_trl(reward_weights=[reward.weight for reward in rewards]),
            train_dataset=dataset,
            processing_class=_load_tokenizer(model_path),
            peft_config=config.lora_config(),
            callbacks=callbacks,
            rollout_func=rollout_func,
            entropy_bonus_on_silent_steps=config.entropy_bonus_on_silent_steps,
            **resampling,
        )
    return trainer, recorder


def train_from_file(kind: str, config_path: str | Path) -> dict[str, Any]:
    """What `ermedrag train dpo|sft|grpo --config FILE` runs: load the YAML and train (GRPO: with its `rewards`)."""
    if kind == "dpo":
        return train_dpo(load_config(config_path, DPOTrainingConfig))
    if kind == "sft":
        return train_sft(load_config(config_path, SFTTrainingConfig))
    if kind == "grpo":
        return train_grpo(load_config(config_path, GRPOTrainingConfig))
    raise ValueError(f"unknown trainer {kind!r}: expected 'dpo', 'sft' or 'grpo'")


# --- shared pieces -----------------------------------------------------------------------------------------


def _by_name(reward_funcs: Sequence[RewardFunc]) -> dict[str, RewardFunc]:
    """Reward functions by their `__name__` (TRL's curve name), which must be unique."""
    funcs = list(reward_funcs)
    if not funcs:
        raise ValueError("train_grpo needs at least one reward function")
    by_name = {getattr(f, "__name__", type(f).__name__): f for f in funcs}
    if len(by_name) != len(funcs):
        raise ValueError(f"reward functions need distinct names (TRL names curves by them), got {list(by_name)}")
    return by_name


def _require_columns(dataset, columns: Sequence[str], what: str, hint: str = "") -> None:
    """One error naming the columns `what` lacks and the ones it has."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"{what} lacks column(s) {missing}; it has {dataset.column_names}{hint}")


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


def _callbacks(config: _TrainingConfig) -> tuple[MetricsRecorder, list[Any]]:
    """The run's metrics recorder (for a resumed run, keeping the steps up to its checkpoint) and the callbacks
    the trainer gets."""
    checkpoint = resume_checkpoint(config)
    recorder = MetricsRecorder(Path(config.output_dir) / METRICS_FILE, keep_up_to_step=checkpoint_step(checkpoint))
    return recorder, [CheckpointSettings(config, checkpoint), recorder]


def _run(trainer, config: _TrainingConfig, recorder: MetricsRecorder, *, kind: str) -> dict[str, Any]:
    output_dir = Path(config.output_dir)
    step = recorder.keep_up_to_step
    checkpoint = checkpoint_dir(output_dir, step) if step is not None else None
    started = time.perf_counter()
    train_loss = None
    if config.resume:
        check_resumable(trainer.args)
    finished = checkpoint is not None and 0 < trainer.args.max_steps <= step
    if finished:
        # finished already: train() would run one step past max_steps (transformers checks only after a step)
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise ValueError(f"this run already reached max_steps: its trained weights are in {checkpoint}")
        log.info("%s training already reached step %d in %s: saving its weights", kind, step, checkpoint)
        trainer._load_from_checkpoint(str(checkpoint))
        if trainer.is_world_process_zero():
            recorder.start()
    else:
        if checkpoint:
            log.info("resuming %s training from %s", kind, checkpoint)
        train_loss = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None).training_loss
    trainer.save_model(str(output_dir))  # the adapter with LoRA, the full model without; also the tokenizer
    summary: dict[str, Any] = {
        "trainer": kind,
        "steps": step if finished else trainer.state.global_step,
        "train_loss": train_loss,  # None when a resumed run had nothing left to train
        "wall_seconds": round(time.perf_counter() - started, 2),  # of this process: a resumed run's part
        "resumed_from_step": checkpoint_step(checkpoint),
        "output_dir": str(output_dir),
        "model_dir": str(output_dir),
        "adapter": config.use_lora,
        "metrics_path": str(output_dir / METRICS_FILE),
        "plot_path": None,
    }
    step_records = [r for r in recorder.records if "loss" in r]
    summary["final_metrics"] = step_records[-1] if step_records else {}
    silent = zero_variance_steps(step_records)
    if silent is not None:
        summary["zero_variance_steps"] = silent
        if silent["share"] > 0.5:
            log.warning(
                "%d of %d logged steps had equal rewards in every group (no learning signal): more "
                "generations, more prompts per step, a higher temperature or dynamic sampling "
                "(resample_zero_variance_batches) give groups that differ",
                silent["steps_without_signal"],
                silent["logged_steps"],
            )
    if trainer.is_world_process_zero():
        replace_text(output_dir / CONFIG_FILE, json.dumps(dataclasses.asdict(config), indent=2, default=str))
        plot = plot_curves(recorder.records, output_dir / PLOT_FILE, title=f"{kind.upper()} {Path(config.model).name}")
        summary["plot_path"] = str(plot) if plot else None
    return summary
