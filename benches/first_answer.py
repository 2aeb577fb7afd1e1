"""The first answer a user sees: `ermedrag demo` on the offline default, an earlier checkout beside this one.

    git worktree add ../before 1d541a5 && (cd ../before && python3 -m venv .venv && \\
        .venv/bin/pip install -c constraints.txt torch==2.13.0 && .venv/bin/pip install -c constraints.txt -e '.[offline]')
    .venv/bin/python benches/first_answer.py --before ../before --data ../shared/data     # ≈ 30 min on 2 cores
    .venv/bin/python benches/first_answer.py --before ../before --runs 1 --quality 0      # the timings only

Both sides run what a user types, `ermedrag demo`, each from its own checkout and virtual environment, in fresh
processes, alternating (before, after, before, after, ...) so that both see the same machine; a first run of each,
not counted, converts the offline model and builds the starter index (a second run is what the issue compares).
Each side writes its runs to its own trace and checkpoint databases. Per run: the wall time, the per-stage and setup
times the command prints, and the process's peak RSS (from `wait4`, this process's child alone).

Quality on the same questions (`--quality N` MedQA questions, a seeded sample): each side's ER-MedRAG graph with
its defaults on the starter knowledge base, as the demo runs it; the extractor's strict-JSON rate and the
respondent's well-formed rate, with Wilson 95% intervals, and every answer and extraction kept in
`results/first_answer_replies.jsonl.gz`.

Writes results/first_answer.json: {"before": {...}, "after": {...}, "ratio": after wall / before wall, "quality"}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ermedrag.evals.metrics import wilson_interval
from ermedrag.offline import offline_env
from ermedrag.tools.data.benchmarks import load_benchmark
from ermedrag.tools.machine import describe_machine

REPO = Path(__file__).resolve().parents[1]
SIDES = ("before", "after")
TIMINGS = re.compile(r"^Timings: (.*)$", re.MULTILINE)
SETUP = re.compile(r"^Setup: ([\d.]+)s \((.*)\)$", re.MULTILINE)
ANSWER = re.compile(r"^Answer: (\S+)\s+\(parsed=(\w+), well-formed=(\w+)\)", re.MULTILINE)
LOADING = re.compile(r"^loading model (\S+)", re.MULTILINE)

# Run by each side's own interpreter: only what both checkouts have (the graph, its context schema, its state's keys).
QUALITY_SCRIPT = """
import json, sys
from ermedrag.graphs.er_medrag import graph
rows = []
for q in json.load(open(sys.argv[1])):
    state = graph.invoke({"question": q["question"], "options": q["options"]}, context=graph.context_schema())
    answer = state.get("answer") or {}
    rows.append({"id": q["id"], "gold": q["gold"], "answer": answer.get("answer"), "reasoning": answer.get("reasoning"),
                 "well_formed": bool(answer.get("well_formed")), "extractions": state.get("extractions") or []})
json.dump(rows, open(sys.argv[2], "w"))
"""


def side_env(work: Path, side: str) -> dict[str, str]:
    """The user's environment, offline, with this side's own trace and checkpoint databases."""
    env = offline_env()
    for name in [n for n in env if n.startswith("ERMEDRAG_") and n not in ("ERMEDRAG_HOME", "ERMEDRAG_SHARED_DATA")]:
        env.pop(name)  # the defaults, as a user has them
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's Python keeps compiled modules: the warm-up writes them
    env["ERMEDRAG_TRACE_DB"] = str(work / f"{side}-traces.sqlite")
    env["ERMEDRAG_CHECKPOINT_DB"] = str(work / f"{side}-checkpoints.sqlite")
    return env


def run_demo(checkout: Path, env: dict[str, str], work: Path) -> dict[str, Any]:
    """One `ermedrag demo` in a fresh process: wall time, what it printed of its stages, its peak RSS (reaped with
    `wait4`, so that the figure is this child's own, not the largest of every child so far)."""
    load = os.getloadavg()[0]
    stdout_path, stderr_path = work / "demo.out", work / "demo.err"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [str(checkout / ".venv" / "bin" / "ermedrag"), "demo"], cwd=checkout, env=env, stdout=stdout, stderr=stderr
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    out, err = stdout_path.read_text(), stderr_path.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"first_answer: `ermedrag demo` in {checkout} failed (exit {proc.returncode}):\n{err[-3000:]}")
    peak_mb = usage.ru_maxrss / 1024  # kilobytes on Linux
    return {"wall_s": round(wall, 3), "peak_rss_mb": round(peak_mb), "load_average_1min": round(load, 2)} | printed(
        out, err
    )


def printed(stdout: str, stderr: str) -> dict[str, Any]:
    """The stage times (`Timings:`), the setup (`Setup:`, where the side prints it), the answer and the model."""
    out: dict[str, Any] = {}
    timings = TIMINGS.search(stdout)
    if timings:
        out["stages_s"] = {
            name: float(value.rstrip("s")) for name, value in (part.split("=") for part in timings.group(1).split(", "))
        }
    setup = SETUP.search(stdout)
    if setup:
        parts = dict(part.rsplit("=", 1) for part in setup.group(2).split(", "))
        out["setup_s"] = float(setup.group(1))
        out["setup_parts_s"] = {name: float(value.rstrip("s")) for name, value in parts.items()}
    answer = ANSWER.search(stdout)
    if answer:
        out["answer"], out["well_formed"] = answer.group(1), answer.group(3) == "True"
    model = LOADING.search(stderr)
    out["model"] = model.group(1) if model else None
    return out


