"""Several training seeds against one fixed before: what the learning benches report per metric.

The held-out prompts and the base model's greedy replies to them are the same for every seed (measured once), so
the spread over seeds is the training's own (LoRA initialisation, data order, sampled rollouts), not the prompts'.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ermedrag.tools.records import locks

from ermedrag.evals.metrics import wilson_interval
from ermedrag.tools.records.jsonl import replace_text
from ermedrag.training.config import SFTTrainingConfig, comparable_settings
from ermedrag.training.rewards import reward_code_sha256


def over_seeds(before: dict[str, float], afters: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Per numeric metric of `before`: its value before, and after training its mean ± sd over the seeds, each
    seed's value, and in how many seeds it ended higher than before (better for rates and rewards, not for
    lengths). A metric some seeds lack (added after they were recorded, `--first-seed`) is left out: its mean
    would be over fewer seeds than `n` says."""
    summary: dict[str, Any] = {"n": len(afters)}
    before, afters = flat(before), [flat(after) for after in afters]
    for name, value in before.items():
        values = [after[name] for after in afters if isinstance(after.get(name), (int, float))]
        if not isinstance(value, (int, float)) or not values or len(values) < len(afters):
            continue
        summary[name] = {
            "before": round(value, 4),
            "after": spread(values),
            "seeds_higher_after": sum(v > value for v in values),
        }
    return summary


def paired_over_seeds(befores: Sequence[dict[str, float]], afters: Sequence[dict[str, float]]) -> dict[str, Any]:
    """`over_seeds` for trainings that each start from their own model (a stage after a seed's earlier stage): per
    metric, before and after as mean ± sd with each seed's value, the gain after − before, and in how many seeds
    it ended higher than its own before. A metric some seeds lack is left out, as in `over_seeds`."""
    summary: dict[str, Any] = {"n": len(afters)}
    befores, afters = [flat(before) for before in befores], [flat(after) for after in afters]
    for name in befores[0]:
        pairs = [
            (b[name], a[name])
            for b, a in zip(befores, afters)
            if isinstance(b.get(name), (int, float)) and isinstance(a.get(name), (int, float))
        ]
        if not pairs or len(pairs) < len(afters):
            continue
        summary[name] = {
            "before": spread([b for b, _ in pairs]),
            "after": spread([a for _, a in pairs]),
            "gain": spread([a - b for b, a in pairs]),
            "seeds_higher_after": sum(a > b for b, a in pairs),
        }
    return summary


def part_over_seeds(runs: Sequence[dict[str, Any]], part: str, eval_prompts: int) -> dict[str, Any]:
    """One trained part (a stage, an agent) over the seeds' runs: `paired_over_seeds` of its before and after,
    and its held-out accuracy after training with a Wilson 95% interval per seed."""
    return {
        **paired_over_seeds([run[part]["before"] for run in runs], [run[part]["after"] for run in runs]),
        "accuracy_after": [accuracy_interval(run[part]["after"]["accuracy"], eval_prompts) for run in runs],
    }


def flat(metrics: dict[str, Any]) -> dict[str, Any]:
    """Nested metric groups (each reward component, how rollouts ended) as `group/name` entries beside the rest."""
    return {
        **{k: v for k, v in metrics.items() if not isinstance(v, dict)},
        **{f"{group}/{k}": v for group, inner in metrics.items() if isinstance(inner, dict) for k, v in inner.items()},
    }


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean ± sd of one metric over seeds, with each seed's value."""
    return {
        "mean": round(statistics.fmean(values), 4),
        "sd": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        "values": [round(v, 4) for v in values],
    }


def common_seed_count(seeds: dict[str, Any]) -> int:
    """The seeds every recorded part of a results file has (parts may be recorded in different runs, with
    different counts)."""
    return min(part["n"] for part in seeds.values() if isinstance(part, dict))


def accuracy_interval(accuracy: float, n: int) -> dict[str, Any]:
    """Held-out accuracy with its Wilson 95% interval (n prompts)."""
    low, high = wilson_interval(round(accuracy * n), n)
    return {"accuracy": round(accuracy, 4), "n": n, "wilson_95": [round(low, 4), round(high, 4)]}


def gain(summary: dict[str, Any], metric: str) -> dict[str, float] | None:
    """after − before of one metric, mean and sd over the seeds."""
    entry = summary.get(metric)
    if not entry:
        return None
    return {
        key: value
        for key, value in spread([v - entry["before"] for v in entry["after"]["values"]]).items()
        if key != "values"
    }


