"""Model servers that misbehave (a real HTTP server on 127.0.0.1, `ermedrag.testing.misbehaving_server`), behind an `openai:`
model: every failure must be one clear error naming the URL and the cause, within the time its timeouts and
retries promise, with the trace run marked failed; a server that recovers within the retries must give the answer.

Time bound of a failing call: (retries + 1) × (request timeout + connect timeout) + the backoffs + 3 s slack;
past it the case is a `hang`. The trace run of a failed question must be `failed` with its error; `unfinished`
(what a killed or running run looks like) is `silent_wrong` (see reliability.py).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from benches.reliability.harness import (
    Timer,
    Verdict,
    Workspace,
    answer_problem,
    clear_error,
    crash,
    cli_in_process,
    error_text,
    hang,
    judge_cli,
    judge_error,
    ok,
    one_line,
    register,
    silent_wrong,
)

QUESTION = "Which drug is first-line for type 2 diabetes?"
OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Glipizide"}
MODEL = "openai:misbehaving"
TIMEOUT_S, CONNECT_S, RETRIES, BACKOFF_S = 1.0, 1.0, 1, 0.05
SLACK_S = 3.0
# What each failing mode's error must say besides the URL.
CAUSE_WORDS = {
    "refused": "refused",
    "hang": "did not answer within",
    "5xx": "HTTP 503",
    "malformed_json": "malformed JSON",
    "wrong_shape": "not a chat completion",
    "dropped": "dropped",
    "empty_choices": "choices is empty",
    "no_message": "no message",
    "null_content": "content is null",
    "wrong_types": "not a string",
    "stream_error": "mid-response",
    "trickle": "did not answer within",
}


def bound_s(timeout_s: float, connect_s: float, retries: int, backoff_s: float) -> float:
    backoffs = sum(min(8.0, backoff_s * 2**i) for i in range(retries))
    return (retries + 1) * (timeout_s + connect_s) + backoffs + SLACK_S


@contextlib.contextmanager
def server(mode: str, **options: Any) -> Iterator[tuple[str, Any]]:
    """(base_url, server or None) for a mode of `ermedrag.testing.misbehaving_server`, `refused` included."""
    from ermedrag.testing.misbehaving_server import MisbehavingServer, refused_url

    if mode == "refused":
        with refused_url() as url:
            yield url, None
        return
    with MisbehavingServer(mode, **({"delay_s": 0.2} if mode == "trickle" else {}) | options) as running:
        yield running.base_url, running


def server_context(
    base_url: str, *, timeout_s: float = TIMEOUT_S, retries: int = RETRIES, backoff_s: float = BACKOFF_S
) -> dict[str, Any]:
    return {
        "extractor_model": MODEL,
        "respondent_model": MODEL,
        "base_url": base_url,
        "request_timeout_s": timeout_s,
        "connect_timeout_s": CONNECT_S,
        "max_retries": retries,
        "retry_backoff_s": backoff_s,
    }


def run_status_problem(workspace: Workspace, run_id: str, cause: str) -> Verdict | None:
    """The trace run of a failed question must be marked failed with its error."""
    run = workspace.trace_run(run_id)
    if run is None:
        return None  # refused before the run was opened: nothing recorded, nothing wrong
    if run["status"] != "failed":
        return silent_wrong(f"the error was clear, but the trace run is {run['status']!r}, not 'failed'")
    if cause.lower() not in (run.get("error") or "").lower():
        return silent_wrong(f"trace run failed with an error that does not say {cause!r}: {one_line(run['error'])}")
    return None


def judge_failure(
    call: Callable[[], Any], workspace: Workspace, run_id: str, base_url: str, cause: str, limit_s: float
) -> Verdict:
    timer = Timer()
    try:
        result = call()
    except Exception as err:  # noqa: BLE001
        seconds = timer.seconds
        verdict = judge_error(err, (base_url,))
        if verdict.outcome != "clear_error":
            return verdict
        if cause.lower() not in str(err).lower():
            return crash(f"error does not say {cause!r}: {error_text(err)}")
        if "\n" in str(err).strip():
            return crash(f"error is not one line: {error_text(err)}")
        if seconds > limit_s:
            return hang(f"failed after {seconds:.1f} s, bound {limit_s:.1f} s: {error_text(err)}")
        return run_status_problem(workspace, run_id, cause) or clear_error(f"{seconds:.1f} s: {error_text(err)}")
    return silent_wrong(f"returned {one_line(repr(result), 200)} from a failing server")


def warm_up(workspace: Workspace) -> None:
    """Load what the first timed call would otherwise pay for (the encoder, the starter index, the OpenAI client):
    a time bound is about the server's failure, not about loading."""

    def load() -> bool:
        from ermedrag.graphs.registry import load_graph
        from ermedrag.tools.model_server import background
        from benches.reliability.harness import SCRIPTED

        background().client()
        load_graph("vanilla_rag").invoke(
            {"question": QUESTION, "options": OPTIONS},
            context={"respondent_model": SCRIPTED, "extractor_model": SCRIPTED},
        )
        return True

    workspace.fixture("servers_warm", load)


