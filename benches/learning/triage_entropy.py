"""Does TRL's entropy bonus raise the policy's entropy on the offline model, and from which γ? (issue 39, part 7)

The triage stage of `mmedagent_learning.py` (the same labelled questions, split, rows, rewards and schedule)
trained once per γ in `--gammas` and once with γ = 0, every run from the same base model with the same training
seed, data and order: step 1 samples the same rollouts in every run, so the per-step difference of TRL's logged
mean token entropy (H_γ − H_0, paired by step) is the bonus's doing. Beside it, each run's held-out triage
(accuracy, the share of its most common reply: a bonus that keeps a policy from collapsing shows there) with the
bench's baselines. The triage is the cheapest stage to sweep (≈ 280-token prompts, 64-token replies); the bench's
own ablation (`--entropy-stage`) compares one γ on an attending stage.

    .venv/bin/python benches/learning/triage_entropy.py            # γ 0.1, 0.3, 1 and 0: ≈ 9 min a γ on 2 cores

The bonus acts as the trainer applies it: only on steps with a reward signal (`entropy_bonus_on_silent_steps`
false, the default; each run records the steps it was held on), or on every step with `--entropy-on-silent-steps`
(TRL's rule).

Writes `benches/results/triage_entropy.json`, a plot beside it and the held-out replies (`triage_entropy_replies/`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mmedagent_learning as bench  # noqa: E402

DEFAULT_GAMMAS = (0.1, 0.3, 1.0)
ATTENDING_ONLY = (  # the bench's settings that describe its other parts, not this sweep
    "steps",
    "reliabilities",
    "eval_rows_by_bucket",
    "attending_gold_positions",
    "attending_tokens",
    "entropy_stage",
    "estimated_minutes_2_cores",
)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """This sweep's own options, and the bench's (`mmedagent_learning.parse_args`) that the runs share."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gammas", default=",".join(f"{g:g}" for g in DEFAULT_GAMMAS), help="γ values, besides 0")
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps a run")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO group)")
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "ermedrag" / "bench" / "triage_entropy"))
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "triage_entropy.json"))
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--model", default="offline:gemma3-270m")
    parser.add_argument(
        "--entropy-on-silent-steps",
        action="store_true",
        help="the bonus on steps without a reward signal too (TRL's rule, as the first sweep ran); by default the "
        "trainer's: only on steps with a signal (GRPOTrainingConfig.entropy_bonus_on_silent_steps)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny random model and sizes: checks the pipeline")
    args = parser.parse_args(argv)
    try:
        gammas = [float(g) for g in str(args.gammas).split(",") if g.strip()]
    except ValueError:
        parser.error(f"--gammas must be numbers separated by commas, got {args.gammas!r}")
    if not gammas or not all(0 < g < math.inf for g in gammas) or len(set(gammas)) < len(gammas):
        parser.error(f"--gammas must be distinct finite numbers above 0 (γ = 0 always runs), got {args.gammas!r}")
    if min(args.steps, args.generations) < 1:
        parser.error("--steps and --generations must be at least 1")
    args.gammas = [0.0, *gammas]
    shared = ["--data", args.data, "--model", args.model, "--parts", "triage"]
    shared += ["--triage-steps", str(args.steps), "--generations", str(args.generations)]
    bench_args = bench.parse_args([*shared, *(["--smoke"] if args.smoke else [])])
    if args.smoke:
        bench_args.triage_steps = args.steps = min(args.steps, 2)
    return args, bench_args


def paired_difference(with_bonus: Sequence[float], without_bonus: Sequence[float]) -> dict[str, Any]:
    """H_γ − H_0 step by step (as many steps as both logged): each difference, their mean and sd, and on how many
    steps the bonus's run had the higher entropy."""
    diffs = [round(a - b, 5) for a, b in zip(with_bonus, without_bonus)]
    return {
        "by_step": diffs,
        "mean": round(statistics.fmean(diffs), 5) if diffs else None,
        "sd": round(statistics.stdev(diffs), 5) if len(diffs) > 1 else None,
        "steps_higher": sum(d > 0 for d in diffs),
        "steps": len(diffs),
    }


