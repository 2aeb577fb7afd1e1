"""The batch runner: questions × systems through the real graphs, concurrent, resumable.

Each finished question is appended to `OUT/results.jsonl` (a `tools.jsonl.AppendLog`) under a key made of the
run configuration and the question id; a rerun skips what is already there. Each question in flight runs with a
checkpointer (`graphs.durable`, `OUT/checkpoints.sqlite` by default) in a thread named after its key, so a rerun
after a kill continues it from its last finished node: no finished model call is made again. A question that
fails (a model server error, ...) is logged in `OUT/failures.jsonl` and continued the same way on the next run.
Every question is also a trace run (evals feed training).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from langgraph.checkpoint.base import BaseCheckpointSaver

from ermedrag.tools.benchmarks import BadRow, Question, load_benchmark, load_questions_file
from ermedrag.tools.chat_models import ModelServerError
from ermedrag.graphs.durable import arun_durably, describe_target, durable, open_async_saver, run_config
from ermedrag.graphs.registry import context_fields, graph_spec, load_graph, resolved_settings
from ermedrag.tools.jsonl import AppendLog, read_records
from ermedrag.tools.traces import TraceStore, default_trace_db

RESULTS = "results.jsonl"
BAD_ROWS = "bad_rows.jsonl"
FAILURES = "failures.jsonl"
LOCK = ".lock"
CHECKPOINTS = "checkpoints.sqlite"
MAX_ERROR_CHARS = 2000  # a server's error text is untrusted and unbounded


@dataclass(frozen=True)
class EvalConfig:
    """What defines a result: the graph, every setting it uses (`graphs.registry`), the samples per question.
    Change any of them and the questions are answered again. `plumbing` holds the other context fields given
    (where the vectors are served, ...): they reach the graph but do not change its answers, so not the key."""

    system: str
    settings: dict[str, Any] = field(default_factory=dict)
    samples: int = 1
    plumbing: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_graph(cls, system: str, overrides: Mapping[str, Any] | None = None, samples: int = 1) -> EvalConfig:
        """`system`'s settings with `overrides` (context fields; None = the default) applied."""
        known = context_fields(system)
        given = {key: value for key, value in (overrides or {}).items() if value is not None and key in known}
        settings = resolved_settings(system, given)
        if samples > 1 and settings.get("temperature", 0) <= 0:
            raise ValueError("--samples > 1 measures answer entropy and needs --temperature > 0")
        plumbing = {key: value for key, value in given.items() if key not in settings}
        load_graph(system).context_schema(**settings, **plumbing)  # a bad value fails here, before any question
        return cls(system=system, settings=settings, samples=samples, plumbing=plumbing)

    @property
    def model(self) -> str:
        """The chat models the graph uses, for labels: one name when every role has the same model."""
        models = [str(v) for k, v in self.settings.items() if k.endswith("_model") and v]
        return " + ".join(dict.fromkeys(models))

    def record(self) -> dict[str, Any]:
        return {"system": self.system, "model": self.model, "settings": self.settings, "samples": self.samples}

    def key(self) -> str:
        identity = {"system": self.system, "settings": self.settings, "samples": self.samples}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def context(self, base_url: str | None, trace_db: str) -> dict[str, Any]:
        return {**self.plumbing, **self.settings, "trace_db": trace_db, **({"base_url": base_url} if base_url else {})}


