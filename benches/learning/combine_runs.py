"""Combine runs of one learning arm that each measured their own before into one record of paired seeds.

`learning_signal.py --first-seed` adds seeds to a record only against the very same before, which only the same
traces on the same kind of CPU give (benches/README: seeds and the CPU). A run on another machine records its own
traces, prompts and before; its seeds still measure the same recipe, each against the before of its own run. This
joins such runs, as `seeds.paired_over_seeds` does for stages: per metric, before and after as mean ± sd over the
seeds (each seed paired with its own run's before), the gain, and in how many seeds it rose. The spread then
includes the prompts' variation between runs as well as the seeds'.

    python benches/learning/combine_runs.py --key grpo_respondent_tokens_192 \\
        --into benches/results/learning_grpo_levers.json /path/to/other_run/learning_grpo_levers.json

The arm's settings (steps, sampling, budget, rewards, prompt counts, model) must agree in every run; each run
keeps its own before, seeds' afters, CPU, command and minutes under `runs`. A combined record can take more runs,
and a run it holds that `--first-seed` has since grown (the same before, its seeds and more): the grown one
replaces it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from seeds import accuracy_interval, afters_from_summary, common_seed_count, paired_over_seeds

from ermedrag.tools.records.jsonl import replace_text

# What each run measures for itself; every other field of an arm's record is a setting all runs must share.
PER_RUN_FIELDS = (
    "before",
    "after",
    "minutes",
    "reused_seeds",
    "command",
    "cpu",
    "zero_variance_steps",
    "pairs",
    "pair_composition",
)
SUMMARY_PER_SEED = ("zero_variance_share",)


class CombineError(ValueError):
    pass


def runs_of(record: dict[str, Any], summary: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The runs one file holds of the arm: a combined record's own, or its single run with its seeds' afters."""
    if "runs" in record:
        return record["runs"]
    try:
        afters = afters_from_summary(summary, record["before"], summary.get("n", 0))
    except (KeyError, ValueError) as err:
        raise CombineError(f"{where}: its seeds cannot be read back against its own before ({err})") from None
    extra = {name: summary[name] for name in SUMMARY_PER_SEED if name in summary}
    return [{**{k: v for k, v in record.items() if k in PER_RUN_FIELDS and k != "after"}, "afters": afters, **extra}]


def settings_of(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in PER_RUN_FIELDS and k != "runs"}


def combine(records: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(The arm's combined record, its seeds summary) from (where, record, seeds summary) of each file."""
    settings = settings_of(records[0][1])
    for where, record, _ in records[1:]:
        differing = sorted(k for k in settings.keys() | settings_of(record).keys() if settings.get(k) != record.get(k))
        if differing:
            raise CombineError(f"{where} trained another recipe: {', '.join(differing)} differ from {records[0][0]}'s")
    runs = distinct_runs([run for where, record, summary in records for run in runs_of(record, summary, where)])
    befores = [run["before"] for run in runs for _ in run["afters"]]
    afters = [after for run in runs for after in run["afters"]]
    summary: dict[str, Any] = {
        **paired_over_seeds(befores, afters),
        "runs": [{"cpu": run.get("cpu", "(not recorded)"), "seeds": len(run["afters"])} for run in runs],
    }
    prompts = settings.get("eval_prompts")
    if prompts and all("accuracy" in before for before in befores):
        summary["accuracy_before"] = [accuracy_interval(run["before"]["accuracy"], prompts) for run in runs]
        summary["accuracy_after"] = [accuracy_interval(after["accuracy"], prompts) for after in afters]
    for name in SUMMARY_PER_SEED:
        if all(name in run for run in runs):
            summary[name] = [value for run in runs for value in run[name]]
    return {**settings, "runs": runs}, summary


def distinct_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per recorded run. Runs measured against the same before come from the same traces, hence the same
    recording: the same file given twice, or a run `--first-seed` grew (its afters begin with the other's), which
    replaces the shorter in its place. Anything else would count a seed twice, and is refused."""
    by_before: dict[str, dict[str, Any]] = {}
    for run in runs:
        before = json.dumps(run["before"], sort_keys=True)
        known = by_before.setdefault(before, run)
        if known is run:
            continue
        shorter, longer = sorted((known, run), key=lambda r: len(r["afters"]))
        if shorter["afters"] == longer["afters"]:
            raise CombineError("a run is given twice (the same before and afters): its seeds would count twice")
        if longer["afters"][: len(shorter["afters"])] != shorter["afters"]:
            raise CombineError(
                "two runs measured against the same before hold different seeds: they are one "
                "recording, to grow with learning_signal.py --first-seed, not to combine"
            )
        by_before[before] = longer
    return list(by_before.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--key", required=True, help="the arm's key, e.g. grpo_respondent_tokens_192")
    parser.add_argument("--into", type=Path, required=True, help="results JSON that holds the arm and gets the result")
    parser.add_argument("runs", type=Path, nargs="+", help="results JSON files with other runs of the arm")
    args = parser.parse_args(argv)
    files = [args.into, *args.runs]
    try:
        results = [json.loads(path.read_text(encoding="utf-8")) for path in files]
        records = []
        for path, result in zip(files, results):
            seeds = result.get("seeds") if isinstance(result, dict) else None
            if not (
                isinstance(seeds, dict)
                and isinstance(result.get(args.key), dict)
                and isinstance(seeds.get(args.key), dict)
            ):
                raise CombineError(f"{path} holds no arm {args.key!r} with its seeds")
            records.append((str(path), result[args.key], result["seeds"][args.key]))
        record, summary = combine(records)
    except (OSError, json.JSONDecodeError, CombineError) as err:
        print(f"combine_runs: {err}", file=sys.stderr)
        return 2
    except (KeyError, IndexError, TypeError, AttributeError) as err:  # a field missing or of another kind
        print(
            f"combine_runs: a record of {args.key!r} is not as learning_signal.py writes it "
            f"({type(err).__name__}: {err}); nothing written",
            file=sys.stderr,
        )
        return 2
    into = results[0]
    into[args.key] = record
    into["seeds"][args.key] = summary
    into["seeds"]["n"] = common_seed_count(into["seeds"])
    replace_text(args.into, json.dumps(into, indent=2) + "\n")
    print(
        f"{args.into}: {args.key} now holds {summary['n']} seeds from {len(record['runs'])} runs "
        f"({', '.join(run['cpu'] for run in summary['runs'])})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