def gamma_run(gamma: float, config, model_path: str, data, bench_args: argparse.Namespace, work: Path) -> dict:
    """The triage stage trained with entropy bonus γ; its per-step entropy and held-out triage."""
    from ermedrag.training.mmedagent.train import stage_config

    overrides = dict(config.stage_overrides)
    overrides["triage"] = {**overrides["triage"], "entropy_coef": gamma}
    seeded = dataclasses.replace(config, output_dir=str(work / f"train-gamma-{gamma:g}"), stage_overrides=overrides)
    summary = bench.run_stage(seeded, "triage", data.stage_rows["triage"])
    staged = stage_config(seeded, "triage")
    after = bench.evaluate_triage(summary["model_dir"], data.eval_triage, staged, bench_args, f"gamma{gamma:g}_after")
    bench.log(f"γ {gamma:g}: {json.dumps(after)}")
    return {
        "gamma": gamma,
        "entropy_by_step": bench.logged_series(summary["metrics_path"]),
        "bonus_held_by_step": bench.logged_series(summary["metrics_path"], "entropy_bonus_held"),
        "after": after,
        "minutes": summary["minutes"],
    }


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(6, 4))
    for run in runs:
        series = run["entropy_by_step"]
        axis.plot(range(1, len(series) + 1), series, marker="o", label=f"γ = {run['gamma']:g}")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set(xlabel="GRPO step", ylabel="mean token entropy (nats)", title="Triage GRPO: same start, data and seed")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    args, bench_args = parse_args(argv)
    started = time.time()
    folder = bench.benchmarks_dir(args.data)
    if folder is None:
        print(f"triage_entropy: skipped: the shared data is not at {args.data}; pass --data", file=sys.stderr)
        return 0
    from seeds import hold_work_folder

    from ermedrag.tools.machine import describe_machine
    from ermedrag.tools.models.hf import apply_torch_threads
    from ermedrag.training.mmedagent.train import stage_config

    apply_torch_threads()  # the trainers do not read ERMEDRAG_TORCH_THREADS; the hf backend does
    at_start = describe_machine()
    work = Path(args.work) / ("smoke" if args.smoke else "full")
    hold_work_folder(work)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "triage_entropy.json" if args.smoke else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bench_args.replies_dir = str(out.with_name(out.stem + "_replies"))
    model_path = bench.policy_model(args.smoke, args.model, work)
    data = bench.prepare_data(bench_args, folder, work / "export")
    config = bench.bench_config(bench_args, model_path, work / "export", work / "train")
    config = dataclasses.replace(config, entropy_bonus_on_silent_steps=args.entropy_on_silent_steps)
    before = bench.evaluate_triage(model_path, data.eval_triage, stage_config(config, "triage"), bench_args, "before")
    runs = [gamma_run(gamma, config, model_path, data, bench_args, work) for gamma in args.gammas]
    baselines = bench.triage_baselines(
        data.eval_questions, [r["prompt"] for r in data.eval_triage], list(data.eval_triage[0]["specialties"])
    )
    without = runs[0]["entropy_by_step"]
    result = {
        "before": before,
        "baselines": baselines,
        "runs": [{**run, "paired_difference": paired_difference(run["entropy_by_step"], without)} for run in runs[1:]],
        "without_bonus": runs[0],
        "settings": {
            **{k: v for k, v in bench.bench_settings(bench_args, config, data).items() if k not in ATTENDING_ONLY},
            "triage_steps": args.steps,
            "gammas": args.gammas,
            "pairing": "same base model, training seed, export and order; γ the only difference",
        },
        "seconds": round(time.time() - started, 1),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": at_start,
        "command": " ".join(
            ["python", "benches/learning/triage_entropy.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    plot(runs, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    bench.log(f"wrote {out} ({result['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