def afters_from_summary(summary: dict[str, Any], before: dict[str, float], count: int) -> list[dict[str, float]]:
    """The first `count` seeds' after-metrics read back from an earlier `over_seeds` summary, so that a later run
    can add seeds to it. Refused (ValueError) when the summary holds fewer seeds or was measured against another
    before (other prompts or another base model)."""
    if summary.get("n", 0) < count:
        raise ValueError(f"the recorded summary holds {summary.get('n', 0)} seeds, not the {count} to add to")
    entries = {
        name: entry
        for name, entry in summary.items()
        if isinstance(entry, dict) and isinstance(entry.get("after"), dict) and "values" in entry["after"]
    }
    flat_before = flat(before)
    differing = [
        name
        for name, entry in entries.items()
        if name in flat_before and round(flat_before[name], 4) != entry["before"]
    ]
    if differing:
        raise ValueError(f"the recorded seeds were measured against another before ({', '.join(differing)} differ)")
    return [{name: entry["after"]["values"][i] for name, entry in entries.items()} for i in range(count)]


RUN_FILE = "bench_run.json"  # written into a seed's folder (a merged model, a chain of stages) once it is complete
LEARNING_WORK = Path.home() / ".cache" / "ermedrag" / "bench" / "learning"  # the learning benches' --work


_HELD: dict[Path, Any] = {}  # the open lock file of each work folder this process holds, until it exits


def hold_work_folder(work: Path) -> None:
    """Claim a bench's work folder until this process exits. A second run on the same folder would delete the
    seeds this one is training, or reuse them half written: it stops at once, naming the run that holds it."""
    lock = work.parent / f"{work.name}.lock"  # beside the folder: a run without --reuse deletes the folder
    if lock.resolve() in _HELD:
        return
    try:
        handle = locks.take(lock, f"{work}, a bench's work folder,", "wait for it to finish, or pass another --work")
    except locks.Busy as err:
        raise SystemExit(str(err)) from None
    _HELD[lock.resolve()] = handle


def learning_run(work: Path, smoke: bool = False) -> Path:
    """learning_signal.py's run folder in its --work (exports, held-out prompts, trained seeds), which the other
    learning benches read: one folder for the real model, another for `--smoke`'s tiny one."""
    return work / ("smoke" if smoke else "full")


def grpo_prompts(run: Path, split: str) -> Path:
    """The respondent prompts exported from a run's recorded traces: `train` ones, or the held-out `eval` ones."""
    return run / f"grpo-{split}" / "dataset"


def training_sample(pool: Sequence[Any], held_out: Sequence[Any], first: Sequence[Any], seed: int) -> list[Any]:
    """A training seed's own questions (each with an `id`): seed 0 trains on `first` (what the earlier records
    trained on); another seed on as many drawn with a stream of its own from every question of `pool` not held
    out, so that seeds differ in what they learn from, not only in initialisation and order."""
    if seed == 0:
        return list(first)
    held = {q.id for q in held_out}
    candidates = [q for q in pool if q.id not in held]
    return random.Random(f"training sample:{seed}").sample(candidates, min(len(first), len(candidates)))


SEED_CHANGES = (
    "its own training questions (seed 0: the first ones after one seeded shuffle; another: as many drawn from every "
    "question not held out), LoRA initialisation, data order and sampled rollouts; the held-out prompts stay"
)


def record_trained(merged: Path, config: Any, run: dict[str, Any]) -> None:
    """Mark a seed's merged model (or chain of stages) complete, with the training config, the rewards it was
    trained under and what the run reported."""
    marker = {"training_config": _as_json(config), "reward_code_sha256": reward_code_sha256(), **run}
    replace_text(merged / RUN_FILE, json.dumps(marker, indent=2, default=str))


def trained_earlier(config: Any, merged: Path, rewarded: bool = True) -> dict[str, Any] | None:
    """What an earlier run recorded for a seed trained with this very config (`--reuse-trained`, `--reuse`): for a
    merged model its steps, minutes and zero-variance steps, for a chain its stages; None when the config differs,
    or (a `rewarded` training: not SFT, which reads no reward) the reward code, or the run never finished (or its
    marker)."""
    try:
        run = json.loads((merged / RUN_FILE).read_text())
    except (OSError, ValueError):  # missing, or cut short by a kill while it was written
        return None
    if not isinstance(run, dict):
        return None
    if run.pop("reward_code_sha256", None) != reward_code_sha256() and rewarded:
        return None
    return run if run.pop("training_config", None) == _as_json(config) else None


