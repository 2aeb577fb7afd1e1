"""MMedAgent-RL training (arXiv 2506.00555): GRPO for the triage doctor, then the attending physician's curriculum.

    from ermedrag.training.mmedagent.train import train_mmedagent
    summary = train_mmedagent("training/configs/mmedagent.yaml", stages="triage,easy,medium,hard")
    # CLI: ermedrag export mmedagent --out data/mmedagent/export --data ../shared/data   (training.mmedagent_data)
    #      ermedrag train mmedagent --config training/configs/mmedagent.yaml --stages triage,easy,medium,hard

Only the triage doctor and the attending are trained; the specialists are frozen (their opinions are frozen in
the attending's recorded prompts). The schedule (`STAGES`), each stage GRPO with `num_generations` samples per
prompt (8), reward 1·correct + 0.5·format (`reward: paper`) or its gated variant (`reward: gated`):

    stage      policy     data                      starts from                  γ (entropy)   β (KL)
    triage     triage     triage/ (gold specialty)   model                        0             1e-3
    easy       attending  easy/    (s = 1)           attending_start or model     1e-4          1e-3
    medium     attending  medium/  (0 < s < 1)       easy's model                 5e-3          4e-3
    hard       attending  hard/    (s = 0)           medium's model               3e-2          1e-2
    attending  attending  all three, shuffled        attending_start or model     5e-3          4e-3
                                                     (the stage of curriculum: false)

s is the share of specialists that gave the gold answer. γ and β of easy/medium/hard are the paper's; the triage
stage's (no entropy bonus, the smallest KL) and the no-curriculum stage's (the medium stage's) are ours. Every
value is configurable: `beta` / `entropy_coef` for all stages, `stage_overrides.NAME.{beta, entropy_coef}` for
one, `entropy_bonus: false` for γ = 0 everywhere (ablation), `adaptive_entropy: true` for TRL's adaptive
controller (Skywork-OR1: γ starts at the stage's value and follows `entropy_target`).

The entropy bonus is TRL's own (`GRPOConfig.entropy_coef`, TRL ≥ 1.16): the loss becomes L_GRPO − γ·H̄, H̄ the
mean per-token entropy over the completion tokens, computed from the same forward pass as the policy loss.

Rewards (curves `rewards/<function>/mean`), by config name:

| name | function | used by |
|---|---|---|
| `triage_correctness_ungated` | `triage_rewards.triage_correctness_reward`: the specialty parsed from the reply (`agents.triage.parse_triage`) is `gold_specialty` | triage, paper |
| `triage_correctness` | `triage_rewards.well_formed_triage_correctness_reward`: the same, in a well-formed reply only | triage, gated |
| `correctness_ungated` | `answer_rewards.correctness_reward`: the answer is `gold` | attending, paper |
| `correctness` | `answer_rewards.well_formed_correctness_reward`: the same, in a well-formed reply only | attending, gated |
| `triage_format` | `triage_rewards.triage_format_reward`: well formed, and the answer names one of the listed specialties (weight 0.5; the paper's is the tags alone, which the 270M model earned by copying the worked example's unlisted specialty) | triage |
| `format` | `answer_rewards.format_reward`: one `<think>…</think>` then one `<answer>…</answer>` (weight 0.5) | attending |
| `length` | `answer_rewards.length_penalty` (not used by default) | both |

Stages chain as in `training.med_r3`: each trains a fresh LoRA adapter on its start model, saves it in
`OUTPUT/NAME/`, merges it into `OUTPUT/NAME/merged/` (`training.stages.merge_adapter`) and records where its
model is in `OUTPUT/NAME/mmedagent_stage.json`; a later stage run alone starts from that record.
`OUTPUT/mmedagent_summary.json` names the trained triage and attending models.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import random
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ermedrag.tools.records.jsonl import read_records
from ermedrag.training.mmedagent.config import MMedAgentTrainingConfig
from ermedrag.training.config import config_from_dict, load_config, resolve_model
from ermedrag.training.stages import recorded_stage_model, refuse_resume, stage_model, write_stage_record
from ermedrag.training.rewards import REWARDS, WeightedReward, resolve_rewards
from ermedrag.training.trainers import run_grpo

logger = logging.getLogger(__name__)

STAGE_RECORD = "mmedagent_stage.json"
SUMMARY_FILE = "mmedagent_summary.json"
COMBINED_DATASET = "train_dataset"  # the no-curriculum stage's buckets, shuffled together
Role = Literal["triage", "attending"]


# -------------------------------------------------------------------------------------------- rewards


# The rewards (of the one registry, `training.rewards.REWARDS`) that read each role's rows: a triage row has a gold
# specialty, an attending row a gold answer.
ROLE_REWARD_NAMES: dict[Role, tuple[str, ...]] = {
    "triage": ("triage_correctness", "triage_correctness_ungated", "triage_format", "format", "length"),
    "attending": ("correctness", "correctness_ungated", "format", "length"),
}
# The triage's format is `triage_format` (tags, and an answer naming a listed specialty) in both modes: the paper's
# tag-only format let the offline model earn it by copying the worked example's unlisted specialty.
REWARD_MODES: dict[str, dict[Role, dict[str, float]]] = {
    "paper": {
        "triage": {"triage_correctness_ungated": 1.0, "triage_format": 0.5},
        "attending": {"correctness_ungated": 1.0, "format": 0.5},
    },
    "gated": {
        "triage": {"triage_correctness": 1.0, "triage_format": 0.5},
        "attending": {"correctness": 1.0, "format": 0.5},
    },
}


# ------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Stage:
    """One stage: the policy it trains, the export folders it reads, the stage whose model it starts from (None:
    the base model), and its default entropy coefficient γ and KL coefficient β."""

    name: str
    role: Role
    buckets: tuple[str, ...]
    after: str | None
    entropy_coef: float
    beta: float


STAGES: dict[str, Stage] = {
    "triage": Stage("triage", "triage", ("triage",), None, 0.0, 1e-3),
    "easy": Stage("easy", "attending", ("easy",), None, 1e-4, 1e-3),
    "medium": Stage("medium", "attending", ("medium",), "easy", 5e-3, 4e-3),
    "hard": Stage("hard", "attending", ("hard",), "medium", 3e-2, 1e-2),
    "attending": Stage("attending", "attending", ("easy", "medium", "hard"), None, 5e-3, 4e-3),
}
CURRICULUM = ("triage", "easy", "medium", "hard")
NO_CURRICULUM = ("triage", "attending")
# Settings that hold for the whole schedule: a stage may not change them.
NOT_PER_STAGE = (
    "model",
    "output_dir",
    "stage_overrides",
    "curriculum",
    "attending_start",
    "entropy_bonus",
    "adaptive_entropy",
)


def schedule(config: MMedAgentTrainingConfig) -> tuple[str, ...]:
    return CURRICULUM if config.curriculum else NO_CURRICULUM


def parse_stages(config: MMedAgentTrainingConfig, stages: Iterable[str] | str | None) -> list[str]:
    """The stages to run, in schedule order: the whole schedule when None; the attending's curriculum stages
    must be consecutive (each starts from the previous one's model)."""
    order = schedule(config)
    if stages is None:
        return list(order)
    items = stages.split(",") if isinstance(stages, str) else list(stages)
    names = {str(s).strip().lower() for s in items if str(s).strip()}
    unknown = sorted(names - set(order))
    if not names or unknown:
        other = (
            "curriculum: false trains the attending in one stage, 'attending'"
            if config.curriculum is False
            else "'attending' is the stage of curriculum: false"
        )
        raise ValueError(
            f"stages must be among {', '.join(order)} (curriculum: {str(config.curriculum).lower()}; "
            f"{other}), got {stages!r}"
        )
    chosen = [name for name in order if name in names]
    chain = [order.index(n) for n in chosen if STAGES[n].role == "attending"]
    if chain and chain != list(range(chain[0], chain[-1] + 1)):
        raise ValueError(
            f"the attending's stages must be consecutive (each starts from the previous one's model), "
            f"got {', '.join(chosen)}"
        )
    return chosen


def _stage_dir(config: MMedAgentTrainingConfig, name: str) -> Path:
    return Path(config.output_dir) / name


def stage_sources(config: MMedAgentTrainingConfig, name: str) -> list[Path]:
    """The export folders (`OUT/BUCKET/`) a stage trains on."""
    return [Path(config.dataset) / bucket for bucket in STAGES[name].buckets]


def combines_buckets(config: MMedAgentTrainingConfig, name: str) -> bool:
    """Whether the stage trains on several buckets combined (the no-curriculum stage, without its own dataset)."""
    own = (config.stage_overrides or {}).get(name) or {}
    return len(STAGES[name].buckets) > 1 and "dataset" not in own


def _number(value: Any, where: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a number, got {value!r}") from None


def _scheduled(own: Mapping[str, Any], config: MMedAgentTrainingConfig, key: str, default: float) -> float:
    """A stage's β or γ: its own override, else the config's value for every stage, else the schedule's."""
    if own.get(key) is not None:
        return own[key]
    value = getattr(config, key)
    return default if value is None else value


def stage_config(config: MMedAgentTrainingConfig, name: str) -> MMedAgentTrainingConfig:
    """The config of one stage: `stage_overrides.NAME` applied, β and γ resolved, output in `output_dir/NAME`,
    dataset the stage's export folder (`dataset/BUCKET/dataset`; the no-curriculum stage: the buckets combined
    in `output_dir/attending/train_dataset`, written by `train_stage`)."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
    if config.rewards is not None:
        raise ValueError(
            "MMedAgent weights rewards per stage: use reward: paper|gated, and stage_overrides: "
            "{NAME: {rewards: {name: weight}}} instead of rewards"
        )
    if config.reward not in REWARD_MODES:
        raise ValueError(f"reward must be one of {', '.join(REWARD_MODES)}, got {config.reward!r}")
    if config.adaptive_entropy and not config.entropy_bonus:
        raise ValueError("adaptive_entropy: true needs the entropy bonus (entropy_bonus: true)")
    overrides = {str(k): v for k, v in (config.stage_overrides or {}).items()}
    unknown = sorted(set(overrides) - set(STAGES))
    if unknown:
        raise ValueError(f"stage_overrides has unknown stage(s) {unknown}; stages are {', '.join(STAGES)}")
    own = dict(overrides.get(name) or {})
    forbidden = sorted(set(own) & set(NOT_PER_STAGE))
    if forbidden:
        raise ValueError(f"stage_overrides.{name} may not set {forbidden} (they hold for every stage)")
    stage = STAGES[name]
    entropy_coef = _scheduled(own, config, "entropy_coef", stage.entropy_coef)
    if not config.entropy_bonus:
        explicit = own.get("entropy_coef") if own.get("entropy_coef") is not None else config.entropy_coef
        if explicit is not None and _number(explicit, f"stage_overrides.{name}.entropy_coef") != 0:
            raise ValueError(
                f"entropy_bonus: false sets γ = 0 in every stage, but entropy_coef is {explicit!r} for "
                f"stage {name}: remove one of them"
            )
        entropy_coef = 0.0
    data = {
        **dataclasses.asdict(config),
        **own,
        "stage_overrides": {},
        "output_dir": str(_stage_dir(config, name)),
        "beta": _scheduled(own, config, "beta", stage.beta),
        "entropy_coef": entropy_coef,
    }
    if "dataset" not in own:
        data["dataset"] = str(
            _stage_dir(config, name) / COMBINED_DATASET
            if combines_buckets(config, name)
            else stage_sources(config, name)[0] / "dataset"
        )
    staged = config_from_dict(data, MMedAgentTrainingConfig, source=f"stage_overrides.{name}")
    stage_rewards(staged, name)  # names and weights checked before training
    refuse_resume(staged)
    return staged


def stage_rewards(staged: MMedAgentTrainingConfig, name: str) -> list[WeightedReward]:
    """A stage's rewards: its role's defaults under `reward` (paper|gated), updated by the stage's `rewards`."""
    role = STAGES[name].role
    registry = {reward: REWARDS[reward] for reward in ROLE_REWARD_NAMES[role]}
    return resolve_rewards(
        staged.rewards,
        REWARD_MODES[staged.reward][role],
        registry=registry,
        settings=staged.reward_settings(),
        where=f"stage {name} rewards",
    )


def stage_start_model(config: MMedAgentTrainingConfig, name: str) -> str:
    """triage: `model`; the attending's first stage: `attending_start` or `model`; a later stage: the model the
    previous stage recorded."""
    stage = STAGES[name]
    if stage.after is None:
        return (
            resolve_model(config.attending_start)
            if stage.role == "attending" and config.attending_start
            else config.model_path()
        )
    return recorded_stage_model(_stage_dir(config, stage.after) / STAGE_RECORD, name, stage.after)


def _check_data(config: MMedAgentTrainingConfig, name: str, staged: MMedAgentTrainingConfig) -> None:
    """The stage's data exists (before the first stage trains): an error names the folder and what to run."""
    if not combines_buckets(config, name):
        if not Path(staged.dataset).is_dir():
            raise FileNotFoundError(
                f"stage {name} trains on {staged.dataset}, which does not exist: export the runs first (`ermedrag "
                f"export mmedagent --out {config.dataset}`); a bucket the runs never reached has no folder (then run "
                "fewer stages with --stages)"
            )
    elif not any((source / "data.jsonl").is_file() for source in stage_sources(config, name)):
        raise FileNotFoundError(
            f"stage {name} trains on {', '.join(str(s) for s in stage_sources(config, name))}: "
            f"none has a data.jsonl; export the runs first (`ermedrag export mmedagent`)"
        )


def combine_buckets(sources: Sequence[Path], out: Path, seed: int) -> int:
    """The rows of every bucket (`data.jsonl` of each export folder; a missing bucket adds none), shuffled with
    `seed`, saved as a dataset in `out`; returns the row count. Rows are plain dicts, so buckets whose option
    keys differ still make one schema."""
    from datasets import Dataset

    rows = [row for source in sources for row in read_records(source / "data.jsonl")]
    if not rows:
        raise ValueError(f"no rows in {', '.join(str(s / 'data.jsonl') for s in sources)}")
    random.Random(seed).shuffle(rows)
    if out.exists():
        shutil.rmtree(out)
    Dataset.from_list(rows).save_to_disk(str(out))
    return len(rows)


# ------------------------------------------------------------------------------------------- training


def train_stage(config: MMedAgentTrainingConfig, name: str) -> dict[str, Any]:
    """Run one stage from its start model; write its folder (adapter, merged model, record); return its summary."""
    from accelerate import PartialState

    staged = stage_config(config, name)
    stage = STAGES[name]
    process = PartialState()
    if combines_buckets(config, name):
        if process.is_main_process:
            combine_buckets(stage_sources(config, name), Path(staged.dataset), staged.seed)
        process.wait_for_everyone()
    start_model = stage_start_model(config, name)
    staged.model = start_model  # the trainer loads it; also recorded in training_config.json and the plot title
    rewards = stage_rewards(staged, name)
    summary = run_grpo(staged, rewards, kind=f"mmedagent {name}")
    gc.collect()  # the trainer is gone: free its memory before the merge loads the model again
    output_dir, model_dir = stage_model(staged, process)
    summary.update(
        stage=name,
        role=stage.role,
        start_model=start_model,
        model_dir=str(model_dir),
        adapter_dir=str(output_dir) if staged.use_lora else None,
        dataset=staged.dataset,
        entropy_coef=staged.entropy_coef if staged.entropy_bonus else 0.0,
        beta=staged.beta,
        adaptive_entropy=staged.adaptive_entropy,
        reward=staged.reward,
    )
    write_stage_record(
        output_dir / STAGE_RECORD,
        summary,
        (
            "stage",
            "role",
            "start_model",
            "model_dir",
            "adapter_dir",
            "dataset",
            "steps",
            "reward_functions",
            "reward_weights",
            "entropy_coef",
            "beta",
            "adaptive_entropy",
            "reward",
        ),
        process,
    )
    return summary


def train_mmedagent(
    config: MMedAgentTrainingConfig | str | os.PathLike[str], stages: Iterable[str] | str | None = None
) -> dict[str, Any]:
    """Run the given stages (None: the whole schedule) in schedule order, each from its start model.

    `config` is a `MMedAgentTrainingConfig` or the path of its YAML file. Every stage's settings and data are
    checked before the first one trains. Returns `{"stages": {NAME: summary}, "triage_model": path | None,
    "attending_model": path | None}` and updates `output_dir/mmedagent_summary.json`."""
    if not isinstance(config, MMedAgentTrainingConfig):
        config = load_config(config, MMedAgentTrainingConfig)
    names = parse_stages(config, stages)
    for name in names:
        _check_data(config, name, stage_config(config, name))
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        logger.info("MMedAgent stage %s (%s policy)", name, STAGES[name].role)
        results[name] = train_stage(config, name)
    summary_path = Path(config.output_dir) / SUMMARY_FILE
    previous = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    merged = {**previous.get("stages", {}), **results}
    latest = {
        role: next(
            (results[n]["model_dir"] for n in reversed(names) if STAGES[n].role == role), previous.get(f"{role}_model")
        )
        for role in ("triage", "attending")
    }
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(
        json.dumps(
            {"stages": merged, "triage_model": latest["triage"], "attending_model": latest["attending"]},
            indent=2,
            default=str,
        ),
        encoding="utf-8",
    )
    return {"stages": results, "triage_model": latest["triage"], "attending_model": latest["attending"]}
