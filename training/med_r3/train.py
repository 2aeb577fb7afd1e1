"""Med-R³ progressive RL: three GRPO stages over the reason ↔ search loop of `graphs.med_r3`, and the CLI
that builds their dataset.

    stage 1 reasoning   no retrieval       correctness + format + length
    stage 2 retrieval   search loop        retrieval hit (gold evidence found) + search format
    stage 3 joint       search loop        correctness + format + retrieval hit + search format + penalties

    from ermedrag.training.med_r3.train import train_med_r3
    summary = train_med_r3("training/configs/med_r3.yaml", stages=[1, 2, 3])   # or stages=[2]: rerun one
    # CLI: ermedrag train med-r3 --stages 1,2,3 --config training/configs/med_r3.yaml
    #      python -m ermedrag.training.med_r3.train dataset FILE.jsonl ... --out DIR   (training.med_r3_data)

Where the parts live: the configuration is `training.config.MedR3TrainingConfig`; the rollouts (the search
loop at token level, inserted documents masked out of the loss) `training.rollouts`; the rewards
`training.search_rewards` and `training.answer_rewards`, named and weighted through `training.rewards`;
the dataset `training.med_r3_data`; each stage's trainer `training.trainers.build_grpo_trainer`. Here: the
schedule (`STAGES`: whether a stage searches, its default reward weights by name), each stage's config
(`stage_overrides.N`, including `rewards: {name: weight}` on top of the stage's defaults), and the chaining.

Stages chain by merging: each stage trains a fresh LoRA adapter on the previous stage's model, saves it in
`OUTPUT/stageN/` (with `metrics.jsonl`, `curves.png`, `training_config.json`), then merges it into the
weights and saves the merged model and tokenizer in `OUTPUT/stageN/merged/`, which the next stage loads by
path (TRL's supported path: a model by path plus `peft_config`; with `beta > 0` the reference is that stage's
starting model, the adapter disabled). Without LoRA the stage's full model in `OUTPUT/stageN/` is the next
start. `OUTPUT/stageN/med_r3_stage.json` records where a stage's model is; a stage run alone starts from the
previous stage's record (an error names the missing one), and `OUTPUT/med_r3_summary.json` collects runs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ermedrag.training.med_r3.config import MedR3TrainingConfig
from ermedrag.training.config import config_from_dict, load_config
from ermedrag.training.med_r3.data import build_med_r3_dataset
from ermedrag.training.rewards import WeightedReward, resolve_rewards
from ermedrag.training.grpo.rollouts import ANSWER_STOP, SearchFn, index_search, make_search_rollout
from ermedrag.training.stages import recorded_stage_model, refuse_resume, stage_model, write_stage_record
from ermedrag.training.trainers import run_grpo

logger = logging.getLogger(__name__)

STAGE_RECORD = "med_r3_stage.json"
SUMMARY_FILE = "med_r3_summary.json"


@dataclass(frozen=True)
class Stage:
    """One stage of the schedule: whether the search loop runs, and the default reward weights by name."""

    number: int
    name: str
    search: bool
    rewards: tuple[tuple[str, float], ...]


STAGES: dict[int, Stage] = {
    1: Stage(1, "reasoning", False, (("correctness", 1.0), ("format", 0.5), ("length", 0.2))),
    2: Stage(2, "retrieval", True, (("retrieval_hit", 1.0), ("search_format", 0.5))),
    3: Stage(
        3,
        "joint",
        True,
        (("correctness", 1.0), ("format", 0.5), ("retrieval_hit", 0.5), ("search_format", 0.2), ("penalties", 1.0)),
    ),
}


def stage_rewards(
    stage: int, weights: Mapping[str, float] | None = None, *, settings: Mapping[str, Any] | None = None
) -> list[WeightedReward]:
    """The rewards of `stage`: its defaults updated by `weights` (name → weight; a new name adds that reward,
    weight 0 drops one), built with `settings` (`MedR3TrainingConfig.reward_settings()`)."""
    return resolve_rewards(weights, dict(STAGES[stage].rewards), settings=settings, where=f"stage {stage} rewards")


def _check(config: MedR3TrainingConfig, stage: int) -> None:
    if config.use_vllm:
        raise ValueError(
            "Med-R³ rollouts generate with transformers inside the rollout function; use_vllm is not "
            "supported (set use_vllm: false)"
        )
    if STAGES[stage].search and not config.index_dir:
        raise ValueError(f"stage {stage} ({STAGES[stage].name}) searches: set index_dir to a corpus index")
    stage_rewards(stage, config.rewards, settings=config.reward_settings())  # names and weights, before training


def stage_config(config: MedR3TrainingConfig, stage: int) -> MedR3TrainingConfig:
    """The config of one stage: its `stage_overrides` applied (its `rewards` become the stage config's
    `rewards`), output in `output_dir/stageN`."""
    if config.rewards is not None:
        raise ValueError(
            "Med-R³ weights rewards per stage: use stage_overrides: {N: {rewards: {name: weight}}} instead of rewards"
        )
    overrides = {str(k): v for k, v in (config.stage_overrides or {}).items()}
    unknown = sorted(set(overrides) - {str(n) for n in STAGES})
    if unknown:
        raise ValueError(f"stage_overrides has unknown stage(s) {unknown}; stages are 1, 2, 3")
    own = dict(overrides.get(str(stage)) or {})
    forbidden = sorted(set(own) & {"model", "output_dir", "stage_overrides"})
    if forbidden:
        raise ValueError(f"stage_overrides.{stage} may not set {forbidden}")
    data = {**dataclasses.asdict(config), **own, "stage_overrides": {}}
    data["output_dir"] = str(_stage_dir(config, stage))
    staged = config_from_dict(data, MedR3TrainingConfig, source=f"stage_overrides.{stage}")
    _check(staged, stage)
    refuse_resume(staged)
    return staged


def _parse_stages(stages: Iterable[int] | str) -> list[int]:
    items = stages.split(",") if isinstance(stages, str) else list(stages)
    try:
        numbers = sorted({int(str(s).strip()) for s in items if str(s).strip()})
    except ValueError:
        raise ValueError(f"stages must be numbers among 1, 2, 3, got {stages!r}") from None
    if not numbers or any(n not in STAGES for n in numbers):
        raise ValueError(f"stages must be among 1, 2, 3, got {stages!r}")
    if numbers != list(range(numbers[0], numbers[-1] + 1)):
        raise ValueError(f"stages must be consecutive (each starts from the previous one's output), got {numbers}")
    return numbers


def _stage_dir(config: MedR3TrainingConfig, stage: int) -> Path:
    return Path(config.output_dir) / f"stage{stage}"


def stage_start_model(config: MedR3TrainingConfig, stage: int) -> str:
    """Stage 1 starts from `config.model`; stage N from the model that stage N-1 recorded."""
    if stage == 1:
        return config.model_path()
    return recorded_stage_model(_stage_dir(config, stage - 1) / STAGE_RECORD, str(stage), str(stage - 1))


def train_stage(
    config: MedR3TrainingConfig, stage: int, *, logits_processor: Sequence[Any] | None = None
) -> dict[str, Any]:
    """Run one stage from the previous stage's model; write its folder; return its summary."""
    from accelerate import PartialState

    staged = stage_config(config, stage)
    spec = STAGES[stage]
    rewards = stage_rewards(stage, staged.rewards, settings=staged.reward_settings())
    rollout = make_search_rollout(
        _stage_search(staged) if spec.search else None,
        max_searches=staged.max_searches,
        step_max_new_tokens=staged.step_max_new_tokens,
        max_total_tokens=staged.max_completion_length,
        logits_processor=logits_processor,
        end_stops=staged.stop_strings or (ANSWER_STOP,),
    )
    start_model = stage_start_model(config, stage)
    staged.model = start_model  # the trainer loads it; also recorded in training_config.json and the plot title
    summary = run_grpo(staged, rewards, rollout_func=rollout, kind=f"med-r3 stage{stage}")
    gc.collect()  # the trainer is gone: free its memory before the merge loads the model again
    process = PartialState()
    output_dir, model_dir = stage_model(staged, process)
    summary.update(
        stage=stage,
        name=spec.name,
        search=spec.search,
        start_model=start_model,
        model_dir=str(model_dir),
        adapter_dir=str(output_dir) if staged.use_lora else None,
    )
    write_stage_record(
        output_dir / STAGE_RECORD,
        summary,
        (
            "stage",
            "name",
            "search",
            "start_model",
            "model_dir",
            "adapter_dir",
            "steps",
            "reward_functions",
            "reward_weights",
        ),
        process,
    )
    return summary


