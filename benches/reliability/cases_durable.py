"""Durable runs: an `ermedrag ask` (or `eval`) SIGKILLed mid-run, or failed by its model server, continues with
`--resume` (a rerun for eval) without making a finished model call again; the trace run ends finished.

Model calls are counted across processes by `ermedrag/testing/scripted/counting.py` (one line per finished call in the file
named by SCRIPTED_COUNTING_CALLS)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benches.reliability.harness import (
    REPO,
    SCRIPTED,
    CliResult,
    Verdict,
    Workspace,
    answer_problem,
    cli_in_process,
    cli_subprocess,
    crash,
    data_lost,
    judge_cli,
    kill_group,
    ok,
    one_line,
    register,
    silent_wrong,
    wait_for,
)

COUNTING = "scripted:ermedrag.testing.scripted.counting"
QUESTION = "What is the first-line treatment for anaphylaxis?"
OPTIONS = ["-o", "A=Intramuscular epinephrine", "-o", "B=Oral antihistamine", "-o", "C=Inhaled salbutamol"]
SNIPPETS = 3
CHILD_TIMEOUT_S = 300


def calls(path: Path) -> list[tuple[str, ...]]:
    return [tuple(line.split("\t")) for line in path.read_text().splitlines()] if path.exists() else []


@register(
    "ask_killed_mid_fan_out_resumed",
    "durable",
    "ermedrag ask (er_medrag, 3 snippets) SIGKILLed after 2 of 3 extractions, then --resume RUN_ID: answer "
    "'A', 4 model calls in all (none made twice), one trace run with 4 events and 1 retrieval",
    timeout_s=CHILD_TIMEOUT_S * 2 + 60,
)
def killed_ask(workspace: Workspace) -> Verdict:
    folder = workspace.path("durable/kill")
    folder.mkdir(parents=True, exist_ok=True)
    calls_file = folder / "calls.tsv"
    env = workspace.env(SCRIPTED_COUNTING_CALLS=str(calls_file), SCRIPTED_COUNTING_STEP_S="1.0")
    command = ["ask", QUESTION, *OPTIONS, "--model", COUNTING, "--snippets", str(SNIPPETS)]
    log = folder / "killed.err"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ermedrag", *command],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        reached = wait_for(lambda: len(calls(calls_file)) >= 2 or proc.poll() is not None, CHILD_TIMEOUT_S)
        time.sleep(0.4)  # the second extraction's node records its event and LangGraph saves its writes
    finally:
        kill_group(proc)
    before = calls(calls_file)
    if not reached or len(before) != 2:
        return crash(f"bench setup: killed after {len(before)} calls, not 2: {one_line(log.read_text()[-300:])}")
    run_ids = re.findall(r"^Run id: ([0-9a-f]{32});", log.read_text(), re.MULTILINE)
    if not run_ids:
        return crash(f"bench setup: no run id printed: {one_line(log.read_text()[-300:])}")
    run_id = run_ids[0]
    resumed = cli_subprocess([*command, "--resume", run_id, "--json"], env, CHILD_TIMEOUT_S)

    def check(result: CliResult) -> Verdict:
        state = json.loads(result.stdout)
        problem = answer_problem(state, "A")
        if problem:
            return silent_wrong(problem)
        made = calls(calls_file)
        repeated = [call for call, n in Counter(made).items() if n > 1]
        if repeated or len(made) != SNIPPETS + 1:
            return data_lost(
                f"{len(made)} model calls in all (a clean run makes {SNIPPETS + 1}); made twice: {repeated[:2]}"
            )
        events, retrievals = workspace.trace_events(run_id), _retrievals(workspace, run_id)
        run = workspace.trace_run(run_id) or {}
        if len(events) != SNIPPETS + 1 or len(retrievals) != 1 or run.get("status") != "finished":
            return data_lost(
                f"trace run {run.get('status')} with {len(events)} events and {len(retrievals)} "
                f"retrievals (expected finished, {SNIPPETS + 1}, 1)"
            )
        return ok(f"resumed: {len(made)} calls in all, none twice; trace run finished with {len(events)} events")

    return judge_cli(resumed, (run_id,), check=check, refusal_expected=False)


def _retrievals(workspace: Workspace, run_id: str) -> list[dict[str, Any]]:
    from ermedrag.tools.records.traces import TraceStore

    return TraceStore(workspace.trace_db).retrievals(run_id)


@register(
    "ask_failed_by_server_resumed",
    "durable",
    "ermedrag ask (er_medrag) failed by a 5xx server (exit 3, run failed), resumed with --resume RUN_ID "
    "--base-url of a working server: answer 'A', the trace run finished, its retrieval not redone",
    quick=True,
    timeout_s=120,
)
def failed_then_resumed(workspace: Workspace) -> Verdict:
    from ermedrag.testing.misbehaving_server import MisbehavingServer

    with MisbehavingServer("5xx") as failing:
        first = cli_in_process(
            [
                "ask",
                QUESTION,
                *OPTIONS,
                "--model",
                "openai:m",
                "--base-url",
                failing.base_url,
                "--retries",
                "0",
                "--snippets",
                str(SNIPPETS),
            ]
        )
    verdict = judge_cli(first, (failing.base_url,))
    run_id = first.run_id()
    if verdict.outcome != "clear_error" or run_id is None:
        return verdict if verdict.outcome != "clear_error" else crash("no run id printed")
    if (workspace.trace_run(run_id) or {}).get("status") != "failed":
        return silent_wrong(
            f"after the server error the trace run is {(workspace.trace_run(run_id) or {}).get('status')}"
        )
    with MisbehavingServer("ok") as working:
        resumed = cli_in_process(["ask", "--resume", run_id, "--base-url", working.base_url, "--json"])

    def check(result: CliResult) -> Verdict:
        state = json.loads(result.stdout)
        problem = answer_problem(state, "A")
        if problem:
            return silent_wrong(problem)
        run = workspace.trace_run(run_id) or {}
        retrievals = _retrievals(workspace, run_id)
        if run.get("status") != "finished" or len(retrievals) != 1:
            return data_lost(f"trace run {run.get('status')} with {len(retrievals)} retrievals (expected finished, 1)")
        return ok("resumed against the working server: answer 'A', trace run finished, 1 retrieval")

    return judge_cli(resumed, (run_id,), check=check, refusal_expected=False)


def _finished_run(workspace: Workspace) -> str:
    def run() -> str:
        result = cli_in_process(["ask", QUESTION, *OPTIONS, "--graph", "cot", "--model", SCRIPTED])
        if result.rc != 0 or not result.run_id():
            raise RuntimeError(f"bench setup: ask failed: {result.stderr[-300:]}")
        return result.run_id()

    return workspace.fixture("durable_finished_run", run)


@register(
    "ask_resume_finished_run",
    "durable",
    "--resume of a finished run prints its answer and makes no model call",
    quick=True,
)
def resume_finished(workspace: Workspace) -> Verdict:
    run_id = _finished_run(workspace)
    before = len(workspace.trace_events(run_id))
    result = cli_in_process(["ask", "--resume", run_id, "--json"])

    def check(result: CliResult) -> Verdict:
        problem = answer_problem(json.loads(result.stdout), "A")
        after = len(workspace.trace_events(run_id))
        if problem:
            return silent_wrong(problem)
        return ok("printed the recorded answer") if after == before else data_lost(f"{after - before} new model calls")

    return judge_cli(result, (run_id,), check=check, refusal_expected=False)


@register(
    "ask_resume_other_question",
    "durable",
    "--resume RUN_ID with another question: exit 2 naming the run (it answers its own question)",
    quick=True,
)
def resume_other_question(workspace: Workspace) -> Verdict:
    run_id = _finished_run(workspace)
    return judge_cli(cli_in_process(["ask", "Which vitamin prevents rickets?", "--resume", run_id]), (run_id,))


@register("ask_resume_unknown_run", "durable", "--resume of a run id that does not exist: exit 2 naming it", quick=True)
def resume_unknown(workspace: Workspace) -> Verdict:
    return judge_cli(cli_in_process(["ask", "--resume", "0" * 32]), ("0" * 32,))


@register(
    "eval_killed_and_rerun",
    "durable",
    "ermedrag eval (6 questions, concurrency 1) SIGKILLed after 2 results, then rerun: 6 results, each "
    "question once, at most the one question in flight answered twice",
    timeout_s=CHILD_TIMEOUT_S * 2 + 60,
)
def killed_eval(workspace: Workspace) -> Verdict:
    folder = workspace.path("durable/eval")
    folder.mkdir(parents=True, exist_ok=True)
    questions = folder / "questions.jsonl"
    # One gold answer the model misses: a report of 100% accuracy is a case of its own (misc).
    questions.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "question": f"{QUESTION} (case {i})",
                    "options": {"A": "Epinephrine", "B": "Antihistamine"},
                    "answer": "B" if i == 5 else "A",
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    calls_file, out = folder / "calls.tsv", folder / "out"
    env = workspace.env(SCRIPTED_COUNTING_CALLS=str(calls_file), SCRIPTED_COUNTING_STEP_S="0.5")
    command = [
        "eval",
        "--system",
        "cot",
        "--bench",
        str(questions),
        "--model",
        COUNTING,
        "--concurrency",
        "1",
        "--out",
        str(out),
    ]
    results = out / "results.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ermedrag", *command],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        reached = wait_for(
            lambda: (results.exists() and len(results.read_text().splitlines()) >= 2) or proc.poll() is not None,
            CHILD_TIMEOUT_S,
        )
    finally:
        kill_group(proc)
    if not reached:
        return crash("bench setup: eval did not write 2 results")
    rerun = cli_subprocess(command, env, CHILD_TIMEOUT_S)

    def check(result: CliResult) -> Verdict:
        rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
        ids = Counter(row["question_id"] for row in rows)
        if sorted(ids) != [f"q{i}" for i in range(6)] or max(ids.values()) > 1:
            return data_lost(f"results per question: {dict(ids)}")
        made = len(calls(calls_file))
        if made > 7:
            return data_lost(f"{made} model calls for 6 questions (at most 1 redone)")
        wrong = [row["question_id"] for row in rows if row["answer"] != "A"]
        return silent_wrong(f"wrong answers: {wrong}") if wrong else ok(f"6 results, each once; {made} model calls")

    return judge_cli(rerun, (), check=check, refusal_expected=False)
