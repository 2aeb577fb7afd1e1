"""Model servers that fail: every way ends in one `ModelServerError` naming the URL, the cause and the knob.

Real HTTP servers on 127.0.0.1 (`ermedrag/testing/misbehaving_server.py`), the real OpenAI client through LangChain, the real
graphs, trace store and command line. Timeouts of 1 s keep the whole file fast.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ermedrag.graphs.context import Context
from ermedrag.graphs.steps import chat_model, record_call
from ermedrag.graphs.state import validate_question
from ermedrag.tools.model_server import MAX_RETRY_BACKOFF_S, ModelServerError, ServerPolicy, is_retryable
from ermedrag.tools.models import load_chat_model
from ermedrag.tools.records.traces import TraceStore
from tests.conftest import REPO, SCRIPTED
from ermedrag.testing.misbehaving_server import MisbehavingServer, refused_url

QUESTION = {
    "question": "What is the first-line treatment for anaphylaxis?",
    "options": {"A": "Intramuscular epinephrine", "B": "Oral antihistamine"},
    "gold": "A",
}
FAST = dict(timeout_s=1.0, connect_timeout_s=1.0, retry_backoff_s=0.05)


def _model(base_url: str, retries: int = 0, **kwargs):
    return load_chat_model("openai:x", base_url=base_url, max_new_tokens=16, max_retries=retries, **(FAST | kwargs))


def _failure(model, how: str = "invoke") -> tuple[ModelServerError, float]:
    started = time.monotonic()
    with pytest.raises(ModelServerError) as caught:
        if how == "invoke":
            model.invoke("Which drug first?")
        elif how == "ainvoke":
            asyncio.run(model.ainvoke("Which drug first?"))
        else:
            list(model.stream("Which drug first?"))
    return caught.value, time.monotonic() - started


def _assert_one_clear_line(err: ModelServerError, url: str, *words: str) -> None:
    message = str(err)
    assert "\n" not in message and len(message) < 600, message
    assert message.startswith(f"model server {url} "), message
    assert "openai:x" in message and err.url == url and err.model == "openai:x"
    for word in words:
        assert word in message, message


# ------------------------------------------------------------------------------------------- each failure


def test_refused_connection():
    with refused_url() as url:
        err, seconds = _failure(_model(url, retries=1))
    assert err.cause == "refused" and err.attempts == 2
    _assert_one_clear_line(err, url, "refused the connection", "is it running?", "--base-url", "2 attempts")
    assert seconds < 2


def test_hanging_server_times_out_within_the_timeout_times_the_attempts():
    with MisbehavingServer("hang") as server:
        err, seconds = _failure(_model(server.base_url, retries=1))
        requests = server.requests
    assert err.cause == "timeout" and err.attempts == 2 and requests == 2
    _assert_one_clear_line(err, server.base_url, "did not answer within 1 s", "--timeout", "ERMEDRAG_REQUEST_TIMEOUT_S")
    # Two attempts of 1 s each and one short backoff; on main this was 3 × 120 s.
    assert 2.0 <= seconds < 3.5, seconds


@pytest.mark.parametrize(
    ("mode", "cause", "retried", "words"),
    [
        ("5xx", "http_5xx:503", True, ("failed with HTTP 503", "server overloaded", "--retries")),
        ("malformed_json", "malformed_json", False, ("malformed JSON", "Expecting", "/v1")),
        ("wrong_shape", "wrong_shape", False, ("not a chat completion", "choices", "/v1")),
        ("dropped", "dropped", True, ("dropped the connection mid-response", "server's log")),
    ],
)
def test_misbehaving_server(mode, cause, retried, words):
    """Transient failures are retried (here once); a reply that is not a chat completion is not."""
    with MisbehavingServer(mode) as server:
        err, _ = _failure(_model(server.base_url, retries=1))
        requests = server.requests
    assert err.cause == cause
    assert (err.attempts, requests) == ((2, 2) if retried else (1, 1))
    _assert_one_clear_line(err, server.base_url, *words)
    assert isinstance(err, RuntimeError) and not isinstance(err, ValueError)  # not the user's mistake
    assert isinstance(err.__cause__, Exception)  # the original error stays attached for debugging


def test_client_errors_are_not_retried_and_name_the_knob():
    with MisbehavingServer("5xx", status=404) as server:
        err, _ = _failure(_model(server.base_url, retries=2))
        requests = server.requests
    assert (err.cause, err.attempts, requests) == ("http_4xx:404", 1, 1)
    _assert_one_clear_line(err, server.base_url, "HTTP 404", "--model", "/v1")


def test_async_and_streamed_calls_fail_the_same_way():
    with MisbehavingServer("hang") as server:
        err, seconds = _failure(_model(server.base_url), how="ainvoke")
    assert err.cause == "timeout" and seconds < 2.5
    with MisbehavingServer("5xx") as server:
        err, _ = _failure(_model(server.base_url, retries=1), how="stream")
        assert (err.cause, err.attempts, server.requests) == ("http_5xx:503", 2, 2)


# ------------------------------------------------------------------------------------------------ retries


def test_a_server_that_fails_twice_then_answers_gives_an_answer_with_two_retries():
    with MisbehavingServer("fail_then_ok", failures=2) as server:
        reply = _model(server.base_url, retries=2).invoke("Question: which?\nA. x\nB. y")
        assert server.requests == 3
    assert "<answer>A</answer>" in reply.text and reply.usage_metadata["output_tokens"] > 0


def test_one_retry_too_few_reports_the_last_failure():
    with MisbehavingServer("fail_then_ok", failures=2) as server:
        err, _ = _failure(_model(server.base_url, retries=1))
        assert (err.cause, err.attempts, server.requests) == ("http_5xx:503", 2, 2)


def test_streamed_call_is_retried_and_answers():
    with MisbehavingServer("fail_then_ok", failures=1) as server:
        chunks = list(_model(server.base_url, retries=1).stream("Question: which?\nA. x\nB. y"))
        assert server.requests == 2
    assert "<answer>A</answer>" in "".join(c.text for c in chunks)


def test_slow_server_within_the_timeout_is_not_a_failure():
    with MisbehavingServer("slow_then_ok", delay_s=0.5) as server:
        reply = _model(server.base_url).invoke("Question: which?\nA. x\nB. y")
        assert server.requests == 1 and "<answer>A</answer>" in reply.text


def test_backoff_doubles_is_capped_and_jittered():
    policy = ServerPolicy(retry_backoff_s=0.5)
    for retry, nominal in enumerate([0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]):
        waits = [policy.backoff_s(retry) for _ in range(50)]
        assert all(0.75 * nominal <= w <= nominal for w in waits), (retry, min(waits), max(waits))
    assert ServerPolicy(retry_backoff_s=20).backoff_s(3) <= 20  # a first wait above the cap is kept, not doubled
    assert MAX_RETRY_BACKOFF_S == 8.0
    assert [is_retryable(c) for c in ("refused", "timeout", "dropped", "http_5xx:502", "http_4xx:429")] == [True] * 5
    assert [is_retryable(c) for c in ("http_4xx:400", "http_4xx:404", "malformed_json", "wrong_shape")] == [False] * 4


def test_the_error_pickles_with_its_fields():
    err = ModelServerError("model server u refused the connection (openai:x)", "u", "openai:x", "refused", 3)
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.url, copy.model, copy.cause, copy.attempts) == (str(err), "u", "openai:x", "refused", 3)


# ------------------------------------------------------------------------------------- context and graphs


def test_context_timeouts_and_retries_reach_the_model_and_key_its_cache(monkeypatch):
    monkeypatch.setenv("ERMEDRAG_REQUEST_TIMEOUT_S", "7")
    monkeypatch.setenv("ERMEDRAG_CONNECT_TIMEOUT_S", "2")
    monkeypatch.setenv("ERMEDRAG_MAX_RETRIES", "4")
    ctx = Context(base_url="http://127.0.0.1:9/v1")
    model = chat_model(ctx, "openai:x", 16)
    assert (model.policy.timeout_s, model.policy.connect_timeout_s, model.policy.max_retries) == (7.0, 2.0, 4)
    assert chat_model(ctx, "openai:x", 16) is model
    other = chat_model(Context(base_url="http://127.0.0.1:9/v1", max_retries=0), "openai:x", 16)
    assert other is not model and other.policy.max_retries == 0

    monkeypatch.setenv("ERMEDRAG_MAX_RETRIES", "two")
    with pytest.raises(ValueError, match="environment variable ERMEDRAG_MAX_RETRIES='two': expected an integer"):
        Context()
    monkeypatch.delenv("ERMEDRAG_MAX_RETRIES")
    with pytest.raises(ValueError, match=r"request_timeout_s \(--timeout\) must be a positive number"):
        chat_model(Context(request_timeout_s=0), "openai:x", 16)


def test_timeouts_do_not_split_eval_results():
    """They change when an answer arrives, not which: outside the results' config key (graphs.registry settings)."""
    from ermedrag.evals.rows import EvalConfig

    plain = EvalConfig.for_graph("cot", {})
    tuned = EvalConfig.for_graph("cot", {"request_timeout_s": 5.0, "connect_timeout_s": 1.0, "max_retries": 0})
    assert tuned.key() == plain.key()
    assert tuned.plumbing == {"request_timeout_s": 5.0, "connect_timeout_s": 1.0, "max_retries": 0}
    assert tuned.context(None, "t.sqlite")["request_timeout_s"] == 5.0


