"""The trace store: every model call and every retrieval of every run, kept durably in SQLite.

Model calls are `events` (`TraceEvent`), retrievals are `retrievals` (`RetrievalEvent`): a table of their own,
so readers of model calls (exporters by agent, token statistics) never meet a retrieval, and stores written
before retrievals were recorded open unchanged (the table is created beside the old ones). Within a run each
table numbers its rows (`seq`); `created_at` orders the two together.

A model call's time is `latency_s` (its wall time), split where the backend can into `queue_s` (waiting for the
model) and `compute_s` (its own compute). The hf backend reports both; for other backends `compute_s` is the wall
time and `queue_s` is NULL (an OpenAI-compatible server's own queue is invisible to its client); rows written
before the split have both NULL. Opening an older store adds the missing columns.

A model call's images are kept as references, never as pixels: each message that carried some lists them under
`images` as `{"ref", "sha256"}` (`tools.images.image_record`), so no base64 blob reaches the store.

Each event is committed on its own (WAL journal, synchronous=NORMAL: a committed event survives the
process being killed), so an interrupted process loses at most the call in flight. Each thread keeps its
connection open: opening and closing one per call cost ~20 ms (the last close checkpoints the WAL).
`training/` reads only this store (and the corpus index).

A run is `finished` (its answer recorded), `failed` (`fail_run`: the error that stopped it, e.g. a model server
that did not answer) or `unfinished` (in flight, or killed): the `status` of each row that `runs`/`run` return.
A failed run keeps `finished_at` empty, so readers of finished runs (exporters) never meet it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from ermedrag.tools import settings
from ermedrag.tools.settings import cache_home

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    graph TEXT NOT NULL,
    question TEXT NOT NULL,
    gold TEXT,
    answer TEXT,
    created_at REAL NOT NULL,
    finished_at REAL,
    error TEXT,
    failed_at REAL,
    setup TEXT
);
CREATE TABLE IF NOT EXISTS events (
    event_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    node TEXT NOT NULL,
    agent TEXT NOT NULL,
    model TEXT NOT NULL,
    sampling TEXT NOT NULL,
    messages TEXT NOT NULL,
    completion TEXT NOT NULL,
    parsed TEXT,
    usage TEXT,
    logprobs TEXT,
    latency_s REAL NOT NULL,
    gold TEXT,
    inputs TEXT,
    created_at REAL NOT NULL,
    queue_s REAL,
    compute_s REAL,
    finish_reason TEXT,
    stop_sequence TEXT
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, seq);
CREATE INDEX IF NOT EXISTS events_by_agent ON events (agent);
CREATE TABLE IF NOT EXISTS retrievals (
    event_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    node TEXT NOT NULL,
    query TEXT NOT NULL,
    snippets TEXT NOT NULL,
    settings TEXT NOT NULL,
    index_info TEXT NOT NULL,
    latency_s REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS retrievals_by_run ON retrievals (run_id, seq);
"""


JSON_EVENT_FIELDS = ("sampling", "messages", "parsed", "usage", "logprobs", "inputs")
JSON_RETRIEVAL_FIELDS = ("snippets", "settings", "index_info")
# What a retrieval keeps of each snippet: enough to score it against gold evidence and to see why it ranked.
# Not the text: it is in the index (and in the prompts of the model calls that read it).
RECORDED_SNIPPET_FIELDS = ("id", "doc_id", "chunk_id", "score", "scores")
MAX_ERROR_CHARS = 2000  # a run's error is a message, not a log


def default_trace_db() -> str:
    return settings.read("ERMEDRAG_TRACE_DB") or str(cache_home() / "traces.sqlite")