def timed_runs(checkouts: dict[str, Path], work: Path, runs: int) -> dict[str, list[dict[str, Any]]]:
    """A warm-up run of each side (not counted), then `runs` rounds, the sides alternating which goes first."""
    envs = {side: side_env(work, side) for side in SIDES}
    for side in SIDES:
        print(f"warm-up: {side}", flush=True)
        run_demo(checkouts[side], envs[side], work)
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for number in range(runs):
        for side in SIDES if number % 2 == 0 else SIDES[::-1]:
            results[side].append(run_demo(checkouts[side], envs[side], work))
            print(f"run {number + 1}/{runs} {side}: {results[side][-1]['wall_s']:.1f} s", flush=True)
    return results


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs (stages and setup parts too), with every run kept."""
    stages = {name: statistics.median(r["stages_s"][name] for r in runs) for name in runs[0].get("stages_s", {})}
    out: dict[str, Any] = {
        "model": runs[0]["model"],
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "stages_s": stages,
        "runs": runs,
    }
    if "setup_s" in runs[0]:
        out["setup_s"] = statistics.median(r["setup_s"] for r in runs)
        out["setup_parts_s"] = {
            name: statistics.median(r["setup_parts_s"][name] for r in runs) for name in runs[0]["setup_parts_s"]
        }
    return out


def quality(checkouts: dict[str, Path], work: Path, data: str, n: int) -> tuple[dict[str, Any], list[dict]]:
    """Each side's graph on the same questions: strict-JSON extractions and well-formed replies."""
    questions = [
        {"id": q.id, "question": q.question, "options": q.options, "gold": q.answer}
        for q in load_benchmark("medqa", data, limit=n, seed=0)
    ]
    (work / "questions.json").write_text(json.dumps(questions))
    figures, replies = {}, []
    for side in SIDES:
        print(f"quality: {side} on {len(questions)} questions", flush=True)
        out = work / f"{side}-quality.json"
        subprocess.run(
            [
                str(checkouts[side] / ".venv" / "bin" / "python"),
                "-c",
                QUALITY_SCRIPT,
                str(work / "questions.json"),
                out,
            ],
            cwd=checkouts[side],
            env=side_env(work, side),
            check=True,
        )
        rows = json.loads(out.read_text())
        figures[side] = rates(rows)
        replies += [{"side": side, **row} for row in rows]
    return figures, replies


def rates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    extractions = [bool(e.get("strict")) for row in rows for e in row["extractions"]]
    well_formed = [row["well_formed"] for row in rows]
    return {
        "questions": len(rows),
        "extractions": len(extractions),
        "strict_json_rate": sum(extractions) / len(extractions),
        "strict_json_interval": wilson_interval(sum(extractions), len(extractions)),
        "well_formed_rate": sum(well_formed) / len(well_formed),
        "well_formed_interval": wilson_interval(sum(well_formed), len(well_formed)),
        "accuracy": sum(row["answer"] == row["gold"] for row in rows) / len(rows),
    }


def commit(checkout: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout of the earlier commit, with its own .venv")
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA"), help="shared data (quality)")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (each side once a round)")
    parser.add_argument("--quality", type=int, default=40, help="MedQA questions for the quality figures (0: none)")
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "first_answer.json"))
    args = parser.parse_args()
    checkouts = {"before": Path(args.before).resolve(), "after": REPO}
    for side, checkout in checkouts.items():
        if not (checkout / ".venv" / "bin" / "ermedrag").exists():
            parser.error(f"{side}: {checkout} has no .venv/bin/ermedrag (install it first; see the docstring)")
    if args.quality and not args.data:
        parser.error("the quality figures need the shared data: --data or ERMEDRAG_SHARED_DATA (or --quality 0)")
    machine, load_before = describe_machine(), os.getloadavg()
    print(machine, flush=True)
    with tempfile.TemporaryDirectory(prefix="first-answer-") as tmp:
        runs = timed_runs(checkouts, Path(tmp), args.runs)
        figures, replies = quality(checkouts, Path(tmp), args.data, args.quality) if args.quality else ({}, [])
    result = {side: {"commit": commit(checkouts[side])} | summary(runs[side]) for side in SIDES}
    result["ratio"] = round(result["after"]["wall_s"] / result["before"]["wall_s"], 3)
    result["quality"] = figures
    result |= {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if replies:
        with gzip.open(out.with_name(out.stem + "_replies.jsonl.gz"), "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in replies)
    for side in SIDES:
        r = result[side]
        print(
            f"{side:6} {r['commit']} {r['model']}: {r['wall_s']:.1f} s  stages {r['stages_s']}  setup {r.get('setup_s')}"
        )
    print(f"ratio {result['ratio']}  quality {json.dumps(figures)}")


if __name__ == "__main__":
    main()