def invoke(graph: str, context: dict[str, Any], run_id: str) -> dict[str, Any]:
    from ermedrag.graphs.registry import load_graph

    return load_graph(graph).invoke({"question": QUESTION, "options": OPTIONS, "run_id": run_id}, context=context)


def failing_case(mode: str, graph: str = "cot", quick: bool = True) -> None:
    limit = bound_s(TIMEOUT_S, CONNECT_S, RETRIES, BACKOFF_S)

    @register(
        f"server_{mode}_{graph}",
        "servers",
        f"{graph} on a server that {mode}: one-line ModelServerError naming the URL and '{CAUSE_WORDS[mode]}' "
        f"within {limit:.0f} s; trace run failed",
        quick=quick,
        timeout_s=limit * 3 + 30,
    )
    def run(workspace: Workspace) -> Verdict:
        warm_up(workspace)
        run_id = uuid.uuid4().hex
        with server(mode) as (url, _):
            return judge_failure(
                lambda: invoke(graph, server_context(url), run_id), workspace, run_id, url, CAUSE_WORDS[mode], limit
            )


for _mode in CAUSE_WORDS:
    failing_case(_mode)
for _graph in ("er_medrag", "vanilla_rag", "med_r3"):
    failing_case("5xx", _graph)
failing_case("hang", "er_medrag")
failing_case("hang", "med_r3")


@register(
    "server_5xx_streamed",
    "servers",
    "cot streamed (stream_mode='messages', LangGraph's token streaming) from a 5xx server: one-line error "
    "naming the URL; trace run failed",
    quick=True,
    timeout_s=60,
)
def streamed(workspace: Workspace) -> Verdict:
    from ermedrag.graphs.registry import load_graph

    run_id = uuid.uuid4().hex
    with server("5xx") as (url, _):

        def call() -> list[Any]:
            graph = load_graph("cot")
            return list(
                graph.stream(
                    {"question": QUESTION, "options": OPTIONS, "run_id": run_id},
                    context=server_context(url),
                    stream_mode="messages",
                )
            )

        return judge_failure(
            call, workspace, run_id, url, "HTTP 503", bound_s(TIMEOUT_S, CONNECT_S, RETRIES, BACKOFF_S)
        )


@register(
    "server_slow_then_ok",
    "servers",
    "a server that answers after 0.5 s, timeout 3 s: answered 'A'",
    quick=True,
    timeout_s=60,
)
def slow_then_ok(workspace: Workspace) -> Verdict:
    run_id = uuid.uuid4().hex
    with server("slow_then_ok", delay_s=0.5) as (url, _):
        try:
            state = invoke("cot", server_context(url, timeout_s=3.0), run_id)
        except Exception as err:  # noqa: BLE001
            return judge_error(err, (url,), refusal_expected=False)
    problem = answer_problem(state, "A")
    return silent_wrong(problem) if problem else ok("answered 'A'")


@register(
    "server_fails_twice_then_ok",
    "servers",
    "a server whose first 2 requests get 503, retries 2: answered 'A' after exactly 3 requests",
    quick=True,
    timeout_s=60,
)
def fail_then_ok(workspace: Workspace) -> Verdict:
    run_id = uuid.uuid4().hex
    with server("fail_then_ok", failures=2) as (url, running):
        try:
            state = invoke("cot", server_context(url, retries=2), run_id)
        except Exception as err:  # noqa: BLE001
            return judge_error(err, (url,), refusal_expected=False)
        requests = running.requests
    problem = answer_problem(state, "A") or (None if requests == 3 else f"{requests} requests, expected 3")
    return silent_wrong(problem) if problem else ok("answered 'A' after 3 requests")


@register(
    "server_fails_twice_one_retry",
    "servers",
    "the same server with retries 1: a clear error after exactly 2 requests, naming the URL and HTTP 503",
    quick=True,
    timeout_s=60,
)
def fail_then_ok_too_few_retries(workspace: Workspace) -> Verdict:
    run_id = uuid.uuid4().hex
    with server("fail_then_ok", failures=2) as (url, running):
        verdict = judge_failure(
            lambda: invoke("cot", server_context(url, retries=1), run_id),
            workspace,
            run_id,
            url,
            "HTTP 503",
            bound_s(TIMEOUT_S, CONNECT_S, 1, BACKOFF_S),
        )
        requests = running.requests
    if verdict.outcome == "clear_error" and requests != 2:
        return silent_wrong(f"{requests} requests for 1 retry (expected 2)")
    return verdict