@dataclass
class TraceEvent:
    """One model call."""

    run_id: str
    node: str
    agent: str
    model: str
    sampling: dict[str, Any]
    # {"role", "content"} each; a message that carried images also has "images": [{"ref", "sha256"}] (the path or
    # URL as given, a data URI as `data:<mime>;sha256=<hash>`; tools.images.image_record), never the pixels.
    messages: list[dict[str, Any]]
    completion: str
    parsed: Any
    usage: dict[str, int] | None
    logprobs: list[dict[str, Any]] | None
    latency_s: float
    gold: str | None = None
    inputs: dict[str, Any] | None = None  # what the prompt was built from (question, snippet, ...) for replay
    # `latency_s` is the call's wall time; these split it where the backend can (tools.agent_calls.call_timing):
    queue_s: float | None = None  # waiting for the model (None: unknown, e.g. an OpenAI server's own queue)
    compute_s: float | None = None  # the call's own compute (its share of a shared batch; else the wall time)
    finish_reason: str | None = None  # "stop" (a stop string or the end of sequence) or "length" (the budget)
    stop_sequence: str | None = None  # which stop string ended the call (put back at the end of `completion`)
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)


@dataclass
class RetrievalEvent:
    """One retrieval: the query, the snippets it returned (in rank order), and what produced them."""

    run_id: str
    node: str  # the graph node that retrieved ("retrieve", Med-R³'s "search")
    query: str
    snippets: list[dict[str, Any]]  # `snippet_record`s
    settings: dict[str, Any]  # k, coarse_k and every RetrievalConfig field (tools.retrieval.retrieval_settings)
    index_info: dict[str, Any]  # which index: directory, encoder, chunk count (tools.index.Index.identity)
    latency_s: float
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)


def snippet_record(snippet: Mapping[str, Any]) -> dict[str, Any]:
    """What a retrieval event keeps of one snippet (a `Snippet.to_dict()`)."""
    return {name: snippet.get(name) for name in RECORDED_SNIPPET_FIELDS}


class TraceStoreError(RuntimeError):
    """The trace store cannot be opened (a path that is not a writable folder, a file that is not SQLite)."""


def _open_failure(path: Path, err: BaseException) -> TraceStoreError:
    """One line naming the file, the cause and the knob that moves it."""
    cause = f"{type(err).__name__}: {getattr(err, 'strerror', None) or err}"
    if isinstance(err, OSError):
        advice = "make its folder writable or"
    elif isinstance(err, sqlite3.OperationalError):  # unable to open, read-only, locked
        advice = "check that the file and its folder are writable and not locked, or"
    else:  # DatabaseError: "file is not a database"
        advice = "it is not a trace store (SQLite); move it away or"
    return TraceStoreError(
        f"cannot open the trace store {path} ({cause}); {advice} point ERMEDRAG_TRACE_DB "
        "(or --trace-db / trace_db) at another file"
    )