def _context(tmp_path: Path, base_url: str, **extra) -> dict:
    return {
        "extractor_model": "openai:x",
        "respondent_model": "openai:x",
        "base_url": base_url,
        "trace_db": str(tmp_path / "traces.sqlite"),
        "request_timeout_s": 1.0,
        "connect_timeout_s": 1.0,
        "max_retries": 0,
        "retry_backoff_s": 0.05,
        "index_dir": "",
        "chroma_url": "",
        **extra,
    }


def test_graph_answers_through_a_working_server(tmp_path):
    from ermedrag.graphs.baselines import cot

    with MisbehavingServer("ok") as server:
        state = cot.invoke(dict(QUESTION), context=_context(tmp_path, server.base_url))
    assert state["answer"]["answer"] == "A"
    run = TraceStore(tmp_path / "traces.sqlite").run(state["run_id"])
    assert run["status"] == "finished" and run["error"] is None


def test_graph_streams_messages_through_a_flaky_server(tmp_path):
    """LangGraph's "messages" stream mode (what Studio uses) streams the model: retried there too."""
    from ermedrag.graphs.baselines import cot

    with MisbehavingServer("fail_then_ok", failures=1) as server:
        context = _context(tmp_path, server.base_url, max_retries=1)
        parts = list(cot.stream(dict(QUESTION), context=context, stream_mode=["messages", "values"]))
        assert server.requests == 2
    assert any(kind == "messages" for kind, _ in parts)
    assert parts[-1][1]["answer"]["answer"] == "A"


