"""Durable runs: a run killed with SIGKILL continues from its last finished node, and no finished model call is
made again (calls are counted across both processes by `ermedrag/testing/scripted/counting.py`).

SQLite stores, and the same tests against a real PostgreSQL server started here from the Debian packages
(/usr/lib/postgresql/*/bin; skipped with the reason when it cannot start). The fast run keeps one kill test
(`ask` on SQLite) and the failed-question rerun on both stores; the eval kill and the Postgres kill are `slow`.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.conftest import REPO, free_port, log_tail, stop_process_group
from ermedrag.cli import main
from ermedrag.evals.runner import CHECKPOINTS, FAILURES, RESULTS, run_eval
from ermedrag.evals.rows import done_keys
from ermedrag.graphs.durable import CheckpointStoreError, describe_target, open_saver
from ermedrag.tools.records.traces import TraceStore

COUNTING = "scripted:ermedrag.testing.scripted.counting"
QUESTION = "What is the first-line treatment for anaphylaxis?"
OPTIONS = ["-o", "A=Intramuscular epinephrine", "-o", "B=Oral antihistamine", "-o", "C=Inhaled salbutamol"]
SNIPPETS = 3
STEP_S = 1.0  # extraction n of a question takes n steps: a kill 0.4 s after one finishes lands before the next
SETTLE_S = 0.4  # after a call returns: its node records the event and LangGraph saves the task's writes
TIMEOUT_S = 300  # a fresh machine builds the starter index on the first ask


# ------------------------------------------------------------------------------------------------- stores


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL server on 127.0.0.1 (initdb into a temporary folder), as a connection URL."""
    pytest.importorskip(
        "langgraph.checkpoint.postgres",
        reason="the postgres extra is not installed "
        "(pip install 'ermedrag[postgres]'): the Postgres checkpointer is untested here",
    )
    import psycopg

    binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    bin_dir = next(
        (Path(b) for b in binaries if (Path(b) / "initdb").exists() and (Path(b) / "postgres").exists()), None
    )
    if bin_dir is None:
        pytest.skip(
            "no PostgreSQL server binaries in /usr/lib/postgresql/*/bin (apt-get install postgresql): "
            "the Postgres checkpointer is untested here"
        )
    root = Path(tempfile.mkdtemp(prefix="ermedrag-pg-"))  # not under pytest's 0700 folders: the server user reads it
    as_user = {}
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        account = pwd.getpwnam("postgres") if _has_user("postgres") else pwd.getpwnam("nobody")
        os.chown(root, account.pw_uid, account.pw_gid)
        as_user = {"user": account.pw_uid, "group": account.pw_gid}
    data, log = root / "data", root / "server.log"
    init = subprocess.run(
        [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        capture_output=True,
        text=True,
        timeout=120,
        **as_user,
    )
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"initdb failed, so no PostgreSQL server here: {init.stderr[-1500:]}")
    port = free_port()
    with log.open("w") as handle:
        server = subprocess.Popen(
            [
                str(bin_dir / "postgres"),
                "-D",
                str(data),
                "-p",
                str(port),
                "-k",
                str(root),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **as_user,
        )
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    deadline = time.monotonic() + 60
    while True:
        try:
            psycopg.connect(url, connect_timeout=2).close()
            break
        except psycopg.OperationalError:
            if server.poll() is not None or time.monotonic() > deadline:
                stop_process_group(server)
                tail = log_tail(log, 1500)
                shutil.rmtree(root, ignore_errors=True)
                pytest.skip(f"the PostgreSQL server did not start: {tail}")
            time.sleep(0.2)
    try:
        yield url
    finally:
        stop_process_group(server)
        shutil.rmtree(root, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


BOTH_STORES = pytest.mark.parametrize("checkpoint_db", ["sqlite", "postgres"], indirect=True)


@pytest.fixture
def checkpoint_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A checkpoint store of each kind: a SQLite file, or a database of the test's own on the Postgres server."""
    if request.param == "sqlite":
        return str(tmp_path / "checkpoints.sqlite")
    import psycopg

    server = request.getfixturevalue("postgres_url")
    name = "t_" + re.sub(r"[^a-z0-9]", "_", request.node.name.lower())[-50:]
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.rpartition("/")[0] + "/" + name


# ------------------------------------------------------------------------------------------------- helpers

UNSET = (
    "ERMEDRAG_INDEX_DIR",
    "ERMEDRAG_MODEL",
    "ERMEDRAG_EXTRACTOR_MODEL",
    "ERMEDRAG_RESPONDENT_MODEL",
    "OPENAI_BASE_URL",
    "ERMEDRAG_SNIPPETS_K",
    "ERMEDRAG_COARSE_K",
    "SCRIPTED_COUNTING_FAIL",
    "SCRIPTED_COUNTING_STEP_S",
)


def _env(tmp_path: Path, checkpoint_db: str, **extra: str) -> dict[str, str]:
    """The environment of a test's runs: its own stores and call log, nothing from the user's settings."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "ERMEDRAG_TRACE_DB": str(tmp_path / "traces.sqlite"),
        "ERMEDRAG_CHECKPOINT_DB": checkpoint_db,
        "SCRIPTED_COUNTING_CALLS": str(tmp_path / "calls.tsv"),
        **extra,
    }
    for name in UNSET:
        if name not in extra:
            env.pop(name, None)
    return env


def _use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """`env` for runs in this process."""
    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(REPO))


def _calls(tmp_path: Path) -> list[tuple[str, ...]]:
    """Every finished model call so far: (agent, question, snippet)."""
    path = tmp_path / "calls.tsv"
    return [tuple(line.split("\t")) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert proc.poll() is None, f"the process ended before {what}: {log_tail(log)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {log_tail(log)}"
        time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _ask(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ermedrag", "ask", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("checkpoint_db", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)], indirect=True)
def test_killed_ask_resumes_mid_fan_out_without_repeating_a_finished_call(tmp_path: Path, checkpoint_db: str) -> None:
    """ER-MedRAG killed after 2 of its 3 extractions: the resume makes the third and the respondent's call only."""
    env = _env(tmp_path, checkpoint_db, SCRIPTED_COUNTING_STEP_S=str(STEP_S))
    command = [QUESTION, *OPTIONS, "--model", COUNTING, "--snippets", str(SNIPPETS)]
    log = tmp_path / "killed.err"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ermedrag", "ask", *command],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        _wait_for(lambda: len(_calls(tmp_path)) >= 2, proc, "two extractions", log)
        time.sleep(SETTLE_S)
    finally:
        _kill(proc)
    killed_output = proc.stdout.read().decode()
    proc.stdout.close()
    assert "Answer:" not in killed_output, "the kill should land before the answer"
    before = _calls(tmp_path)
    assert [agent for agent, *_ in before] == ["extractor", "extractor"], before
    (run_id,) = re.findall(r"^Run id: ([0-9a-f]{32});", log.read_text(), re.MULTILINE)
    store = TraceStore(tmp_path / "traces.sqlite")
    assert len(list(store.events(run_id=run_id))) == 2

    # The user re-runs the killed command with --resume (the same question is accepted, not asked again).
    resumed = _ask(*command, "--resume", run_id, "--json", env=env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    state = json.loads(resumed.stdout)
    assert state["run_id"] == run_id and state["answer"]["answer"] == "A" and state["answer"]["ok"]
    assert {e["snippet_id"] for e in state["extractions"]} == {s["id"] for s in state["snippets"]}
    assert len(state["snippets"]) == SNIPPETS

    calls = _calls(tmp_path)
    clean_run = SNIPPETS + 1  # one extraction per snippet, one answer
    assert len(calls) == clean_run, calls
    assert len(set(calls)) == len(calls), f"a finished call was made again: {Counter(calls).most_common(2)}"
    assert calls[:2] == before and [agent for agent, *_ in calls[2:]] == ["extractor", "respondent"]

    # The trace run continues: one run row, each call and the retrieval recorded once.
    events = list(store.events(run_id=run_id))
    assert len(events) == clean_run
    assert len({e["inputs"].get("snippet_id") for e in events if e["agent"] == "extractor"}) == SNIPPETS
    assert len(store.retrievals(run_id)) == 1
    assert store.run(run_id)["answer"]["answer"] == "A"
    assert sum(run["run_id"] == run_id for run in store.runs()) == 1

    # Resuming a finished run prints its result and calls nothing.
    again = _ask("--resume", run_id, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Answer: A  (parsed=True" in again.stdout and "finished" in again.stderr
    assert len(_calls(tmp_path)) == clean_run


def test_two_resumes_of_one_run_never_both_run(tmp_path: Path) -> None:
    """A run killed mid fan-out, then resumed by two processes at once: one holds the run, the other is refused in one
    line naming it (exit 2, nothing called); the run ends with each call recorded once. A run whose process died
    is free: the killed one was resumed at all."""
    checkpoint_db = str(tmp_path / "checkpoints.sqlite")
    # Slow steps: the resume that holds the run works for ~10 s, far longer than the other takes to start.
    env = _env(tmp_path, checkpoint_db, SCRIPTED_COUNTING_STEP_S=str(3 * STEP_S))
    command = [QUESTION, *OPTIONS, "--model", COUNTING, "--snippets", str(SNIPPETS)]
    log = tmp_path / "killed.err"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ermedrag", "ask", *command],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        _wait_for(lambda: len(_calls(tmp_path)) >= 1, proc, "one extraction", log)
        time.sleep(SETTLE_S)  # its checkpoint is written; the next extraction is steps away
    finally:
        _kill(proc)
    (run_id,) = re.findall(r"^Run id: ([0-9a-f]{32});", log.read_text(), re.MULTILINE)
    resumes = [
        subprocess.Popen(
            [sys.executable, "-m", "ermedrag", "ask", "--resume", run_id, "--json"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(r.wait(timeout=TIMEOUT_S), *r.communicate()) for r in resumes]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [(code, err[-1500:]) for code, _, err in results]
    (refusal,) = [err.strip().splitlines()[-1] for code, _, err in results if code == 2]
    assert refusal.startswith(f"error: run {run_id} is held by process ") and "Traceback" not in refusal
    calls = _calls(tmp_path)
    assert len(calls) == SNIPPETS + 1 and len(set(calls)) == len(calls), calls
    assert len(list(TraceStore(tmp_path / "traces.sqlite").events(run_id=run_id))) == SNIPPETS + 1


def test_resume_refuses_unknown_runs_and_other_questions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI in process (`ermedrag.cli.main`): bad resumes exit 2 with a message naming the problem."""
    db = tmp_path / "checkpoints.sqlite"
    _use_env(monkeypatch, _env(tmp_path, str(db)))

    assert main(["ask", "--resume", "0" * 32]) == 2
    assert f"no run '{'0' * 32}' to resume in the checkpoint store {db}" in capsys.readouterr().err
    assert main(["ask", QUESTION, *OPTIONS, "--model", COUNTING, "--snippets", "1"]) == 0
    (run_id,) = re.findall(r"^Run id: ([0-9a-f]{32});", capsys.readouterr().err, re.MULTILINE)
    assert main(["ask", "What treats a migraine?", "--resume", run_id]) == 2
    assert "not the question given" in capsys.readouterr().err
    assert main(["ask", "--resume", run_id, "--graph", "cot"]) == 2
    assert "ran the graph 'er_medrag', not 'cot'" in capsys.readouterr().err
    assert main(["ask", QUESTION, "-o", "a=Intramuscular epinephrine", "--resume", run_id]) == 2
    assert "omit -o to resume it" in capsys.readouterr().err
    lower_keys = [o if o == "-o" else o[0].lower() + o[1:] for o in OPTIONS]  # 'a' is the option 'A'
    assert main(["ask", QUESTION, *lower_keys, "--resume", run_id]) == 0
    assert "finished; printing its result" in capsys.readouterr().err
    assert len(_calls(tmp_path)) == 2  # only the first run called the model


@pytest.mark.slow  # ~25 s: two eval processes paced by the scripted model
def test_killed_eval_rerun_continues_each_question_from_its_last_finished_node(tmp_path: Path) -> None:
    """`ermedrag eval` killed in the middle of question 2's fan-out: the rerun skips question 1 (its row is
    written), makes question 2's missing extraction and answer only, and answers question 3."""
    questions = tmp_path / "questions.jsonl"
    texts = [
        "Which drug treats anaphylaxis first?",
        "Which drug should a new type 2 diabetic start?",
        "What is the first treatment for status asthmaticus?",
    ]
    questions.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": text, "answer": "A", "options": {"A": "yes", "B": "no"}}) + "\n"
            for i, text in enumerate(texts, 1)
        )
    )
    out = tmp_path / "out"
    cli_store = tmp_path / "cli-checkpoints.sqlite"  # `ask`'s store: an eval keeps its own in OUT
    env = _env(tmp_path, str(cli_store), SCRIPTED_COUNTING_STEP_S=str(STEP_S))
    command = [
        sys.executable,
        "-m",
        "ermedrag",
        "eval",
        "--system",
        "er_medrag",
        "--bench",
        str(questions),
        "--snippets",
        "2",
        "--concurrency",
        "1",
        "--model",
        COUNTING,
        "--out",
        str(out),
        "--trace-db",
        str(tmp_path / "traces.sqlite"),
    ]
    log = tmp_path / "killed.err"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
    try:
        _wait_for(
            lambda: len(done_keys(out / RESULTS)) == 1 and len(_calls(tmp_path)) >= 4,
            proc,
            "question 1 and one extraction of question 2",
            log,
        )
        time.sleep(SETTLE_S)
    finally:
        _kill(proc)
    before = _calls(tmp_path)
    assert len(done_keys(out / RESULTS)) == 1 and len(before) == 4, before
    assert [(agent, question) for agent, question, _ in before[3:]] == [("extractor", texts[1])]

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "'todo': 2, 'answered': 2, 'failed': 0, 'skipped_done': 1" in rerun.stdout, rerun.stdout

    calls = _calls(tmp_path)
    assert len(calls) == 3 * 3, calls  # what a clean run makes: 2 extractions + 1 answer per question
    assert len(set(calls)) == len(calls), f"a finished call was made again: {Counter(calls).most_common(2)}"
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    assert sorted(r["question_id"] for r in rows) == ["q1", "q2", "q3"] and all(r["ok"] for r in rows)
    store = TraceStore(tmp_path / "traces.sqlite")
    for row in rows:  # question 2's trace run continued across the kill: its calls and retrieval, once each
        assert len(list(store.events(run_id=row["run_id"]))) == 3 and len(store.retrievals(row["run_id"])) == 1
    assert not (out / FAILURES).exists() and not cli_store.exists()
    with sqlite3.connect(out / CHECKPOINTS) as db:  # each written row's checkpoints are deleted
        assert db.execute("SELECT COUNT(*) FROM checkpoints").fetchone() == (0,)


@BOTH_STORES
def test_failed_eval_questions_are_logged_and_continued_on_rerun(
    tmp_path: Path, checkpoint_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model server error in the respondent: logged in failures.jsonl, counted, and the rerun makes only the
    failed calls again (the extractions that finished stay done). Async checkpointer, in process."""
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": text, "answer": "A", "options": {"A": "yes", "B": "no"}}) + "\n"
            for i, text in enumerate(["Which drug treats anaphylaxis first?", "What lowers blood glucose first?"], 1)
        )
    )
    failing = tmp_path / "server-down"
    failing.touch()
    _use_env(monkeypatch, _env(tmp_path, str(tmp_path / "cli-checkpoints.sqlite"), SCRIPTED_COUNTING_FAIL=str(failing)))
    out = tmp_path / "out"
    kwargs = dict(trace_db=str(tmp_path / "traces.sqlite"), checkpoint_db=checkpoint_db, snippets_k=2)

    first = run_eval(["er_medrag"], [str(questions)], COUNTING, out, **kwargs)
    assert first == {"er_medrag": {"todo": 2, "answered": 0, "failed": 2, "skipped_done": 0}}
    failures = [json.loads(line) for line in (out / FAILURES).read_text().splitlines()]
    assert sorted(f["question_id"] for f in failures) == ["q1", "q2"]
    assert {f["error_type"] for f in failures} == {"ScriptedServerError"}
    assert all("503 Service Unavailable" in f["error"] and f["time"] > 0 and f["thread_id"] for f in failures)
    assert not done_keys(out / RESULTS)
    assert Counter(agent for agent, *_ in _calls(tmp_path)) == {"extractor": 4}

    failing.unlink()  # the server is back
    second = run_eval(["er_medrag"], [str(questions)], COUNTING, out, **kwargs)
    assert second == {"er_medrag": {"todo": 2, "answered": 2, "failed": 0, "skipped_done": 0}}
    assert Counter(agent for agent, *_ in _calls(tmp_path)) == {"extractor": 4, "respondent": 2}
    assert len(done_keys(out / RESULTS)) == 2
    assert len((out / FAILURES).read_text().splitlines()) == 2  # a log of what happened: not rewritten


def test_store_errors_name_the_store_without_its_password(tmp_path: Path) -> None:
    url = f"postgresql://ermedrag:s3cret@127.0.0.1:{free_port()}/nowhere"
    assert describe_target(url) == url.replace("s3cret", "***")
    if not _importable("langgraph.checkpoint.postgres"):
        pytest.skip("the postgres extra is not installed")
    with pytest.raises(CheckpointStoreError) as caught:
        with open_saver(url):
            pass
    assert "cannot open the checkpoint store postgresql://ermedrag:***@127.0.0.1" in str(caught.value)
    assert "s3cret" not in str(caught.value)
    blocker = tmp_path / "a-file"
    blocker.touch()
    with pytest.raises(CheckpointStoreError, match="cannot open the checkpoint store .*a-file/checkpoints.sqlite"):
        with open_saver(str(blocker / "checkpoints.sqlite")):
            pass


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True
