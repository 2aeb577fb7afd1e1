"""Server parity: do the graphs' replies through a real OpenAI-compatible server match, in kind, the in-process ones?

The same questions, greedy, with the same weights: in-process `llamacpp:gemma3-270m` beside llama.cpp's own server,
in-process `offline:gemma3-270m` (transformers) beside `transformers serve` (`ermedrag.testing.real_servers`). Per
backend and graph: the share of well-formed answers, of Med-R³ runs that searched, of strict-JSON extractions, and
the share of answers equal to the in-process backend's. The target (issue 36): every server rate within 0.15 of its
in-process twin's, and Med-R³ searching through every server.

    .venv/bin/python benches/server_parity.py --data ../shared/data        # 20 MedQA questions, ~1-2 h on 2 cores
    .venv/bin/python benches/server_parity.py --n 2 --graphs cot           # a smoke run

Writes benches/results/server_parity.json (rows, settings, the machine and its load) and, beside it,
server_parity_replies.jsonl.gz: every reply behind every figure (answer, well formed, searches, extractions,
completions).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from ermedrag.evals.metrics import wilson_interval  # noqa: E402
from ermedrag.graphs.registry import load_graph  # noqa: E402
from ermedrag.testing.real_servers import IN_PROCESS_TWIN, SERVER_KINDS, real_server  # noqa: E402
from ermedrag.tools.data.benchmarks import Question, load_benchmark  # noqa: E402
from ermedrag.tools.machine import describe_machine  # noqa: E402
from ermedrag.tools.records.traces import TraceStore  # noqa: E402

GRAPHS = ("er_medrag", "med_r3", "cot")
TOLERANCE = 0.15
TWIN_NAMES = {"llamacpp:gemma3-270m": "in_process_llamacpp", "offline:gemma3-270m": "in_process_hf"}


def answer_record(graph: str, question: Question, state: dict[str, Any], store: TraceStore) -> dict[str, Any]:
    """What one question's run showed: its answer and format, its searches, its extractions, its completions."""
    answer = state.get("answer") or {}
    events = list(store.events(run_id=state["run_id"]))
    return {
        "graph": graph,
        "id": question.id,
        "gold": question.answer,
        "answer": answer.get("answer"),
        "well_formed": bool(answer.get("well_formed")),
        "searches": len(state.get("searches") or []),
        "extractions_strict": [bool(e.get("strict")) for e in state.get("extractions") or []],
        "completions": [
            {
                "agent": e["agent"],
                "completion": e["completion"],
                "stop_sequence": e.get("stop_sequence"),
                "finish_reason": e.get("finish_reason"),
            }
            for e in events
        ],
    }


def run_backend(
    graph: str, spec: str, base_url: str | None, questions: list[Question], workdir: Path, label: str
) -> list[dict[str, Any]]:
    trace_db = workdir / f"{label}-{graph}.sqlite"
    context = {
        "extractor_model": spec,
        "respondent_model": spec,
        "base_url": base_url or "",
        "temperature": 0.0,
        "trace_db": str(trace_db),
        "index_dir": "",
        "chroma_url": "",
        "request_timeout_s": 600.0,
    }
    store, records = TraceStore(trace_db), []
    for number, question in enumerate(questions, 1):
        started = time.monotonic()
        state = load_graph(graph).invoke(
            {"question": question.question, "options": question.options, "gold": question.answer}, context=context
        )
        records.append(
            answer_record(graph, question, state, store) | {"backend": label, "seconds": time.monotonic() - started}
        )
        print(f"  {label:22} {graph:10} {number}/{len(questions)} {records[-1]['seconds']:.1f} s", flush=True)
    return records


def row(label: str, graph: str, records: list[dict[str, Any]], twin: list[dict[str, Any]]) -> dict[str, Any]:
    """One backend's rates on one graph; beside a server's, the questions where only one side was well formed (the
    rates differ by exactly those, so they say how much of a gap is a few questions decoding another way)."""
    n = len(records)
    extractions = [strict for r in records for strict in r["extractions_strict"]]
    agree = sum(a["answer"] == b["answer"] for a, b in zip(records, twin))
    well_formed = sum(r["well_formed"] for r in records)
    discordant = {
        "only_this_backend": sum(a["well_formed"] and not b["well_formed"] for a, b in zip(records, twin)),
        "only_in_process": sum(b["well_formed"] and not a["well_formed"] for a, b in zip(records, twin)),
    }
    return {
        "backend": label,
        "graph": graph,
        "n": n,
        "well_formed_rate": well_formed / n,
        "well_formed_interval": wilson_interval(well_formed, n),
        **({"well_formed_discordant": discordant} if records is not twin else {}),
        "search_rate": sum(r["searches"] > 0 for r in records) / n if graph == "med_r3" else None,
        "strict_json_rate": sum(extractions) / len(extractions) if extractions else None,
        "answer_agreement_with_in_process": agree / n,
        "seconds_per_question": sum(r["seconds"] for r in records) / n,
    }


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """What misses the target: a server rate more than TOLERANCE from its twin's, or Med-R³ never searching."""
    misses = []
    twins = {(r["backend"], r["graph"]): r for r in rows if r["backend"].startswith("in_process")}
    for r in rows:
        if r["backend"].startswith("in_process"):
            continue
        twin = twins[(r["twin"], r["graph"])]
        for rate in ("well_formed_rate", "search_rate", "strict_json_rate"):
            if r[rate] is not None and abs(r[rate] - twin[rate]) > TOLERANCE:
                misses.append(f"{r['backend']} {r['graph']} {rate} {r[rate]:.2f} vs {twin[rate]:.2f} in process")
        if r["graph"] == "med_r3" and not r["search_rate"]:
            misses.append(f"{r['backend']} med_r3 never searched")
    return misses