def test_failed_call_marks_the_run_failed_with_its_error(tmp_path):
    from ermedrag.graphs.baselines import cot

    with MisbehavingServer("wrong_shape") as server:
        with pytest.raises(ModelServerError) as caught:
            cot.invoke(dict(QUESTION), context=_context(tmp_path, server.base_url))
    store = TraceStore(tmp_path / "traces.sqlite")
    (run,) = store.runs()
    assert run["status"] == "failed" and run["finished_at"] is None and run["failed_at"]
    assert run["error"].startswith("respond: ModelServerError: ") and str(caught.value) in run["error"]
    assert list(store.events(run_id=run["run_id"])) == []


def test_er_medrag_extractor_failure_marks_the_run_failed(tmp_path):
    """The fan-out's extractor calls go through the same helper: one error out of the graph, the run failed."""
    from ermedrag.graphs.er_medrag import graph

    with refused_url() as url:
        with pytest.raises(ModelServerError) as caught:
            graph.invoke(dict(QUESTION), context=_context(tmp_path, url, snippets_k=2))
    assert caught.value.cause == "refused"
    (run,) = TraceStore(tmp_path / "traces.sqlite").runs()
    assert run["status"] == "failed" and run["error"].startswith("extract: ModelServerError: model server")
    assert run["n_retrievals"] == 1 and run["n_events"] == 0


