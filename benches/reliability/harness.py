"""What every reliability case shares: the outcome classes, the case registry, the workspace, and the judges
that turn what a public surface did (returned, raised, exited) into an outcome.

Outcomes (each case declares what correct looks like in `expect`):

- `ok`: the expected correct result.
- `clear_error`: an expected refusal. In-process: an exception of a user-facing type (not a programming error
  such as TypeError/KeyError/AttributeError/UnicodeError) whose message names the field, file, URL or setting at
  fault. CLI: exit code != 0, no `Traceback` on stderr, exactly one error line (`error: ...`, or argparse's
  `ermedrag ...: error: ...`) that names it; progress lines printed before the work started (`Run id: ...`) are
  allowed.
- `silent_wrong`: a result that is wrong without saying so: a forged or changed answer, `ok` disagreeing with
  `error`, undefused markup from a document in a prompt, options accepted that must be refused, a run whose
  trace record says `unfinished` (as if still running) although the run failed, a report that counts a question
  twice.
- `crash`: an unexpected exception, a traceback, a refusal where an answer was expected, or an error that does
  not name what is wrong.
- `hang`: the case ran past its time bound (the runner abandons it), or returned but far later than the bound its
  settings promise (timeouts × retries + backoff + slack), or a parser was not linear on 1 MB (`linear_time`).
- `data_lost`: something recorded or indexed lost or inconsistent: chunks that do not cover a document, chunk
  counts that disagree between BM25, Chroma and the manifest, an index that no longer opens after a kill, a
  recorded answer that differs from the returned one, a finished model call made again after a resume.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from ermedrag.offline import go_offline

REPO = Path(__file__).resolve().parents[2]
OUTCOMES = ("ok", "clear_error", "silent_wrong", "crash", "hang", "data_lost")
FAILURES = ("silent_wrong", "crash", "hang", "data_lost")
MAX_DETAIL_CHARS = 600
# Exceptions that are bugs, whatever their message: never a clear error.
PROGRAMMING_ERRORS = (
    AssertionError,
    AttributeError,
    KeyError,
    IndexError,
    TypeError,
    NameError,
    UnicodeError,
    RecursionError,
    ZeroDivisionError,
    NotImplementedError,
    MemoryError,
)
ERROR_LINE = re.compile(r"^(?:error: |ermedrag(?: \S+)?: error: )")
SCRIPTED = "scripted:ermedrag.testing.scripted"  # answers the first option
PARROT = "scripted:benches.reliability.scripted_parrot"  # quotes what it reads, answers B
PARROT_ANSWER = "B"


@dataclass(frozen=True)
class Verdict:
    outcome: str
    detail: str = ""

    def __post_init__(self) -> None:
        assert self.outcome in OUTCOMES, self.outcome


def ok(detail: str = "") -> Verdict:
    return Verdict("ok", detail)


def clear_error(detail: str) -> Verdict:
    return Verdict("clear_error", detail)


def silent_wrong(detail: str) -> Verdict:
    return Verdict("silent_wrong", detail)


def crash(detail: str) -> Verdict:
    return Verdict("crash", detail)


def hang(detail: str) -> Verdict:
    return Verdict("hang", detail)


def data_lost(detail: str) -> Verdict:
    return Verdict("data_lost", detail)


@dataclass(frozen=True)
class Case:
    """One hostile case: `run(workspace)` returns a Verdict; past `timeout_s` the runner calls it a hang."""

    name: str
    category: str
    expect: str
    run: Callable[["Workspace"], Verdict]
    quick: bool = False
    timeout_s: float = 60.0


CASES: list[Case] = []


def register(
    name: str, category: str, expect: str, *, quick: bool = False, timeout_s: float = 60.0
) -> Callable[[Callable[["Workspace"], Verdict]], Callable[["Workspace"], Verdict]]:
    def add(run: Callable[["Workspace"], Verdict]) -> Callable[["Workspace"], Verdict]:
        CASES.append(Case(name, category, expect, run, quick, timeout_s))
        return run

    return add


def one_line(text: Any, limit: int = MAX_DETAIL_CHARS) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def error_text(err: BaseException) -> str:
    return one_line(f"{type(err).__name__}: {err}")


# ------------------------------------------------------------------------------------------------ workspace


class Workspace:
    """A temporary folder for one bench run: its trace store and checkpoint store (the environment points every
    graph and CLI call there, never at the user's cache), and fixtures built once on first use."""

    def __init__(self, root: Path):
        self.root = root
        self.trace_db = root / "traces.sqlite"
        self.checkpoint_db = root / "checkpoints.sqlite"
        self._fixtures: dict[str, Any] = {}
        self._lock = threading.RLock()

    def path(self, name: str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def fixture(self, name: str, build: Callable[[], Any]) -> Any:
        with self._lock:
            if name not in self._fixtures:
                self._fixtures[name] = build()
            return self._fixtures[name]

    def trace_run(self, run_id: str) -> dict[str, Any] | None:
        from ermedrag.tools.records.traces import TraceStore

        return TraceStore(self.trace_db).run(run_id)

    def trace_events(self, run_id: str) -> list[dict[str, Any]]:
        from ermedrag.tools.records.traces import TraceStore

        return list(TraceStore(self.trace_db).events(run_id=run_id))

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a child process: this workspace's stores, offline, and the repository importable
        (the scripted models live in `benches.reliability` and `tests`)."""
        return {**os.environ, "PYTHONPATH": str(REPO), **extra}


# Settings a user's shell may hold that would change what the cases run.
CLEARED_ENV = (
    "ERMEDRAG_INDEX_DIR",
    "ERMEDRAG_MODEL",
    "ERMEDRAG_EXTRACTOR_MODEL",
    "ERMEDRAG_RESPONDENT_MODEL",
    "OPENAI_BASE_URL",
    "ERMEDRAG_SNIPPETS_K",
    "ERMEDRAG_COARSE_K",
    "ERMEDRAG_CHROMA_URL",
    "ERMEDRAG_RERANKER",
    "ERMEDRAG_TEMPERATURE",
    "ERMEDRAG_REQUEST_TIMEOUT_S",
    "ERMEDRAG_CONNECT_TIMEOUT_S",
    "ERMEDRAG_MAX_RETRIES",
    "ERMEDRAG_RETRY_BACKOFF_S",
    "ERMEDRAG_INDEX_PAUSE",
    "SCRIPTED_COUNTING_CALLS",
    "SCRIPTED_COUNTING_STEP_S",
    "SCRIPTED_COUNTING_FAIL",
    "ERMEDRAG_MAX_SEARCHES",
    "ERMEDRAG_SEARCH_K",
)


def prepare_environment(workspace: Workspace) -> None:
    for name in CLEARED_ENV:
        os.environ.pop(name, None)
    go_offline()
    os.environ.setdefault("ERMEDRAG_TORCH_THREADS", "1")
    os.environ["ERMEDRAG_TRACE_DB"] = str(workspace.trace_db)
    os.environ["ERMEDRAG_CHECKPOINT_DB"] = str(workspace.checkpoint_db)


@contextlib.contextmanager
def patched_env(**values: str | None) -> Iterator[None]:
    """Set (or, with None, remove) environment variables for the duration of a case."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ------------------------------------------------------------------------------------------------ judges


def names_any(message: str, names: Sequence[str]) -> bool:
    lowered = message.lower()
    return not names or any(name.lower() in lowered for name in names)


def judge_error(err: BaseException, names: Sequence[str], *, refusal_expected: bool = True) -> Verdict:
    """An exception from a public surface: a clear error when it is a user-facing type naming one of `names`."""
    message = error_text(err)
    if isinstance(err, PROGRAMMING_ERRORS):
        return crash(f"unexpected {message}")
    if not refusal_expected:
        return crash(f"refused where an answer was expected: {message}")
    if not names_any(str(err), names):
        return crash(f"error does not name {' / '.join(names)}: {message}")
    return clear_error(message)


def judge_call(
    call: Callable[[], Any],
    check: Callable[[Any], Verdict],
    names: Sequence[str] = (),
    *,
    refusal_expected: bool = True,
) -> Verdict:
    """Call a public function: its result judged by `check`, an exception by `judge_error`."""
    try:
        result = call()
    except Exception as err:  # noqa: BLE001 - classifying it is the point
        return judge_error(err, names, refusal_expected=refusal_expected)
    return check(result)


def must_refuse(what: str) -> Callable[[Any], Verdict]:
    """`check` for calls that must be refused: any result is wrong without saying so."""
    return lambda result: silent_wrong(f"accepted {what} (must be refused); returned {one_line(repr(result), 200)}")


# ------------------------------------------------------------------------------------------------ the CLI


@dataclass
class CliResult:
    rc: int | None  # None: timed out (killed)
    stdout: str
    stderr: str
    seconds: float
    exception: BaseException | None = None  # in-process: what escaped `main`

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if ERROR_LINE.match(line)]

    def run_id(self) -> str | None:
        match = re.search(r"^Run id: ([0-9a-f]{32})", self.stderr, re.MULTILINE)
        return match.group(1) if match else None


_cli_lock = threading.Lock()  # stdout/stderr redirection is process-wide: one in-process CLI call at a time


def cli_in_process(argv: Sequence[str], **env: str | None) -> CliResult:
    """`ermedrag.cli.main(argv)` in this process, its output captured (argparse's SystemExit is its exit code)."""
    from ermedrag.cli import main

    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    rc: int | None = None
    escaped: BaseException | None = None
    with _cli_lock, patched_env(**env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException as caught:  # noqa: BLE001 - a traceback is a crash, recorded as one
            escaped = caught
            rc = 1
            err.write(traceback.format_exc())
    return CliResult(rc, out.getvalue(), err.getvalue(), time.perf_counter() - started, escaped)


def cli_subprocess(
    argv: Sequence[str | bytes], env: Mapping[str, str], timeout_s: float, cwd: Path = REPO
) -> CliResult:
    """`python -m ermedrag ARGV` as a real process (its own session, killed with its children on timeout)."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "ermedrag", *argv]  # POSIX takes str and bytes arguments side by side
    proc = subprocess.Popen(
        command, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        rc = None
    return CliResult(rc, out.decode(errors="replace"), err.decode(errors="replace"), time.perf_counter() - started)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kill a process started with start_new_session=True, with everything it spawned."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def traceback_error(stderr: str) -> str:
    """The exception line of a printed traceback (the last `Name: message` line; notes may follow it)."""
    lines = [
        line for line in stderr.strip().splitlines() if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line)
    ]
    return one_line(lines[-1] if lines else stderr.strip().splitlines()[-1] if stderr.strip() else "?")


def judge_cli(
    result: CliResult,
    names: Sequence[str],
    *,
    check: Callable[[CliResult], Verdict] | None = None,
    refusal_expected: bool = True,
) -> Verdict:
    """A CLI call: exit 0 is judged by `check` (None: an answer where a refusal was expected is wrong); a
    non-zero exit must be one clear error line naming one of `names`, without a traceback."""
    if result.rc is None:
        return hang(f"still running after {result.seconds:.0f} s (killed)")
    if result.exception is not None or "Traceback (most recent call last)" in result.stderr:
        return crash(f"exit {result.rc} with a traceback: {traceback_error(result.stderr)}")
    if result.rc == 0:
        if check is None:
            return silent_wrong(f"exit 0 where a refusal was expected; stdout: {one_line(result.stdout, 200)}")
        return check(result)
    lines = result.error_lines
    if len(lines) != 1:
        return crash(f"exit {result.rc} with {len(lines)} error lines; stderr: {one_line(result.stderr[-400:])}")
    if not refusal_expected:
        return crash(f"exit {result.rc}, refused where an answer was expected: {one_line(lines[0])}")
    if not names_any(lines[0], names):
        return crash(f"exit {result.rc}, the error line does not name {' / '.join(names)}: {one_line(lines[0])}")
    return clear_error(f"exit {result.rc}: {one_line(lines[0])}")


# ------------------------------------------------------------------------------------------------ answers


def answer_problem(state: Mapping[str, Any], expected: str | None) -> str | None:
    """What is wrong with a graph's final answer (None: it is `expected`, ok agrees with error, and the trace run
    recorded the same answer)."""
    answer = state.get("answer") or {}
    if answer.get("ok") != (answer.get("error") is None):
        return f"ok={answer.get('ok')} but error={answer.get('error')!r}"
    if answer.get("answer") != expected:
        return f"answer {answer.get('answer')!r}, the model wrote {expected!r} (error={answer.get('error')!r})"
    if not answer.get("ok"):
        return f"answer not ok: {answer.get('error')!r}"
    return None


def recorded_answer_problem(state: Mapping[str, Any], workspace: Workspace) -> str | None:
    """The trace run of `state` must hold the answer the graph returned."""
    run = workspace.trace_run(state.get("run_id") or "")
    if run is None:
        return f"no trace run {state.get('run_id')!r}"
    recorded = (run.get("answer") or {}).get("answer")
    if run.get("status") != "finished" or recorded != (state.get("answer") or {}).get("answer"):
        return f"trace run is {run.get('status')} with answer {recorded!r}"
    return None


def wait_for(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


@dataclass
class Timer:
    started: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started
