"""Option-position bias of the offline model: how much an answer depends on where the right option stands.

    ERMEDRAG_SHARED_DATA=../shared/data ermedrag eval --system cot --bench all --limit 20 --concurrency 8 \\
        --max-new-tokens 128 --permute-options 2 --out benches/results/eval_offline_limit20
    .venv/bin/python benches/position_bias.py benches/results/eval_offline_limit20   # → results/position_bias.json

Reads the results folder of an eval run with `--permute-options N` (each question asked with its options in N
cyclic orders, answers mapped back to option text) and records, per configuration and per benchmark, what
`evals.position_bias` computes: accuracy per order, consistency (the share of questions whose chosen option text
is the same in every order) beside two references — a uniform random guesser, whose expected consistency is
(1/k)^(N-1) for k options, and a model that always picks the same letter, whose consistency is 0 — and the
distribution of chosen letter positions against gold positions (total variation distance).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from ermedrag.evals.position_bias import position_bias_summary  # noqa: E402
from ermedrag.evals.runner import RESULTS  # noqa: E402
from ermedrag.tools.records.jsonl import read_records  # noqa: E402

CANNOT_SHOW = (
    "Cyclic shifts only: every option moves by the same offset, so a preference between two specific "
    "texts that always stay neighbours is not separated from position. A question whose options have "
    "an order of their own ('all of the above', 'both A and B', yes/no/maybe) changes meaning when "
    "rotated. With greedy decoding consistency measures position dependence; at temperature > 0 it "
    "would also count sampling noise. Twenty questions a benchmark give intervals of about ±20 "
    "points: per-benchmark differences between orders are not evidence."
)


def describe(summary: dict[str, Any], references: dict[str, float | None]) -> str:
    """One sentence per configuration: what the figures show."""
    by_order = ", ".join(f"order {o['order']} {100 * o['accuracy']:.1f}% (n={o['n']})" for o in summary["by_order"])
    consistency = summary["consistency"]
    positions = summary["positions"]
    top = max(positions["chosen"].items(), key=lambda item: item[1]) if positions["chosen"] else ("–", 0)
    share = top[1] / positions["n"] if positions["n"] else 0.0
    rate, guesser = consistency["rate"], references["random"]
    return (
        f"{summary['system']} · {summary['model']}: accuracy {by_order}; the same option text in every order "
        f"for {consistency['consistent']} of {consistency['questions']} questions ("
        f"{'–' if rate is None else f'{100 * rate:.0f}%'}; a uniform random guesser: "
        f"{'–' if guesser is None else f'{100 * guesser:.0f}%'}, a fixed letter: 0%); "
        f"it chose letter {top[0]} in {100 * share:.0f}% of its answers (total variation distance from the gold "
        f"positions {positions['total_variation']:.3f})."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a results folder of `ermedrag eval --permute-options N`")
    parser.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "position_bias.json")
    args = parser.parse_args(argv)
    rows = list(read_records(args.results / RESULTS))
    summary = position_bias_summary(rows)
    if summary is None:
        print(
            f"{args.results}: no question was asked in another order (run the eval with --permute-options N)",
            file=sys.stderr,
        )
        return 2
    by_benchmark: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_benchmark[row["benchmark"]].append(row)
    random_ref = {key: _random_reference([r for r in rows if r["config_key"] == key]) for key in summary}
    record = {
        "results": str(args.results),
        "rows": len(rows),
        "configurations": summary,
        "by_benchmark": {bench: position_bias_summary(group) for bench, group in sorted(by_benchmark.items())},
        "references": {
            key: {"random_guesser_consistency": value, "fixed_letter_consistency": 0.0}
            for key, value in random_ref.items()
        },
        "shows": [describe(s, {"random": random_ref[key]}) for key, s in summary.items()],
        "cannot_show": CANNOT_SHOW,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    print("\n".join(record["shows"]))
    print(f"wrote {args.out}")
    return 0


def _random_reference(rows: list[dict[str, Any]]) -> float | None:
    """Mean over questions of (1/k)^(N-1) for k options asked in N orders."""
    units = {
        (r.get("benchmark"), r.get("question_id")): (int(r.get("options_count") or 0), int(r.get("orders") or 1))
        for r in rows
    }
    values = [(1 / k) ** (n - 1) for k, n in units.values() if k > 1 and n > 1]
    return sum(values) / len(values) if values else None


if __name__ == "__main__":
    raise SystemExit(main())