def test_record_call_records_the_event(tmp_path):
    from langchain_core.messages import HumanMessage

    ctx = Context(respondent_model=SCRIPTED, trace_db=str(tmp_path / "traces.sqlite"))
    store = TraceStore(ctx.trace_db)
    store.start_run("r1", "test", {"question": "q"}, None)
    parsed, event = record_call(
        ctx,
        ctx.respondent_model,
        8,
        [HumanMessage(content="Question: q\nA. x")],
        str.upper,
        agent="respondent",
        node="respond",
        run_id="r1",
    )
    assert parsed == event.completion.upper()
    (stored,) = store.events(run_id="r1")
    assert stored["model"] == SCRIPTED and stored["sampling"]["max_new_tokens"] == 8


# ---------------------------------------------------------------------------------------------- the store


def test_old_store_gains_the_error_columns(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # a store written before runs could fail
        db.execute(
            "CREATE TABLE runs (run_id TEXT PRIMARY KEY, graph TEXT NOT NULL, question TEXT NOT NULL, "
            "gold TEXT, answer TEXT, created_at REAL NOT NULL, finished_at REAL)"
        )
        db.execute("INSERT INTO runs VALUES ('done', 'cot', '{\"question\": \"q\"}', 'A', '{\"answer\": \"A\"}', 1, 2)")
        db.execute("INSERT INTO runs VALUES ('open', 'cot', '{\"question\": \"q\"}', 'A', NULL, 1, NULL)")
    store = TraceStore(path)
    assert {r["run_id"]: r["status"] for r in store.runs()} == {"done": "finished", "open": "unfinished"}
    store.fail_run("open", "respond: ModelServerError: model server u timed out")
    store.fail_run("done", "too late")  # a finished run stays finished
    assert store.run("open")["status"] == "failed" and store.run("done")["error"] is None
    store.finish_run("open", {"answer": "B"})  # resumed to the end
    assert store.run("open")["status"] == "finished" and store.run("open")["error"] is None
    TraceStore(path)  # opening a migrated store again changes nothing


# ---------------------------------------------------------------------------------------------- the input


def test_option_keys_are_canonical_uppercase_letters():
    question, options = validate_question({"question": " q? ", "options": {"a": "x", " b ": "y", "C": 3}})
    assert (question, options) == ("q?", {"A": "x", "B": "y", "C": "3"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"A": "x", "a": "y"}, "input 'options' has both 'A' and 'a'"),
        ({"1": "x", "2": "y"}, "input 'options' key '1': option keys are single letters A-Z"),
        ({"AB": "x"}, "input 'options' key 'AB'"),
        ({"": "x"}, "input 'options' key ''"),
        ({"Ä": "x"}, "input 'options' key 'Ä'"),
        ({3: "x"}, "input 'options' key 3"),
    ],
)
def test_bad_option_keys_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        validate_question({"question": "q?", "options": options})


