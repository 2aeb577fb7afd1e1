"""Conformal answer sets on held-out questions: does the set hold the right option at least 1 − α of the time?

Per system and benchmark, `ermedrag eval` answers `--n-calibration + --n-test` questions (option probabilities
read where the answer is written: `answer_scores`, the default); a seeded shuffle splits them into disjoint
calibration and test questions; `evals.conformal.fit` sets the threshold on the calibration questions for each α
and the sets are scored on the test questions: coverage, mean set size, singleton share. The same is done over
`--splits` random splits of the same answers, and coverage is judged on their mean (target ≥ 1 − α − 0.03): the
guarantee is over the calibration draw too, and one split of 200 + 200 questions wanders about ±0.03 around it.
Beside them: accuracy, the always-the-modal-answer baseline, and the risk–coverage AURC against random abstention.

    .venv/bin/python -m benches.conformal --data ../shared/data                     # the recorded run (hours)
    .venv/bin/python -m benches.conformal --data ../shared/data --n-calibration 10 --n-test 10 --systems cot

Writes benches/results/conformal.json and, beside it, conformal_replies.jsonl.gz: every answer behind the figures
(its option probabilities and the completions of its run). A rerun continues the eval folders under --work.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ermedrag.evals.conformal import conformal_threshold, coverage, nonconformity, risk_coverage, scored_rows
from ermedrag.evals.runner import RESULTS, run_eval
from ermedrag.tools.data.benchmarks import load_benchmark
from ermedrag.tools.machine import describe_machine
from ermedrag.tools.records.jsonl import read_records
from ermedrag.tools.records.traces import TraceStore

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.03  # coverage may fall this far below 1 − α (the guarantee is marginal, the test set finite)
REPLY_FIELDS = ("benchmark", "question_id", "gold", "answer", "correct", "option_probs", "confidence", "run_id")


def split(rows: list[dict[str, Any]], n_calibration: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint calibration and test questions, by a seeded shuffle of the question ids."""
    ordered = sorted(rows, key=lambda r: r["question_id"])
    random.Random(seed).shuffle(ordered)
    return ordered[:n_calibration], ordered[n_calibration:]


def modal_share(rows: list[dict[str, Any]]) -> float:
    """Accuracy of always giving the test set's most common gold option: what a constant answer gets."""
    counts = Counter(r["gold"] for r in rows)
    return max(counts.values()) / len(rows) if rows else float("nan")


def split_sets(scored: list[dict[str, Any]], alpha: float, n_calibration: int, seed: int) -> dict[str, Any]:
    """One split: the threshold fitted on its calibration questions, the sets' figures on its test questions."""
    calibration, test = split(scored, n_calibration, seed)
    threshold = conformal_threshold([nonconformity(r["option_probs"], r["gold"]) for r in calibration], alpha)
    return {"threshold": threshold, "calibration": calibration, "test": test} | coverage(test, threshold)


def figures(
    rows: list[dict[str, Any]], alphas: list[float], n_calibration: int, seed: int, splits: int
) -> list[dict[str, Any]]:
    """One row per α: the seeded split's threshold and sets (`coverage`, `mean_set_size`, ...), and the same over
    `splits` random splits of the same answered questions (`over_splits`). The guarantee is marginal, over the
    calibration draw as well as the test questions: one split of 200 + 200 questions varies by about ±0.03
    around it, so whether coverage holds is judged on the mean over the splits (`coverage_holds`); the seeded
    split's own coverage is kept beside it."""
    scored = scored_rows(rows)
    out = []
    for alpha in alphas:
        first = split_sets(scored, alpha, n_calibration, seed)
        others = [split_sets(scored, alpha, n_calibration, seed + k) for k in range(splits)]
        spread = {
            name: {"mean": statistics.fmean(s[name] for s in others), "sd": statistics.pstdev(s[name] for s in others)}
            for name in ("coverage", "mean_set_size", "singleton_rate")
        }
        test, curve = first["test"], risk_coverage(first["test"]) or {}
        out.append(
            {
                "alpha": alpha,
                "n_calibration": len(first["calibration"]),
                "n_test": first["n"],
                "unscored": len(rows) - len(scored),
                "threshold": first["threshold"],
                "coverage": first["coverage"],
                "coverage_holds": spread["coverage"]["mean"] >= 1 - alpha - TOLERANCE,
                "over_splits": {"splits": splits, **spread},
                "mean_set_size": first["mean_set_size"],
                "singleton_rate": first["singleton_rate"],
                "mean_options": sum(len(r["option_probs"]) for r in test) / len(test) if test else float("nan"),
                "accuracy": sum(bool(r.get("correct")) for r in test) / len(test) if test else float("nan"),
                "modal_answer_share": modal_share(test),
                "aurc": curve.get("aurc"),
                "aurc_random": curve.get("random_aurc"),
            }
        )
    return out


