"""The reliability bench: every hostile case against the product's public surfaces, each outcome classified.

    .venv/bin/python -m benches.reliability.reliability            # full run → benches/results/reliability.json
    .venv/bin/python -m benches.reliability.reliability --quick    # CI's subset (in-process, < 1 min)
    .venv/bin/python -m benches.reliability.reliability --only servers --out /tmp/r.json --list

Run it from the repository root (the scripted models are `benches.reliability.*` and `tests.*` modules).

Surfaces: the graphs by `graph.invoke` (registry `ermedrag.graphs.registry.GRAPHS`), the `ermedrag` CLI (in
process through `ermedrag.cli.main`, or as a real process where a kill, a timeout or raw argv bytes need one),
`ermedrag.tools.retrieval.corpus.read_documents`, `ermedrag.tools.retrieval.index.build_index` / `open_index`, and the parsers of
`ermedrag.agents.*` and `ermedrag.training.*`.

Each case declares what correct looks like (`expect`) and gets one outcome:

| outcome | meaning |
|---|---|
| ok | the expected correct result |
| clear_error | an expected refusal: a user-facing exception naming the field/file/URL, or CLI exit != 0 with one error line naming it and no traceback |
| silent_wrong | wrong without saying so: a forged or changed answer, ok disagreeing with error, undefused document markup in a prompt, input accepted that must be refused, a failed run recorded as unfinished, a question counted twice |
| crash | an unexpected exception or traceback, a refusal where an answer was expected, an error that does not name what is wrong |
| hang | past the case's time bound (the runner abandons the case), later than the bound its timeouts × retries promise, or a parser not linear on its input (over 250 ms of CPU on 1 MB, or over 8x the time of a quarter MB) |
| data_lost | something recorded or indexed lost or inconsistent: chunks not covering a document, BM25 / Chroma / manifest counts that disagree, an index that no longer opens after a kill, a recorded answer that differs from the returned one, a finished model call made again on resume |

Rule for failed runs (servers): the trace run of a question whose model server failed must be marked failed with
its error (`TraceStore.fail_run`); a run left `unfinished` (what a killed or still-running run looks like) is
`silent_wrong`, because the record says something untrue rather than losing something.

Each case runs in a thread of this process with a hard time limit; a case past it is recorded as `hang` and
abandoned (subprocesses are always started with their own timeouts). Results: one row per case,
`{"case", "category", "expect", "outcome", "seconds", "detail"}`, and the counts per outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from benches.reliability import harness
from benches.reliability.harness import CASES, FAILURES, OUTCOMES, Case, Verdict, Workspace

CASE_MODULES = (
    "cases_parsers",
    "cases_inputs",
    "cases_documents",
    "cases_medr3",
    "cases_servers",
    "cases_protocol",
    "cases_indexing",
    "cases_durable",
    "cases_misc",
    "cases_across_runs",
)
DEFAULT_OUT = harness.REPO / "benches" / "results" / "reliability.json"


def load_cases() -> list[Case]:
    import importlib

    if not CASES:
        for name in CASE_MODULES:
            importlib.import_module(f"benches.reliability.{name}")
    return list(CASES)


def run_case(case: Case, workspace: Workspace, stdout: Any, stderr: Any) -> dict[str, Any]:
    """One case in a worker thread with a hard limit; its row."""
    box: dict[str, Verdict] = {}

    def target() -> None:
        try:
            box["verdict"] = case.run(workspace)
        except BaseException as err:  # noqa: BLE001 - a case that raises is a crash of what it called
            frames = traceback.extract_tb(err.__traceback__)
            where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
            box["verdict"] = harness.crash(f"{harness.error_text(err)}{where}")

    started = time.perf_counter()
    worker = threading.Thread(target=target, name=f"case-{case.name}", daemon=True)
    worker.start()
    worker.join(case.timeout_s)
    seconds = time.perf_counter() - started
    if worker.is_alive():
        # Abandoned: a case stuck inside a redirected CLI call would keep our output; take it back.
        sys.stdout, sys.stderr = stdout, stderr
        verdict = harness.hang(f"no result after {case.timeout_s:.0f} s; abandoned")
    else:
        verdict = box["verdict"]
    return {
        "case": case.name,
        "category": case.category,
        "expect": case.expect,
        "outcome": verdict.outcome,
        "seconds": round(seconds, 3),
        "detail": verdict.detail,
    }


def summarise(rows: list[dict[str, Any]], quick: bool, seconds: float) -> dict[str, Any]:
    counts = Counter(row["outcome"] for row in rows)
    return {
        "cases": len(rows),
        **{outcome: counts.get(outcome, 0) for outcome in OUTCOMES},
        "quick": quick,
        "seconds": round(seconds, 1),
        "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the quick cases (what CI runs)")
    parser.add_argument(
        "--out",
        default=None,
        help=f"result JSON (default {DEFAULT_OUT.relative_to(harness.REPO)}; --quick writes none unless given)",
    )
    parser.add_argument("--only", default=None, help="comma-separated substrings of case names or categories")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workspace (its path is printed)")
    args = parser.parse_args(argv)

    cases = [c for c in load_cases() if c.quick or not args.quick]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        cases = [c for c in cases if any(w in c.name or w == c.category for w in wanted)]
    if args.list:
        for case in cases:
            print(f"{case.category:10} {'quick' if case.quick else 'full ':5} {case.name}: {case.expect}")
        return 0
    out = Path(args.out) if args.out else (None if args.quick else DEFAULT_OUT)

    root = Path(tempfile.mkdtemp(prefix="ermedrag-reliability-"))
    workspace = Workspace(root)
    harness.prepare_environment(workspace)
    stdout, stderr = sys.stdout, sys.stderr
    print(f"{len(cases)} cases; workspace {root}", flush=True)
    started = time.perf_counter()
    rows = []
    for case in cases:
        row = run_case(case, workspace, stdout, stderr)
        rows.append(row)
        mark = "FAIL" if row["outcome"] in FAILURES else "    "
        print(
            f"{mark} {row['outcome']:12} {row['seconds']:7.2f}s  {case.category}/{case.name}  "
            f"{harness.one_line(row['detail'], 160)}",
            file=stdout,
            flush=True,
        )
        if out:  # written as it goes: an interrupted run keeps what it measured
            _write(out, summarise(rows, args.quick, time.perf_counter() - started))
    summary = summarise(rows, args.quick, time.perf_counter() - started)
    if out:
        _write(out, summary)
    counts = ", ".join(f"{name}={summary[name]}" for name in OUTCOMES)
    print(
        f"{summary['cases']} cases: {counts} ({summary['seconds']:.0f} s)" + (f"; wrote {out}" if out else ""),
        file=stdout,
        flush=True,
    )
    if args.keep:
        print(f"workspace kept: {root}", file=stdout, flush=True)
    else:
        shutil.rmtree(root, ignore_errors=True)
    failed = sum(summary[name] for name in FAILURES)
    stdout.flush()
    stderr.flush()
    # Abandoned (hung) cases may still hold threads or servers: leave without waiting for them.
    os._exit(1 if failed else 0)


def _write(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=1, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    if not __package__:
        sys.exit("run it from the repository root as: python -m benches.reliability.reliability [--quick]")
    sys.exit(main())