def test_benchmark_rows_use_the_same_keys():
    from ermedrag.tools.data.benchmarks import BadRow, normalise

    row = {"id": "q", "question": "q?", "answer": "b"}
    assert normalise(row | {"options": {"a": "x", "b": "y"}}, "t").options == {"A": "x", "B": "y"}
    assert normalise(row | {"options": {"a": "x", "b": "y"}}, "t").answer == "B"
    for options in ({"1": "x", "2": "y"}, {"A": "x", "a": "y", "b": "z"}, {"AB": "x", "b": "y"}):
        bad = normalise(row | {"options": options}, "t")
        assert isinstance(bad, BadRow) and "must be distinct letters A-Z" in bad.problem, options


def test_gold_follows_the_canonical_keys(tmp_path):
    from ermedrag.graphs.baselines import cot

    context = {"extractor_model": SCRIPTED, "respondent_model": SCRIPTED, "trace_db": str(tmp_path / "t.sqlite")}
    state = cot.invoke({"question": "q?", "options": {"a": "x", "b": "y"}, "gold": "a"}, context=context)
    assert state["options"] == {"A": "x", "B": "y"} and state["answer"]["answer"] == "A"
    assert TraceStore(context["trace_db"]).run(state["run_id"])["gold"] == "A"


# ------------------------------------------------------------------------------------------- command line


def _ermedrag(*args: str, tmp_path: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {
        **os.environ,
        "ERMEDRAG_TRACE_DB": str(tmp_path / "traces.sqlite"),
        "ERMEDRAG_CHECKPOINT_DB": str(tmp_path / "checkpoints.sqlite"),
    }
    for name in (
        "OPENAI_BASE_URL",
        "ERMEDRAG_MODEL",
        "ERMEDRAG_INDEX_DIR",
        "ERMEDRAG_REQUEST_TIMEOUT_S",
        "ERMEDRAG_MAX_RETRIES",
        "ERMEDRAG_CONNECT_TIMEOUT_S",
    ):
        env.pop(name, None)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ermedrag", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - started


def test_cli_prints_one_error_line_and_exits_3_and_lists_the_failed_run(tmp_path):
    with MisbehavingServer("hang") as server:
        proc, seconds = _ermedrag(
            "ask",
            QUESTION["question"],
            "-o",
            "A=Epinephrine",
            "-o",
            "B=Antihistamine",
            "--graph",
            "cot",
            "--model",
            "openai:x",
            "--base-url",
            server.base_url,
            "--timeout",
            "1",
            "--retries",
            "0",
            tmp_path=tmp_path,
        )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr
    assert errors[0].startswith(f"error: model server {server.base_url} did not answer within 1 s (openai:x)")
    assert seconds < 30, seconds  # the 1 s timeout, not minutes

    listed, _ = _ermedrag("traces", "list", tmp_path=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    (line,) = listed.stdout.splitlines()
    assert "  cot  " in line and "  FAILED  " in line and "error: respond: ModelServerError: model server" in line


def test_eval_stops_at_a_server_that_is_down_and_lists_what_failed(tmp_path):
    import json

    from ermedrag.evals.runner import FAILURES, run_eval

    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": QUESTION["question"], "options": QUESTION["options"], "answer": "A"})
            + "\n"
            for i in range(6)
        )
    )
    started = time.monotonic()
    with refused_url() as url, pytest.raises(ModelServerError) as caught:
        run_eval(
            ["cot"],
            [str(questions)],
            "openai:x",
            tmp_path / "out",
            base_url=url,
            concurrency=2,
            trace_db=str(tmp_path / "t.sqlite"),
            request_timeout_s=1.0,
            connect_timeout_s=1.0,
            max_retries=0,
        )
    assert caught.value.cause == "refused" and caught.value.url == url
    failed = (tmp_path / "out" / FAILURES).read_text().splitlines()
    assert 1 <= len(failed) <= 2  # the questions in flight; the other four were never started
    assert time.monotonic() - started < 30


def _questions_file(tmp_path, count: int):
    import json

    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": QUESTION["question"], "options": QUESTION["options"], "answer": "A"})
            + "\n"
            for i in range(count)
        )
    )
    return str(questions)