def drawn_ids(benchmark: str, args: argparse.Namespace) -> set[str]:
    """The questions this run draws: a --work folder reused with other sizes holds answers to others too."""
    questions = load_benchmark(benchmark, args.data, limit=args.n_calibration + args.n_test, seed=args.seed)
    return {q.id for q in questions}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started, load_before = time.time(), os.getloadavg()
    rows, replies = [], []
    for system in args.systems:
        out_dir = Path(args.work) / system
        run_eval(
            [system],
            args.benchmarks,
            args.model,
            out_dir,
            data_dir=args.data,
            limit=args.n_calibration + args.n_test,
            seed=args.seed,
            concurrency=args.concurrency,
            trace_db=str(out_dir / "traces.sqlite"),
            index_dir=args.index_dir,
        )
        answered = [r for r in read_records(out_dir / RESULTS) if (r.get("config") or {}).get("system") == system]
        for benchmark in args.benchmarks:
            drawn = drawn_ids(benchmark, args)
            mine = [r for r in answered if r.get("benchmark") == benchmark and r.get("question_id") in drawn]
            for row in figures(mine, args.alphas, args.n_calibration, args.seed, args.splits):
                rows.append({"system": system, "benchmark": benchmark, **row})
            replies += [{"system": system} | {key: r.get(key) for key in REPLY_FIELDS} for r in mine]
        store = TraceStore(out_dir / "traces.sqlite")
        for reply in replies:
            if reply["system"] == system:
                reply["completions"] = [
                    {"agent": e["agent"], "completion": e["completion"]} for e in store.events(run_id=reply["run_id"])
                ]
    return {
        "rows": rows,
        "target": f"coverage (mean over {args.splits} random splits) >= 1 - alpha - {TOLERANCE} at every alpha on "
        "every benchmark",
        "met": all(r["coverage_holds"] for r in rows),
        "settings": {
            "model": args.model,
            "systems": args.systems,
            "benchmarks": args.benchmarks,
            "n_calibration": args.n_calibration,
            "n_test": args.n_test,
            "seed": args.seed,
            "splits": args.splits,
            "concurrency": args.concurrency,
            "index_dir": args.index_dir or "the default (the starter knowledge base)",
            "graph settings": "the defaults otherwise (answer_scores on)",
        },
        "machine": describe_machine(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "seconds": round(time.time() - started, 1),
        "_replies": replies,
    }


def appended(
    before: dict[str, Any], now: dict[str, Any], replies_path: Path, replies: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`now` after the rows and replies of the systems it did not run; each run's settings and load kept."""
    mine = set(now["settings"]["systems"])
    rows = [r for r in before["rows"] if r["system"] not in mine] + now["rows"]
    runs = [run for run in before.get("runs", [before]) if set(run["settings"]["systems"]) - mine]
    runs = [{key: run[key] for key in ("settings", "load_average", "seconds")} for run in runs]
    runs.append({key: now[key] for key in ("settings", "load_average", "seconds")})
    with gzip.open(replies_path, "rt") as f:
        kept = [r for r in map(json.loads, f) if r["system"] not in mine]
    merged = {"rows": rows, "target": now["target"], "met": all(r["coverage_holds"] for r in rows)}
    return merged | {"runs": runs, "machine": now["machine"]}, kept + replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA"), help="the shared data folder")
    parser.add_argument("--model", default="llamacpp:gemma3-270m", help="every agent's model (default: %(default)s)")
    parser.add_argument("--systems", type=lambda s: s.split(","), default=["cot", "er_medrag"])
    parser.add_argument("--benchmarks", type=lambda s: s.split(","), default=["medqa", "medmcqa", "mmlu_med"])
    parser.add_argument("--alphas", type=lambda s: [float(a) for a in s.split(",")], default=[0.1, 0.2])
    parser.add_argument("--n-calibration", type=int, default=200)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--index-dir", default=None, help="the retrieving systems' index (default: the graph's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--splits", type=int, default=200, help="random calibration/test splits averaged over")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--work", default=str(REPO / "benches" / "results" / "conformal_work"))
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "conformal.json"))
    parser.add_argument(
        "--append", action="store_true", help="keep the rows (and replies) of other systems already in --out"
    )
    args = parser.parse_args()
    if not args.data:
        parser.error("no data: pass --data or set ERMEDRAG_SHARED_DATA (the benchmarks are read from there)")
    result = run(args)
    replies = result.pop("_replies")
    out = Path(args.out)
    replies_path = out.with_name(out.stem + "_replies.jsonl.gz")
    seconds, load = result["seconds"], result["load_average"]
    if args.append and out.exists():
        result, replies = appended(json.loads(out.read_text()), result, replies_path, replies)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    with gzip.open(replies_path, "wt") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in replies)
    for row in result["rows"]:
        print(
            f"{row['system']:>10} {row['benchmark']:>9} α={row['alpha']:.1f}  coverage "
            f"{row['over_splits']['coverage']['mean']:.3f} ± {row['over_splits']['coverage']['sd']:.3f} over splits, "
            f"{row['coverage']:.3f} on the seeded one (≥ {1 - row['alpha'] - TOLERANCE:.2f}: {row['coverage_holds']})  "
            f"set size {row['mean_set_size']:.2f} "
            f"of {row['mean_options']:.1f}  singletons {row['singleton_rate']:.2f}  accuracy {row['accuracy']:.3f}"
        )
    print(f"target met: {result['met']}  (this run {seconds:.0f}s, load {load})")
    if args.work.startswith(str(REPO / "benches" / "results")) and not os.environ.get("KEEP_WORK"):
        shutil.rmtree(args.work, ignore_errors=True)  # the replies file keeps what the figures rest on


if __name__ == "__main__":
    main()
