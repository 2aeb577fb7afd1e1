"""Durable runs: a graph run with a LangGraph checkpointer, so a killed run continues from its last finished node.

    with open_saver(default_checkpoint_db()) as saver:
        state = run_durably(durable(load_graph("er_medrag"), saver), run_id, inputs, context=context)

The checkpointer is how a graph is run, not what it computes, so it is no context field: the CLI and the eval
runner open one and attach it (`durable`). The compiled graphs in their modules stay checkpointer-free, because
`langgraph dev`/Studio and LangGraph servers attach their own.

Where checkpoints live: a SQLite file (default `~/.cache/ermedrag/checkpoints.sqlite`, env ERMEDRAG_CHECKPOINT_DB)
or a Postgres URL (`postgres://…` / `postgresql://…`, needs the `postgres` extra). A run's checkpoints are one
LangGraph thread; the CLI uses the run id as thread id, the eval runner one per question and sample.

Runs use durability "sync": each superstep's checkpoint is written before the next superstep starts, and each
task's writes as soon as it finishes; LangGraph keeps the writes of the finished tasks of an interrupted
superstep, so the extractions that finished before a kill are not redone. What a resume repeats: the nodes
that were in flight when the process died (their model calls are made again).
"""

from __future__ import annotations

import json
import hashlib
import logging
import sqlite3
from contextlib import AbstractContextManager, AsyncExitStack, ExitStack, asynccontextmanager, closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.types import Durability

from ermedrag.tools import settings
from ermedrag.tools.records import locks
from ermedrag.graphs.registry import GRAPHS, load_graph
from ermedrag.tools.settings import cache_home


class _LateWriteAfterFailure(logging.Filter):
    """When one task of a fan-out fails, LangGraph stops the step and shuts its executor down; a sibling task that
    ends a moment later then cannot save its writes, and `concurrent.futures` logs that as a traceback on stderr
    ("cannot schedule new futures after shutdown") under the run's one clear error. The failed run is redone from
    its last checkpoint on resume either way (that sibling's call included), so the record says nothing: drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, RuntimeError) and "cannot schedule new futures after shutdown" in str(error))


logging.getLogger("concurrent.futures").addFilter(_LateWriteAfterFailure())

if TYPE_CHECKING:
    from langgraph.graph.state import CompiledStateGraph

DURABILITY: Durability = "sync"  # a checkpoint per superstep before the next one starts: what a kill leaves is whole
GRAPH_KEY = "ermedrag_graph"  # checkpoint metadata: which registered graph the thread runs
CONTEXT_KEY = "ermedrag_context"  # checkpoint metadata: the run's context (JSON), so a resume needs no flags
POSTGRES_SCHEMES = ("postgres://", "postgresql://")
SQLITE_TIMEOUT_S = 30  # two processes (an `ask` and an eval) may write the same file at once


class CheckpointStoreError(ValueError):
    """The checkpoint store cannot be opened, or holds no such run (a user error: the CLI prints it)."""


@dataclass(frozen=True)
class SavedRun:
    """A thread's latest checkpoint, as the CLI needs it to resume the run."""

    graph: str
    context: dict[str, Any]
    values: dict[str, Any]  # the state so far
    finished: bool  # nothing left to run: a resume just returns `values`


def default_checkpoint_db() -> str:
    """ERMEDRAG_CHECKPOINT_DB (a file or a Postgres URL), else `checkpoints.sqlite` in the ermedrag cache (beside
    the default trace store)."""
    return settings.read("ERMEDRAG_CHECKPOINT_DB") or str(cache_home() / "checkpoints.sqlite")


def is_postgres_url(target: str) -> bool:
    return target.startswith(POSTGRES_SCHEMES)


def describe_target(target: str) -> str:
    """The store for messages: a Postgres URL with its password masked."""
    if not is_postgres_url(target):
        return str(Path(target).expanduser())
    parts = urlsplit(target)
    if parts.password is not None:
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}")
    query = [(key, "***" if key == "password" else value) for key, value in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(query=urlencode(query, safe="*")))


def run_lock(run_id: str, target: str) -> AbstractContextManager[None]:
    """One process answers a run at a time: a second `ask --resume` of the same run would make every unfinished
    model call twice and record both. The lock is a file beside a SQLite store (for a Postgres store, in the
    ermedrag cache: one machine); a run whose process died is free again."""
    if is_postgres_url(target):
        folder = cache_home() / "run-locks" / hashlib.sha256(describe_target(target).encode()).hexdigest()[:16]
    else:
        store = Path(_sqlite_path(target))
        folder = store.parent / f".{store.name}.run-locks"
    name = hashlib.sha256(run_id.encode()).hexdigest()[:32]  # a run id is the user's text: never a path
    return locks.held(folder / f"{name}.lock", f"run {run_id}", "wait for it to finish, or stop it and resume again")


@contextmanager
def open_saver(target: str) -> Iterator[BaseCheckpointSaver]:
    """A ready checkpointer (tables created) for a graph run with `invoke`; closed on exit."""
    with ExitStack() as stack:
        with _store_errors(target):  # only opening: errors of the run itself pass through unchanged
            if is_postgres_url(target):
                PostgresSaver = _postgres_module("langgraph.checkpoint.postgres").PostgresSaver
                saver = stack.enter_context(PostgresSaver.from_conn_string(target))
            else:
                from langgraph.checkpoint.sqlite import SqliteSaver

                conn = stack.enter_context(
                    closing(sqlite3.connect(_sqlite_path(target), timeout=SQLITE_TIMEOUT_S, check_same_thread=False))
                )
                conn.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives the process being killed
                saver = SqliteSaver(conn)
            saver.setup()
        yield saver