class TraceStore:
    """A SQLite file of runs and their events. Safe to use from many threads (one connection per call).

    Opening it raises `TraceStoreError` (naming the file) when it cannot be created or is not a trace store.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._local = threading.local()
        try:
            self._open()
        except (OSError, sqlite3.Error) as err:
            db = getattr(self._local, "db", None)
            if db is not None:
                db.close()
            raise _open_failure(self.path, err) from err

    def _open(self) -> None:
        """Create the file and its tables, and bring a store written by an older version up to date."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = self._connect()
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        # Stores written by older versions: events before they kept their inputs or split queue from compute
        # time (old rows read None there), runs before they could fail.
        _add_missing_columns(
            db,
            "events",
            (
                ("inputs", "TEXT"),
                ("queue_s", "REAL"),
                ("compute_s", "REAL"),
                ("finish_reason", "TEXT"),
                ("stop_sequence", "TEXT"),
            ),
        )
        _add_missing_columns(db, "runs", (("error", "TEXT"), ("failed_at", "REAL"), ("setup", "TEXT")))

    def _connect(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    def start_run(self, run_id: str, graph: str, question: dict[str, Any], gold: str | None) -> None:
        db = self._connect()
        db.execute(
            "INSERT OR IGNORE INTO runs (run_id, graph, question, gold, created_at) VALUES (?, ?, ?, ?, ?)",
            (run_id, graph, json.dumps(question), gold, time.time()),
        )

    def finish_run(self, run_id: str, answer: dict[str, Any]) -> None:
        """Record the run's answer. A run that failed before and was resumed to the end is finished."""
        db = self._connect()
        db.execute(
            "UPDATE runs SET answer = ?, finished_at = ?, error = NULL, failed_at = NULL WHERE run_id = ?",
            (json.dumps(answer), time.time(), run_id),
        )

    def record_setup(self, run_id: str, setup: dict[str, float]) -> None:
        """Record what loading took before the run's stages (`graphs.steps.prepare`): seconds per part."""
        self._connect().execute("UPDATE runs SET setup = ? WHERE run_id = ?", (json.dumps(setup), run_id))

    def fail_run(self, run_id: str, error: str) -> None:
        """Mark the run failed with the (one-line) error that stopped it; a finished run stays finished."""
        db = self._connect()
        db.execute(
            "UPDATE runs SET error = ?, failed_at = ? WHERE run_id = ? AND finished_at IS NULL",
            (error[:MAX_ERROR_CHARS], time.time(), run_id),
        )

    def add_event(self, event: TraceEvent) -> None:
        self._append("events", asdict(event), JSON_EVENT_FIELDS)

    def add_retrieval(self, retrieval: RetrievalEvent) -> None:
        self._append("retrievals", asdict(retrieval), JSON_RETRIEVAL_FIELDS)

    def _append(self, table: str, row: dict[str, Any], json_fields: tuple[str, ...]) -> None:
        """Insert `row` into `table` as the run's next `seq` of that table."""
        for key in json_fields:
            row[key] = json.dumps(row[key])
        db = self._connect()
        db.execute("BEGIN IMMEDIATE")  # seq = rows so far: count and insert in one transaction
        try:
            (row["seq"],) = db.execute(f"SELECT COUNT(*) FROM {table} WHERE run_id = ?", (row["run_id"],)).fetchone()
            db.execute(
                f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values())
            )
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def runs(self, limit: int | None = None) -> list[dict[str, Any]]:
        query = (
            "SELECT r.*, (SELECT COUNT(*) FROM events e WHERE e.run_id = r.run_id) AS n_events, "
            "(SELECT COUNT(*) FROM retrievals t WHERE t.run_id = r.run_id) AS n_retrievals "
            "FROM runs r ORDER BY created_at DESC"
        )
        db = self._connect()
        rows = db.execute(query + (" LIMIT ?" if limit else ""), (limit,) if limit else ()).fetchall()
        return [_with_status(_decode(row)) for row in rows]

    def run(self, run_id: str) -> dict[str, Any] | None:
        db = self._connect()
        row = db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return _with_status(_decode(row)) if row else None

    def events(self, run_id: str | None = None, agent: str | None = None) -> Iterator[dict[str, Any]]:
        clauses, params = [], []
        if run_id:
            clauses.append("run_id = ?")
            params.append(run_id)
        if agent:
            clauses.append("agent = ?")
            params.append(agent)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._connect().execute(f"SELECT * FROM events{where} ORDER BY created_at, seq", params).fetchall()
        return iter([_decode(row) for row in rows])

    def retrievals(self, run_id: str) -> list[dict[str, Any]]:
        """The run's retrievals in the order they ran."""
        rows = self._connect().execute("SELECT * FROM retrievals WHERE run_id = ? ORDER BY seq", (run_id,)).fetchall()
        return [_decode(row) for row in rows]


def _add_missing_columns(db: sqlite3.Connection, table: str, wanted: tuple[tuple[str, str], ...]) -> None:
    present = {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}
    for name, kind in wanted:
        if name not in present:
            try:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
            except sqlite3.OperationalError as err:  # another process opening the store added it first
                if "duplicate column" not in str(err):
                    raise


def run_status(run: Mapping[str, Any]) -> str:
    """finished | failed | unfinished (in flight, or its process was killed)."""
    if run.get("finished_at") is not None:
        return "finished"
    return "failed" if run.get("error") else "unfinished"


def _with_status(run: dict[str, Any]) -> dict[str, Any]:
    return run | {"status": run_status(run)}


def _decode(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    for key in ("question", "answer", "setup", *JSON_EVENT_FIELDS, *JSON_RETRIEVAL_FIELDS):
        if isinstance(out.get(key), str):
            out[key] = json.loads(out[key])
    return out