def parse_overrides(pairs: Iterable[str], systems: Iterable[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings → context overrides, each value converted to the type of the field it sets; a key
    that no graph in `systems` has is an error naming the keys they do have."""
    types: dict[str, Any] = {}
    for system in systems:
        schema = load_graph(system).context_schema
        types.update(typing.get_type_hints(schema))
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or key not in types:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE with KEY among {', '.join(sorted(types))}")
        kind = types[key]
        try:
            overrides[key] = kind(value) if kind in (int, float) else value
        except ValueError:
            raise ValueError(f"--set {pair!r}: {key} takes a {kind.__name__}") from None
    return overrides


def done_keys(path: Path) -> set[tuple[str, str, str, int]]:
    """Keys already recorded (a line cut short by a kill is not one: its question is redone)."""
    return {(r["config_key"], r["benchmark"], r["question_id"], r["sample"]) for r in read_records(path)
            if {"config_key", "benchmark", "question_id", "sample"} <= r.keys()}


def question_thread(out_dir: Path, config: EvalConfig, question: Question, sample: int) -> str:
    """The checkpoint thread of one (config, question, sample) of this results folder: the same on every rerun
    (so a rerun finds it), different for another folder (so folders sharing a Postgres store never meet)."""
    identity = [str(out_dir.resolve()), config.key(), question.benchmark, question.id, sample]
    return "eval-" + hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]


def failure_record(config: EvalConfig, question: Question, sample: int, thread_id: str,
                   err: BaseException) -> dict[str, Any]:
    """One line of `failures.jsonl`: which question failed, how, and when."""
    return {"config_key": config.key(), "system": config.system, "benchmark": question.benchmark,
            "question_id": question.id, "sample": sample, "thread_id": thread_id, "error_type": type(err).__name__,
            "error": str(err)[:MAX_ERROR_CHARS], "time": time.time()}


def respondent_stats(store: TraceStore, run_id: str) -> dict[str, Any]:
    """Tokens over the whole run, and the mean token entropy of the respondent's completion (when known)."""
    output_tokens, entropy = 0, None
    for event in store.events(run_id=run_id):
        output_tokens += (event.get("usage") or {}).get("output_tokens", 0)
        if event["agent"] == "respondent":
            values = [t["entropy"] for t in event.get("logprobs") or [] if t.get("entropy") is not None]
            entropy = sum(values) / len(values) if values else None
    return {"output_tokens": output_tokens, "token_entropy": entropy}


def result_row(config: EvalConfig, question: Question, sample: int, state: dict[str, Any],
               store: TraceStore, seconds: float) -> dict[str, Any]:
    answer = state.get("answer") or {}
    return {
        "config_key": config.key(), "config": config.record(), "benchmark": question.benchmark,
        "question_id": question.id, "subject": question.subject, "sample": sample, "gold": question.answer,
        "answer": answer.get("answer"), "ok": bool(answer.get("ok")), "well_formed": bool(answer.get("well_formed")),
        "extracted": bool(answer.get("extracted")), "correct": answer.get("answer") == question.answer,
        "error": answer.get("error"),
        "run_id": state.get("run_id"), "timings": state.get("timings", {}), "seconds": seconds,
        **respondent_stats(store, state["run_id"]),
    }


async def run_questions(
    config: EvalConfig,
    questions: list[Question],
    out_dir: Path,
    *,
    concurrency: int = 8,
    base_url: str | None = None,
    trace_db: str | None = None,
    checkpoint_db: str | None = None,
    progress: bool = True,
) -> dict[str, int]:
    """Answer every (question, sample) not yet recorded for `config`, each continued from its checkpoint when a
    killed or failed run left one (`checkpoint_db`: a file or a Postgres URL; None = `OUT/checkpoints.sqlite`);
    returns counts."""
    checkpoint_db = checkpoint_db or str(out_dir / CHECKPOINTS)
    async with open_async_saver(checkpoint_db) as saver:
        return await _run_questions(config, questions, out_dir, saver, concurrency=concurrency, base_url=base_url,
                                    trace_db=trace_db, checkpoint_db=checkpoint_db, progress=progress)


async def _run_questions(config: EvalConfig, questions: list[Question], out_dir: Path, saver: BaseCheckpointSaver, *,
                         concurrency: int, base_url: str | None, trace_db: str | None, checkpoint_db: str,
                         progress: bool) -> dict[str, int]:
    from tqdm.auto import tqdm

    graph = durable(load_graph(config.system), saver)
    trace_db = trace_db or default_trace_db()
    store = TraceStore(trace_db)
    context = config.context(base_url, trace_db)
    results = out_dir / RESULTS
    done = done_keys(results)
    todo = [(q, s) for q in questions for s in range(config.samples)
            if (config.key(), q.benchmark, q.id, s) not in done]
    writer = AppendLog(results)
    failure_log: AppendLog | None = None  # opened at the first failure: a clean run leaves no empty file
    semaphore = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    server_down: list[ModelServerError] = []  # set at the first question that could not reach its model server
    # Sync graph nodes run in the loop's executor: size it so `concurrency` questions (each fanning out
    # to snippets_k extractor calls) never queue behind each other's threads.
    loop = asyncio.get_running_loop()
    fan_out = int(config.settings.get("snippets_k", 0))
    loop.set_default_executor(ThreadPoolExecutor(max_workers=concurrency * (fan_out + 2)))
    bar = tqdm(total=len(todo), desc=f"{config.system} {config.model}", unit="q", disable=not progress)

    async def answer(question: Question, sample: int) -> None:
        nonlocal failure_log
        async with semaphore:
            if server_down:  # the rest would each wait (retries + 1) × timeout to fail the same way
                return
            started = time.perf_counter()
            thread_id = question_thread(out_dir, config, question, sample)
            # The run id is new on a fresh start and kept in the checkpoint on a resume (the trace run continues).
            inputs = {"question": question.question, "options": question.options, "gold": question.answer,
                      "run_id": uuid.uuid4().hex}
            try:
                state = await arun_durably(graph, run_config(thread_id, config.system, context), inputs, context)
            except Exception as err:  # noqa: BLE001 - recorded, continued from its checkpoint on the next run
                failure_log = failure_log or AppendLog(out_dir / FAILURES)
                failure_log.write(failure_record(config, question, sample, thread_id, err))
                failures.append(f"{question.benchmark}/{question.id}: {type(err).__name__}: {str(err)[:300]}")
                if isinstance(err, ModelServerError) and err.server_down:
                    server_down.append(err)
            else:
                writer.write(result_row(config, question, sample, state, store, time.perf_counter() - started))
                # The row holds the result (the trace store the run): the checkpoints are spent. A kill right
                # here leaves the thread behind, unused (the row makes reruns skip the question).
                await saver.adelete_thread(thread_id)
            bar.update(1)

    try:
        await asyncio.gather(*(answer(q, s) for q, s in todo))
    finally:
        bar.close()
        writer.close()
        if failure_log:
            failure_log.close()
    for failure in failures[:10]:
        print(f"failed (continued from its checkpoint on rerun): {failure}")
    if failures:
        print(f"{len(failures)} failed questions are listed in {out_dir / FAILURES}; "
              f"their checkpoints are in {describe_target(checkpoint_db)}")
    if server_down:  # stopped early: say so with the server's own error (the CLI prints it as one line)
        raise server_down[0]
    return {"todo": len(todo), "answered": len(todo) - len(failures), "failed": len(failures),
            "skipped_done": len(questions) * config.samples - len(todo)}


def run_eval(
    systems: Iterable[str],
    benchmarks: Iterable[str | Path],
    model: str | None,
    out_dir: str | os.PathLike[str],
    *,
    data_dir: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    concurrency: int = 8,
    base_url: str | None = None,
    trace_db: str | None = None,
    checkpoint_db: str | None = None,
    samples: int = 1,
    **overrides: Any,
) -> dict[str, Any]:
    """Load the benchmarks (names, or paths of JSONL question files), report bad rows, run every system.

    `model` is every agent's chat model (None: the context's default); `overrides` are context fields (e.g.
    `snippets_k=6`, `max_searches=2`), applied to each graph that has them; None leaves a field at its default.
    `checkpoint_db`: where questions in flight keep their checkpoints (None: `OUT/checkpoints.sqlite`)."""
    systems = list(systems)
    for system in systems:
        graph_spec(system)  # an unknown name fails before anything runs
    if model:
        overrides = {"extractor_model": model, "respondent_model": model, **overrides}
    unused = [key for key, value in overrides.items()
              if value is not None and not any(key in context_fields(s) for s in systems)]
    if unused:
        raise ValueError(f"setting(s) {unused} belong to none of the graphs {systems}")
    configs = [EvalConfig.for_graph(system, overrides, samples) for system in systems]
    out_dir = Path(out_dir)
    with results_folder_lock(out_dir):
        return _run_configs(configs, benchmarks, out_dir, data_dir=data_dir, limit=limit, seed=seed,
                            concurrency=concurrency, base_url=base_url, trace_db=trace_db,
                            checkpoint_db=checkpoint_db)


class ResultsFolderBusy(ValueError):
    """Another eval is writing the same results folder."""


@contextlib.contextmanager
def results_folder_lock(out_dir: Path) -> Iterator[None]:
    """One writer per results folder: two evals on one `--out` would answer every question twice. An exclusive
    `flock` on `OUT/.lock` (released by the OS when the holder dies, so a killed eval never blocks a rerun); the
    file names the holder's process id for the refusal message."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK
    with path.open("a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ResultsFolderBusy(f"{out_dir} is being written by {holder}; wait for it to finish or use "
                                    "another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} (ermedrag eval, started {time.strftime('%Y-%m-%d %H:%M:%S')})")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()


def _run_configs(configs: list[EvalConfig], benchmarks: Iterable[str | Path], out_dir: Path, *, data_dir: str | None,
                 limit: int | None, seed: int, concurrency: int, base_url: str | None, trace_db: str | None,
                 checkpoint_db: str | None) -> dict[str, Any]:
    questions: list[Question] = []
    bad: list[BadRow] = []
    for name in benchmarks:
        if str(name).endswith(".jsonl"):  # a questions file of the user's own
            questions.extend(load_questions_file(name, limit=limit, seed=seed, bad_rows=bad))
        else:
            questions.extend(load_benchmark(str(name), data_dir, limit=limit, seed=seed, bad_rows=bad))
    if bad:
        out_dir.mkdir(parents=True, exist_ok=True)
        with (out_dir / BAD_ROWS).open("w", encoding="utf-8") as handle:
            for row in bad:
                handle.write(json.dumps(asdict(row)) + "\n")
        print(f"skipped {len(bad)} bad rows (listed in {out_dir / BAD_ROWS}), e.g. {bad[0].id}: {bad[0].problem}")
    return {config.system: asyncio.run(run_questions(config, questions, out_dir, concurrency=concurrency,
                                                     base_url=base_url, trace_db=trace_db,
                                                     checkpoint_db=checkpoint_db))
            for config in configs}