@asynccontextmanager
async def open_async_saver(target: str) -> AsyncIterator[BaseCheckpointSaver]:
    """`open_saver` for a graph run with `ainvoke` (the eval runner)."""
    async with AsyncExitStack() as stack:
        with _store_errors(target):
            if is_postgres_url(target):
                AsyncPostgresSaver = _postgres_module("langgraph.checkpoint.postgres.aio").AsyncPostgresSaver
                saver = await stack.enter_async_context(AsyncPostgresSaver.from_conn_string(target))
            else:
                import aiosqlite
                from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

                conn = await stack.enter_async_context(
                    aiosqlite.connect(_sqlite_path(target), timeout=SQLITE_TIMEOUT_S)
                )
                await conn.execute("PRAGMA synchronous=NORMAL")
                saver = AsyncSqliteSaver(conn)
            await saver.setup()
        yield saver


def durable(graph: CompiledStateGraph, saver: BaseCheckpointSaver) -> CompiledStateGraph:
    """`graph` run with `saver` (a copy: the registered graph stays checkpointer-free)."""
    return graph.copy(update={"checkpointer": saver})


def run_config(
    thread_id: str, graph_name: str | None = None, context: Mapping[str, Any] | None = None
) -> RunnableConfig:
    """The config of a thread; with `graph_name`/`context`, every checkpoint records them (for `saved_run`)."""
    metadata = {}
    if graph_name:
        metadata[GRAPH_KEY] = graph_name
    if context is not None:
        metadata[CONTEXT_KEY] = json.dumps(dict(context), sort_keys=True, default=str)
    return {"configurable": {"thread_id": thread_id}, "metadata": metadata}


def run_durably(
    graph: CompiledStateGraph, config: RunnableConfig, inputs: Mapping[str, Any], context: Mapping[str, Any]
) -> dict[str, Any]:
    """Run the thread of `config`: start it with `inputs` when it has no checkpoint, else continue it from its
    last finished node (`inputs` unused), else (finished) return its final state without running anything."""
    snapshot = graph.get_state(config)
    if snapshot.metadata is None:
        return graph.invoke(dict(inputs), config, context=dict(context), durability=DURABILITY)
    if snapshot.next:
        return graph.invoke(None, config, context=dict(context), durability=DURABILITY)
    return dict(snapshot.values)


async def arun_durably(
    graph: CompiledStateGraph, config: RunnableConfig, inputs: Mapping[str, Any], context: Mapping[str, Any]
) -> dict[str, Any]:
    """`run_durably` with `ainvoke`."""
    snapshot = await graph.aget_state(config)
    if snapshot.metadata is None:
        return await graph.ainvoke(dict(inputs), config, context=dict(context), durability=DURABILITY)
    if snapshot.next:
        return await graph.ainvoke(None, config, context=dict(context), durability=DURABILITY)
    return dict(snapshot.values)


def saved_run(saver: BaseCheckpointSaver, thread_id: str, target: str) -> SavedRun:
    """The latest checkpoint of `thread_id` (graph, context, state so far), or an error naming the store."""
    saved = saver.get_tuple(run_config(thread_id))
    if saved is None:
        raise CheckpointStoreError(
            f"no run {thread_id!r} to resume in the checkpoint store {describe_target(target)} "
            "(runs started elsewhere: pass --checkpoint-db or set ERMEDRAG_CHECKPOINT_DB)"
        )
    graph_name = saved.metadata.get(GRAPH_KEY)
    if graph_name not in GRAPHS:
        raise CheckpointStoreError(
            f"run {thread_id!r} in {describe_target(target)} records no known graph "
            f"({graph_name!r}); it was not started by ermedrag"
        )
    context = _json_object(saved.metadata.get(CONTEXT_KEY))
    snapshot = durable(load_graph(graph_name), saver).get_state(run_config(thread_id))
    return SavedRun(graph=graph_name, context=context, values=dict(snapshot.values), finished=not snapshot.next)


def _json_object(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text) if isinstance(text, str) else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _sqlite_path(target: str) -> str:
    path = Path(target).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def _postgres_module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise CheckpointStoreError(
            "a Postgres checkpoint store needs `pip install 'ermedrag[postgres]'` "
            f"(langgraph-checkpoint-postgres, psycopg[binary]): {err}"
        ) from None


@contextmanager
def _store_errors(target: str) -> Iterator[None]:
    """Errors opening the store, as one that names it (without a Postgres password)."""
    try:
        yield
    except CheckpointStoreError:
        raise
    except (sqlite3.Error, OSError) as err:
        raise CheckpointStoreError(f"cannot open the checkpoint store {describe_target(target)}: {err}") from None
    except Exception as err:  # psycopg's errors (psycopg may not be installed: no class to name here)
        if type(err).__module__.startswith("psycopg"):
            raise CheckpointStoreError(
                f"cannot open the checkpoint store {describe_target(target)}: {type(err).__name__}: {err}"
            ) from None
        raise
