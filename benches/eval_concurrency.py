"""How busy `ermedrag eval` keeps an inference server.

Against a real local OpenAI-compatible server whose replies take a fixed time t, N questions at
concurrency C ideally finish in N·(calls per question)·t / C. We report ideal / measured (1.0 = the server
never waits for the runner), and the same ratio for a plain sequential loop over the graph, in one run.

    .venv/bin/python benches/eval_concurrency.py            # writes benches/results/eval_concurrency.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from ermedrag.tools.data.benchmarks import Question  # noqa: E402
from ermedrag.evals.rows import EvalConfig
from ermedrag.evals.runner import run_questions  # noqa: E402
from ermedrag.graphs.registry import load_graph  # noqa: E402
from ermedrag.tools.machine import describe_machine  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(delay: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benches" / "fixed_delay_server.py"), "--port", str(port), "--delay", str(delay)],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=1)
            return proc, f"{url}/v1"
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("fixed-delay server did not start")


def synthetic_questions(n: int) -> list[Question]:
    # Content does not matter to throughput; the system under test is the runner.
    return [
        Question(
            id=f"q{i:04d}",
            question=f"Synthetic question {i}: which option?",
            options={"A": "first", "B": "second"},
            answer="A",
            benchmark="synthetic",
        )
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--sequential-questions", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--reply-seconds", type=float, default=0.5)
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "eval_concurrency.json"))
    args = parser.parse_args()

    at_start = describe_machine()
    server, base_url = start_server(args.reply_seconds)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = EvalConfig.for_graph("cot", {"respondent_model": "openai:fixed"})
            trace_db = str(Path(tmp) / "traces.sqlite")
            questions = synthetic_questions(args.questions)
            # Warm-up (imports, HTTP client, trace db), not timed: the bench measures steady throughput.
            asyncio.run(
                run_questions(
                    config,
                    questions[:8],
                    Path(tmp) / "warm-up",
                    concurrency=8,
                    base_url=base_url,
                    trace_db=trace_db,
                    progress=False,
                )
            )
            started = time.perf_counter()
            counts = asyncio.run(
                run_questions(
                    config,
                    questions,
                    Path(tmp) / "concurrent",
                    concurrency=args.concurrency,
                    base_url=base_url,
                    trace_db=trace_db,
                    progress=False,
                )
            )
            concurrent_s = time.perf_counter() - started
            assert counts["answered"] == args.questions, counts

            graph = load_graph("cot")
            context = config.context(base_url, trace_db)
            started = time.perf_counter()
            for q in synthetic_questions(args.sequential_questions):
                graph.invoke({"question": q.question, "options": q.options}, context=context)
            sequential_s = time.perf_counter() - started
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)

    calls_per_question = 1  # cot: one respondent call
    ideal = args.questions * calls_per_question * args.reply_seconds / args.concurrency
    sequential_ideal = args.sequential_questions * calls_per_question * args.reply_seconds / args.concurrency
    result = {
        "concurrency": args.concurrency,
        "questions": args.questions,
        "reply_seconds": args.reply_seconds,
        "system": "cot",
        "calls_per_question": calls_per_question,
        "seconds": round(concurrent_s, 3),
        "ideal_seconds": round(ideal, 3),
        "ratio_to_ideal": round(ideal / concurrent_s, 3),
        "sequential_questions": args.sequential_questions,
        "sequential_seconds": round(sequential_s, 3),
        "sequential_ratio_to_ideal": round(sequential_ideal / sequential_s, 3),
        "command": "python benches/eval_concurrency.py " + " ".join(sys.argv[1:]),
        "machine": at_start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