@register(
    "server_http_404_not_retried",
    "servers",
    "a server answering HTTP 404 (wrong model or path), retries 2: a clear error naming the URL and 404 after "
    "one request (a 404 is not retried)",
    quick=True,
    timeout_s=60,
)
def http_404(workspace: Workspace) -> Verdict:
    run_id = uuid.uuid4().hex
    with server("5xx", status=404) as (url, running):
        verdict = judge_failure(
            lambda: invoke("cot", server_context(url, retries=2), run_id),
            workspace,
            run_id,
            url,
            "404",
            bound_s(TIMEOUT_S, CONNECT_S, 2, BACKOFF_S),
        )
        requests = running.requests
    if verdict.outcome == "clear_error" and requests != 1:
        return silent_wrong(f"a 404 was tried {requests} times")
    return verdict


# ------------------------------------------------------------------------------------------------ the CLI


def cli_failing_case(mode: str, graph: str = "cot") -> None:
    limit = bound_s(TIMEOUT_S, CONNECT_S, RETRIES, 0.5)  # the CLI keeps the default backoff (0.5 s)

    @register(
        f"cli_server_{mode}_{graph}",
        "servers",
        f"ermedrag ask --graph {graph} on a server that {mode}: exit 3, one error line naming the URL and "
        f"'{CAUSE_WORDS[mode]}', within {limit:.0f} s; trace run failed",
        quick=True,
        timeout_s=limit * 3 + 30,
    )
    def run(workspace: Workspace) -> Verdict:
        warm_up(workspace)
        with server(mode) as (url, _):
            result = cli_in_process(
                [
                    "ask",
                    QUESTION,
                    "--graph",
                    graph,
                    "-o",
                    "A=Metformin",
                    "-o",
                    "B=Insulin",
                    "--model",
                    MODEL,
                    "--base-url",
                    url,
                    "--timeout",
                    str(TIMEOUT_S),
                    "--connect-timeout",
                    str(CONNECT_S),
                    "--retries",
                    str(RETRIES),
                ]
            )
        verdict = judge_cli(result, (url,))
        if verdict.outcome != "clear_error":
            return verdict
        if result.rc != 3 or CAUSE_WORDS[mode].lower() not in result.error_lines[0].lower():
            return crash(f"exit {result.rc}, expected 3 naming {CAUSE_WORDS[mode]!r}: {result.error_lines[0]}")
        if result.seconds > limit:
            return hang(f"failed after {result.seconds:.1f} s, bound {limit:.1f} s")
        run_id = result.run_id()
        status = run_status_problem(workspace, run_id, CAUSE_WORDS[mode]) if run_id else None
        return status or verdict


for _mode in ("refused", "hang", "5xx", "dropped", "empty_choices", "trickle"):
    cli_failing_case(_mode)
cli_failing_case("5xx", "er_medrag")
cli_failing_case("5xx", "med_r3")


@register(
    "cli_eval_failing_server",
    "servers",
    "ermedrag eval of 3 questions against a 5xx server: every question listed in failures.jsonl naming the "
    "server, no result rows, the count of failures printed",
    quick=True,
    timeout_s=120,
)
def eval_failing_server(workspace: Workspace) -> Verdict:
    questions = workspace.path("servers/eval_questions.jsonl")
    questions.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"{QUESTION} ({i})", "options": OPTIONS, "answer": "A"}) + "\n"
            for i in range(3)
        )
    )
    out = workspace.path("servers/eval_out")
    with server("5xx") as (url, _):
        result = cli_in_process(
            [
                "eval",
                "--system",
                "cot",
                "--bench",
                str(questions),
                "--model",
                MODEL,
                "--base-url",
                url,
                "--retries",
                "0",
                "--timeout",
                "2",
                "--out",
                str(out),
            ]
        )

    failures = _records(out / "failures.jsonl")
    rows = _records(out / "results.jsonl")
    if rows:
        return silent_wrong(f"{len(rows)} result rows from a server that answered nothing: {one_line(rows[0])}")
    if len(failures) != 3 or not all(url in f.get("error", "") for f in failures):
        return silent_wrong(f"failures.jsonl has {len(failures)} entries (expected 3 naming {url})")
    if "3 failed" not in result.stdout:
        return silent_wrong(f"the output does not say that 3 questions failed: {one_line(result.stdout[-300:])}")
    # Told on stdout; then exit 0 (nothing more to say), or exit != 0 with one error line (e.g. no results).
    verdict = judge_cli(result, (url, "results"), check=lambda r: clear_error("exit 0"))
    if verdict.outcome != "clear_error":
        return verdict
    return clear_error(f"{verdict.detail}; 3 failures listed naming the server: {one_line(failures[0]['error'], 150)}")


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