def rows_of(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every (backend, graph)'s row from the replies, a server's beside its in-process twin's same questions."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for reply in replies:
        groups.setdefault((reply["backend"], reply["graph"]), []).append(reply)
    rows = []
    for (backend, graph), records in groups.items():
        if backend.startswith("in_process"):
            rows.append(row(backend, graph, records, records))
            continue
        twin_label = TWIN_NAMES[IN_PROCESS_TWIN[backend]]
        twin = {r["id"]: r for r in groups.get((twin_label, graph), [])}
        paired = [r for r in records if r["id"] in twin]
        rows.append(row(backend, graph, paired, [twin[r["id"]] for r in paired]) | {"twin": twin_label})
    return rows


def earlier_replies(out: Path, replies_path: Path, ran: set[tuple[str, str]]) -> tuple[list[dict], list[dict]]:
    """The replies and runs `out` holds for every (backend, graph) this run did not run."""
    before = json.loads(out.read_text())
    with gzip.open(replies_path, "rt") as handle:
        kept = [r for r in map(json.loads, handle) if (r["backend"], r["graph"]) not in ran]
    settings = before["settings"]
    runs = before.get("runs") or [
        {key: settings[key] for key in ("servers", "graphs", "n")} | {"command": before.get("command")}
    ]
    return kept, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data",
        default=os.environ.get("ERMEDRAG_SHARED_DATA"),
        help="shared data root (default: ERMEDRAG_SHARED_DATA)",
    )
    parser.add_argument("--bench", default="medqa", help="benchmark to draw the questions from")
    parser.add_argument("--n", type=int, default=20, help="questions (a seeded sample)")
    parser.add_argument("--graphs", default=",".join(GRAPHS), help="comma-separated graphs")
    parser.add_argument("--servers", default=",".join(SERVER_KINDS), help="comma-separated server kinds")
    parser.add_argument("--threads", type=int, default=None, help="threads for each server (default: its own)")
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "server_parity.json"))
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the rows (and replies) of --out for every backend and graph not run now (e.g. more questions for one)",
    )
    args = parser.parse_args()
    if not args.data:
        sys.exit("server_parity: give --data (the shared data root) or set ERMEDRAG_SHARED_DATA")
    questions = load_benchmark(args.bench, args.data, limit=args.n, seed=0)
    graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    machine, started = describe_machine(), time.monotonic()
    print(machine, flush=True)
    replies: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="server-parity-") as tmp:
        workdir = Path(tmp)
        for kind in kinds:
            with real_server(kind, workdir, threads=args.threads) as server:
                os.environ["ERMEDRAG_SERVER_TOKENIZER"] = server.tokenizer  # what a user of this server would set
                twin_label = TWIN_NAMES[server.in_process]
                for graph in graphs:
                    twin = run_backend(graph, server.in_process, None, questions, workdir, twin_label)
                    served = run_backend(graph, f"openai:{server.model}", server.base_url, questions, workdir, kind)
                    replies += twin + served
    out = Path(args.out)
    replies_path = out.with_name(out.stem + "_replies.jsonl.gz")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    runs = [
        {"servers": kinds, "graphs": graphs, "n": len(questions), "command": " ".join(sys.argv)}
        | {"commit": commit.strip() or None, "machine": machine, "minutes": (time.monotonic() - started) / 60}
    ]
    if args.append and out.exists():
        kept, earlier = earlier_replies(out, replies_path, {(r["backend"], r["graph"]) for r in replies})
        replies, runs = kept + replies, earlier + runs
    rows = rows_of(replies)
    misses = verdict(rows)
    record = {
        "rows": rows,
        "target": f"each server rate within {TOLERANCE} of its in-process twin's; med_r3 "
        f"search_rate > 0 through every server",
        "misses": misses,
        "met": not misses,
        "settings": {
            "bench": args.bench,
            "n": len(questions),
            "seed": 0,
            "graphs": graphs,
            "servers": kinds,
            "temperature": 0.0,
            "budgets": "the graphs' defaults",
            "index": "starter knowledge base",
            "threads": args.threads,
        },
        "machine": machine,
        "load_average_end": os.getloadavg(),
        "minutes": (time.monotonic() - started) / 60,
        "command": " ".join(sys.argv),
        "runs": runs,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    with gzip.open(replies_path, "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in replies)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "seconds_per_question"}))
    print("target met" if not misses else "target missed: " + "; ".join(misses))


if __name__ == "__main__":
    main()