def _stage_search(config: MedR3TrainingConfig) -> SearchFn:
    """The search the stage's rollouts run: the graph's search over `config.index_dir`."""
    from ermedrag.tools.retrieval.index import cached_index

    index = cached_index(str(Path(config.index_dir).expanduser()), config.chroma_url or None)
    return index_search(index, k=config.search_k, coarse_k=config.coarse_k)


def train_med_r3(
    config: MedR3TrainingConfig | str | os.PathLike[str],
    stages: Iterable[int] | str = (1, 2, 3),
    *,
    logits_processor: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Run the given stages in order (consecutive, among 1, 2, 3), each from the previous stage's model.

    `config` is a `MedR3TrainingConfig` or the path of its YAML file. `logits_processor` (transformers
    LogitsProcessors) constrains rollout sampling in every stage. Returns `{"stages": {N: summary},
    "final_model": path}` and updates `output_dir/med_r3_summary.json`."""
    if not isinstance(config, MedR3TrainingConfig):
        config = load_config(config, MedR3TrainingConfig)
    numbers = _parse_stages(stages)
    for n in numbers:
        stage_config(config, n)  # every stage's settings are checked before the first one trains
    results: dict[int, dict[str, Any]] = {}
    for n in numbers:
        logger.info("Med-R³ stage %d (%s)", n, STAGES[n].name)
        results[n] = train_stage(config, n, logits_processor=logits_processor)
    summary_path = Path(config.output_dir) / SUMMARY_FILE
    previous = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    merged = {**previous.get("stages", {}), **{str(n): s for n, s in results.items()}}
    final_model = results[numbers[-1]]["model_dir"]
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(
        json.dumps({"stages": merged, "final_model": final_model}, indent=2, default=str), encoding="utf-8"
    )
    return {"stages": results, "final_model": final_model}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ermedrag.training.med_r3.train dataset FILE.jsonl ... --out DIR [--qrels Q] [--corpus-dir C] [--limit N]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ermedrag.training.med_r3.train", description="Med-R³ training data (training.med_r3_data)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("dataset", help="build a Med-R³ GRPO dataset from question JSONL files")
    build.add_argument("paths", nargs="+", help="questions in the shared schema (pubmedqa_train.jsonl, ...)")
    build.add_argument("--out", required=True, help="dataset folder to write (datasets.load_from_disk)")
    build.add_argument("--qrels", help="bioasq_qrels.jsonl (needed for BioASQ files)")
    build.add_argument("--corpus-dir", help="corpora folder holding pubmedqa_contexts.jsonl.gz (exact PubMedQA ids)")
    build.add_argument("--limit", type=int, help="questions sampled per file")
    build.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = build_med_r3_dataset(
        args.paths, args.out, qrels=args.qrels, corpus_dir=args.corpus_dir, limit=args.limit, seed=args.seed
    )
    print(json.dumps(counts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