def test_eval_spreads_questions_over_two_servers_as_one_configuration(tmp_path):
    from ermedrag.evals.report import load_rows
    from ermedrag.evals.runner import run_eval

    with (
        MisbehavingServer("slow_then_ok", delay_s=0.2) as first,
        MisbehavingServer("slow_then_ok", delay_s=0.2) as second,
    ):
        summary = run_eval(
            ["cot"],
            [_questions_file(tmp_path, 8)],
            "openai:x",
            tmp_path / "out",
            base_url=[first.base_url, second.base_url],
            concurrency=4,
            progress=False,
            trace_db=str(tmp_path / "t.sqlite"),
            request_timeout_s=5.0,
            connect_timeout_s=1.0,
        )
    counts = summary["cot"]
    assert counts["answered"] == 8 and counts["failed"] == 0, counts
    by_server = counts["by_server"]
    # the first 4 in flight go 2 and 2; each later one to the server with fewer in flight when it starts, which
    # depends on which answer came back first (a busy machine gave 3 and 5)
    assert set(by_server) == {first.base_url, second.base_url} and sum(by_server.values()) == 8
    assert min(by_server.values()) >= 2
    assert first.requests >= by_server[first.base_url] and second.requests >= by_server[second.base_url]
    rows = load_rows([tmp_path / "out"])
    assert len(rows) == 8 and len({row["config_key"] for row in rows}) == 1  # replicas: one configuration


def test_the_next_question_goes_to_the_live_server_with_the_fewest_in_flight():
    from ermedrag.evals.servers import ServerPool
    from ermedrag.tools.model_server import ModelServerError

    pool = ServerPool(["http://a/v1", "http://b/v1", "http://a/v1"])  # a duplicate is one server
    assert [pool.acquire() for _ in range(4)] == ["http://a/v1", "http://b/v1", "http://a/v1", "http://b/v1"]
    pool.release("http://b/v1", answered=True)
    assert pool.acquire() == "http://b/v1"  # b has 1 in flight, a 2
    pool.mark_down("http://b/v1", ModelServerError("refused", "http://b/v1", "x", "refused"))
    assert pool.acquire() == "http://a/v1"  # the only live one, however busy
    pool.mark_down("http://a/v1", ModelServerError("refused", "http://a/v1", "x", "refused"))
    with pytest.raises(ModelServerError):
        pool.acquire()
    assert pool.summary() == {"http://a/v1": 0, "http://b/v1": 1}


def test_a_server_that_is_down_leaves_the_rotation_and_its_questions_move_on(tmp_path, capsys):
    from ermedrag.evals.runner import FAILURES, run_eval

    with MisbehavingServer("ok") as live, refused_url() as down:
        summary = run_eval(
            ["cot"],
            [_questions_file(tmp_path, 6)],
            "openai:x",
            tmp_path / "out",
            base_url=[down, live.base_url],
            concurrency=2,
            progress=False,
            trace_db=str(tmp_path / "t.sqlite"),
            max_retries=0,
            request_timeout_s=5.0,
            connect_timeout_s=1.0,
        )
    counts = summary["cot"]
    assert counts["answered"] == 6 and counts["failed"] == 0, counts
    assert counts["by_server"] == {down: 0, live.base_url: 6}
    assert not (tmp_path / "out" / FAILURES).exists()
    err = capsys.readouterr().err
    assert f"server {down} is down (refused); 1 other server takes its questions" in err
    assert err.count(" is down ") == 1  # said once, however many questions found it


def test_cli_base_url_repeats():
    from ermedrag.cli import _parser

    args = _parser().parse_args(
        [
            "eval",
            "--system",
            "cot",
            "--bench",
            "medqa",
            "--out",
            "o",
            "--base-url",
            "http://127.0.0.1:1/v1",
            "--base-url",
            "http://127.0.0.1:2/v1",
        ]
    )
    assert args.base_url == ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
