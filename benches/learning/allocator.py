"""GRPO step time with glibc's default allocator settings against keeping freed memory (CPU, Linux).

    .venv/bin/python benches/learning/allocator.py              # 2 pairs of 3-step runs -> results/allocator.json
    .venv/bin/python benches/learning/allocator.py --steps 5 --pairs 1

Each arm is a fresh child process running `train_grpo` on the learning bench's respondent recipe (its exported
training prompts, 4 generations at 0.7, 96 tokens, seed 0, so both arms sample the same completions), alternating
plain / keep so that a change in the machine's load hits both. `keep` sets MALLOC_MMAP_MAX_=0 and a 64 GiB
MALLOC_TRIM_THRESHOLD_: glibc then serves the large tensors (a 262k-token vocabulary's logits are ~100 MB) from
its heap and keeps freed memory for the next step, instead of mapping fresh pages for each and returning them,
which costs a page fault per page touched again. Each child reports its wall time, user and system CPU seconds
and peak RSS (`ru_maxrss` of its own process: the parent imports nothing large); wall time covers
`train_grpo` only, the CPU seconds the whole child, imports included.

Needs the learning bench's exports (`learning_signal.py` once, or `--reuse`) in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from seeds import LEARNING_WORK, allocator_env, grpo_prompts, hold_work_folder, learning_run

from ermedrag.offline import offline_env

REPO = Path(__file__).resolve().parents[2]
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30)}


def child(steps: int, run: Path, out: Path) -> None:
    """One arm: a short GRPO run; prints one RESULT line."""
    from ermedrag.tools.models.offline import offline_model_dir
    from ermedrag.training.config import GRPOTrainingConfig
    from ermedrag.training.trainers import train_grpo

    config = GRPOTrainingConfig(
        model=str(offline_model_dir()),
        dataset=str(grpo_prompts(run, "train")),
        output_dir=str(out),
        max_steps=steps,
        learning_rate=1e-4,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=96,
        temperature=0.7,
        save_steps=10_000,
        seed=0,
    )
    started = time.perf_counter()
    train_grpo(config)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        "RESULT",
        json.dumps(
            {
                "wall_s": round(time.perf_counter() - started, 1),
                "user_s": round(usage.ru_utime, 1),
                "sys_s": round(usage.ru_stime, 1),
                "peak_rss_mb": round(usage.ru_maxrss / 1024),
            }
        ),
    )


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, float]:
    callers = allocator_env()  # the plain arm runs with glibc's defaults
    inherited = {k: v for k, v in os.environ.items() if k not in callers}
    env = offline_env(KEEP_FREED_MEMORY if arm == "keep" else {}, base=inherited)
    out = learning_run(Path(args.work)) / f"allocator-{arm}"
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(args.steps), "--work", args.work, "--child-out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"the {arm} arm failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--work", default=str(LEARNING_WORK), help="learning_signal.py's --work")
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "allocator.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.pairs < 1:
        parser.error("--steps and --pairs must be at least 1")
    if args.child and not args.child_out:
        parser.error("--child needs --child-out")
    run = learning_run(Path(args.work))
    if not grpo_prompts(run, "train").exists():
        parser.error(
            f"no exported GRPO prompts at {grpo_prompts(run, 'train')}: run learning_signal.py first "
            "(or give its --work)"
        )
    if args.child:
        child(args.steps, run, Path(args.child_out))
        return
    hold_work_folder(run)  # its arms write into learning_signal.py's run folder
    runs = {"plain": [], "keep": []}
    for _ in range(args.pairs):
        for arm in runs:
            runs[arm].append(run_arm(arm, args))
            print(arm, runs[arm][-1], flush=True)
    plain_wall = sum(r["wall_s"] for r in runs["plain"])
    result = {
        "steps": args.steps,
        "pairs": args.pairs,
        "keep_env": KEEP_FREED_MEMORY,
        "runs": runs,
        "wall_ratio_plain_to_keep": round(plain_wall / sum(r["wall_s"] for r in runs["keep"]), 2),
        "command": " ".join(["python", "benches/learning/allocator.py", *sys.argv[1:]]),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