def allocator_env() -> dict[str, str]:
    """This run's glibc allocator settings: they change its minutes (benches/learning/allocator.py), not its
    results."""
    return {name: value for name, value in os.environ.items() if name.startswith(("MALLOC_", "GLIBC_TUNABLES"))}


def inputs_key(data: str, *question_ids: Sequence[str]) -> dict[str, str]:
    """What a recorded seed's questions depend on beyond its config: the data folder, and a digest of the ids of
    its training and held-out questions in order (another data folder, size or shuffle gives others)."""
    digest = hashlib.sha256(json.dumps([list(ids) for ids in question_ids]).encode()).hexdigest()[:16]
    return {"data": str(Path(data).resolve()), "question_ids": digest}


def run_or_reuse(
    folder: Path, settings: Any, run: Callable[[], dict[str, Any]], reuse: bool, rewarded: bool = True
) -> tuple[dict[str, Any], bool]:
    """One seed's training in `folder` and whether it was reused: with `reuse`, what an earlier run recorded there
    with these very settings (and, `rewarded`, reward code); else `run()` from an empty folder, recorded once it
    has finished (a run killed before that leaves no record, so `--reuse` trains it again)."""
    earlier = trained_earlier(settings, folder, rewarded) if reuse else None
    if earlier is not None:
        return earlier, True
    shutil.rmtree(folder, ignore_errors=True)
    result = run()
    folder.mkdir(parents=True, exist_ok=True)
    record_trained(folder, settings, result)
    return result, False


def sft_data_sha256(dataset: str | Path) -> str:
    """A fingerprint of what an SFT run learns: its dataset's prompts and reference replies, in order (the reward
    code's fingerprint does not apply to SFT, and a changed prompt or reference reply must train again)."""
    from datasets import load_from_disk

    rows = load_from_disk(str(dataset)).select_columns(["prompt", "reference_reply"])
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row["prompt"], row["reference_reply"]], sort_keys=True).encode())
    return digest.hexdigest()


def training_identity(config: Any, starts_from: dict[str, Any] | None = None) -> Any:
    """What decides a trained model besides the reward code: its config; for SFT the data it learns
    (`sft_data_sha256`); and `starts_from`, the identity of the trained model it starts from (a warm start
    retrained under the same path makes what follows it stale)."""
    extra = {"starts_from": starts_from} if starts_from else {}
    if isinstance(config, SFTTrainingConfig):
        extra["data_sha256"] = sft_data_sha256(config.dataset)
    return {"config": comparable_settings(config), **extra} if extra else config


def model_stamp(folder: str | Path) -> str:
    """A trained model's identity: a digest of the record its training left in `folder` (config, data, minutes:
    a model trained again differs), or of the folder's path where there is none (the base model)."""
    marker = Path(folder) / RUN_FILE
    text = marker.read_text(encoding="utf-8") if marker.exists() else f"untrained:{Path(folder).resolve()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def reads_rewards(config: Any) -> bool:
    """Whether a training's result depends on the reward code (SFT reads none)."""
    return not isinstance(config, SFTTrainingConfig)


def warm_started(training: Any, inputs: dict[str, Any], reuse: bool) -> dict[str, Any]:
    """The product's SFT (`train_sft`) with `training`, recorded in its output folder under its identity
    (`training_identity`: settings and data) and `inputs` (what its rows came from), or with `reuse` the one an
    earlier run finished with the same: the run (`model_dir`: the merged model, rows, steps, loss, minutes) and
    whether it was `reused`."""
    import time

    from ermedrag.training.trainers import train_sft

    def train() -> dict[str, Any]:
        started = time.time()
        summary = train_sft(training)
        return {
            "model_dir": summary["start_model"],
            "rows": summary["rows"],
            "steps": summary["steps"],
            "epochs": training.num_train_epochs,
            "train_loss": summary["train_loss"],
            "minutes": round((time.time() - started) / 60, 2),
        }

    key = {**training_identity(training), **inputs}
    run, reused = run_or_reuse(Path(training.output_dir), key, train, reuse, reads_rewards(training))
    return {**run, "reused": reused, "stamp": model_stamp(training.output_dir)}


def _as_json(config: Any) -> Any:
    """A training config (a dataclass, or a dict of settings around one) as JSON reads it back."""
    return json.loads(json.dumps(comparable_settings(config), default=str))
