"""The batch runner: questions × systems through the real graphs, concurrent, resumable.

Each finished question is appended to `OUT/results.jsonl` (a `tools.jsonl.AppendLog`) under a key made of the
run configuration and the question id; a rerun skips what is already there. Each question in flight runs with a
checkpointer (`graphs.durable`, `OUT/checkpoints.sqlite` by default) in a thread named after its key, so a rerun
after a kill continues it from its last finished node: no finished model call is made again. A question that
fails (a model server error, ...) is logged in `OUT/failures.jsonl` and continued the same way on the next run.
Every question is also a trace run (evals feed training).

With `permute_options=N` each question is also asked with its options in N - 1 other cyclic orders
(`evals.position_bias`); the order is part of the question's key, and order 0 keys exactly as a run without
permutations, so turning it on keeps every result already recorded. One progress bar covers the whole eval: the
configurations' chat models and indexes are loaded first, so it moves from the first finished question.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from langgraph.checkpoint.base import BaseCheckpointSaver

from ermedrag.tools.data.benchmarks import BadRow, Question, load_benchmark, load_questions_file
from ermedrag.tools.model_server import ModelServerError
from ermedrag.graphs.state import MAX_OPTIONS
from ermedrag.graphs.steps import prepare
from ermedrag.graphs.durable import arun_durably, describe_target, durable, open_async_saver, run_config
from ermedrag.graphs.registry import context_fields, graph_spec, load_graph
from ermedrag.tools.records.jsonl import AppendLog
from ermedrag.tools.records.traces import TraceStore, default_trace_db
from ermedrag.evals.conformal import Selective, load_calibration
from ermedrag.evals.servers import ServerPool, server_list
from ermedrag.tools.records import locks
from ermedrag.evals.rows import (
    EvalConfig,
    Asking,
    askings,
    done_keys,
    question_thread,
    failure_record,
    result_row,
    panel_inputs,
)

RESULTS = "results.jsonl"
BAD_ROWS = "bad_rows.jsonl"
FAILURES = "failures.jsonl"
LOCK = ".lock"
CHECKPOINTS = "checkpoints.sqlite"

NOTHING_BESIDE = Selective()  # no answer sets, no abstention


@dataclass
class Outcome:
    """What answering one configuration's questions came to."""

    counts: dict[str, Any]  # todo, answered, failed, skipped_done (and by_server, with several)
    failures: list[str] = field(default_factory=list)  # one line each, for the end of the run
    server_down: ModelServerError | None = None  # the error that stopped it early


class Progress:
    """The one progress bar of an eval (questions done of all configurations, rate, ETA, failures so far)."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.failed = 0
        self.bar = tqdm(total=total, desc=description, unit="q", disable=not enabled, dynamic_ncols=True)
        self.bar.set_postfix_str("failed=0", refresh=False)

    def done(self, failed: bool) -> None:
        if failed:
            self.failed += 1
            self.bar.set_postfix_str(f"failed={self.failed}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def pending(
    config: EvalConfig, questions: list[Question], out_dir: Path, permute_options: int
) -> tuple[list[Asking], int]:
    """The askings of `config` not yet recorded in `out_dir`, and how many are."""
    done = done_keys(out_dir / RESULTS)
    every = [a for q in questions for a in askings(q, config.samples, permute_options)]
    todo = [a for a in every if a.key(config) not in done]
    return todo, len(every) - len(todo)


def warm_up(config: EvalConfig, base_url: str | None, trace_db: str) -> list[str]:
    """Load the configuration's models, index and encoders (`graphs.steps.prepare`) before the progress bar starts,
    so that a missing index fails the eval at once, naming it, instead of every question; returns the model specs."""
    ctx = load_graph(config.system).context_schema(**config.context(base_url, trace_db))
    loaded = prepare(ctx, config.system)
    return [name.removeprefix("model ").removesuffix("_s") for name in loaded if name.startswith("model ")]


async def run_questions(
    config: EvalConfig,
    questions: list[Question],
    out_dir: Path,
    *,
    concurrency: int = 8,
    base_url: str | Sequence[str] | None = None,
    trace_db: str | None = None,
    checkpoint_db: str | None = None,
    progress: bool = True,
    permute_options: int = 1,
) -> dict[str, Any]:
    """Answer every (question, order, sample) not yet recorded for `config`, each continued from its checkpoint
    when a killed or failed run left one (`checkpoint_db`: a file or a Postgres URL; None =
    `OUT/checkpoints.sqlite`); prints the failures and returns counts. One configuration with its own progress
    bar; `run_eval` runs several under one."""
    todo, _ = pending(config, questions, out_dir, permute_options)
    bar = Progress(len(todo), f"{config.system} {config.model}", progress)
    try:
        outcome = await answer_config(
            config,
            questions,
            out_dir,
            bar,
            concurrency=concurrency,
            base_url=base_url,
            trace_db=trace_db,
            checkpoint_db=checkpoint_db,
            permute_options=permute_options,
        )
    finally:
        bar.close()
    report_failures([outcome], out_dir, checkpoint_db or str(out_dir / CHECKPOINTS))
    return outcome.counts


async def answer_config(
    config: EvalConfig,
    questions: list[Question],
    out_dir: Path,
    bar: Progress,
    *,
    concurrency: int,
    base_url: str | Sequence[str] | None,
    trace_db: str | None,
    checkpoint_db: str | None,
    permute_options: int,
    selective: Selective = NOTHING_BESIDE,
) -> Outcome:
    """`run_questions` without printing, moving `bar` (shared by the eval's configurations)."""
    checkpoint_db = checkpoint_db or str(out_dir / CHECKPOINTS)
    async with open_async_saver(checkpoint_db) as saver:
        return await _answer_config(
            config,
            questions,
            out_dir,
            saver,
            bar,
            concurrency=concurrency,
            base_url=base_url,
            trace_db=trace_db,
            permute_options=permute_options,
            selective=selective,
        )


async def _answer_config(
    config: EvalConfig,
    questions: list[Question],
    out_dir: Path,
    saver: BaseCheckpointSaver,
    bar: Progress,
    *,
    concurrency: int,
    base_url: str | Sequence[str] | None,
    trace_db: str | None,
    permute_options: int,
    selective: Selective = NOTHING_BESIDE,
) -> Outcome:
    graph = durable(load_graph(config.system), saver)
    graph_inputs = set(graph.get_input_jsonschema().get("properties", {}))
    trace_db = trace_db or default_trace_db()
    store = TraceStore(trace_db)
    servers = ServerPool(base_url)
    todo, skipped = pending(config, questions, out_dir, permute_options)
    writer = AppendLog(out_dir / RESULTS)
    failure_log: AppendLog | None = None  # opened at the first failure: a clean run leaves no empty file
    semaphore = asyncio.Semaphore(concurrency)
    outcome = Outcome(counts={})
    # Sync graph nodes run in the loop's executor: size it so `concurrency` questions (each fanning out
    # to snippets_k extractor calls) never queue behind each other's threads.
    loop = asyncio.get_running_loop()
    fan_out = max(int(config.settings.get(name) or 0) for name in ("snippets_k", "n_specialists", "attending_samples"))
    loop.set_default_executor(ThreadPoolExecutor(max_workers=concurrency * (fan_out + 2)))

    async def answer(asking: Asking) -> None:
        question = asking.question
        async with semaphore:
            if outcome.server_down:  # the rest would each wait (retries + 1) × timeout to fail the same way
                return
            started = time.perf_counter()
            thread_id = question_thread(out_dir, config, question, asking.sample, asking.order)
            # The run id is new on a fresh start and kept in the checkpoint on a resume (the trace run continues).
            # The gold is the letter it stands at in this order: the trace (training data) matches what was asked.
            inputs = {
                "question": question.question,
                "options": asking.options,
                "gold": asking.shown_gold,
                "run_id": uuid.uuid4().hex,
                **panel_inputs(graph_inputs, question),
            }
            while True:  # once per server found down, while another one is live
                url = servers.acquire()
                answered = False
                try:
                    state = await arun_durably(
                        graph, run_config(thread_id, config.system, context_for[url]), inputs, context_for[url]
                    )
                except ModelServerError as err:
                    if err.server_down and servers.mark_down(url, err):
                        continue  # from its checkpoint, on the next live server
                    record_failure(asking, thread_id, err)
                except Exception as err:  # noqa: BLE001 - recorded, continued from its checkpoint on the next run
                    record_failure(asking, thread_id, err)
                else:
                    answered = True
                    row = result_row(config, asking, state, store, time.perf_counter() - started)
                    writer.write(row | selective.fields(row.get("option_probs"), row.get("confidence")))
                    # The row holds the result (the trace store the run): the checkpoints are spent. A kill right
                    # here leaves the thread behind, unused (the row makes reruns skip the question).
                    await saver.adelete_thread(thread_id)
                    bar.done(failed=False)
                finally:
                    servers.release(url, answered=answered)
                return

    def record_failure(asking: Asking, thread_id: str, err: Exception) -> None:
        nonlocal failure_log
        question = asking.question
        failure_log = failure_log or AppendLog(out_dir / FAILURES)
        failure_log.write(failure_record(config, question, asking.sample, thread_id, err, asking.order))
        where = f"{question.benchmark}/{question.id}" + (f" (order {asking.order})" if asking.order else "")
        outcome.failures.append(f"{where}: {type(err).__name__}: {str(err)[:300]}")
        if isinstance(err, ModelServerError) and err.server_down and outcome.server_down is None:
            outcome.server_down = err
        bar.done(failed=True)

    context_for = {url: config.context(url, trace_db) for url in servers.in_flight}
    try:
        await asyncio.gather(*(answer(a) for a in todo))
    finally:
        writer.close()
        if failure_log:
            failure_log.close()
    failed, answered = len(outcome.failures), sum(servers.served.values())
    outcome.counts = {"todo": len(todo), "answered": answered, "failed": failed, "skipped_done": skipped}
    if len(todo) - answered - failed:  # stopped early: every server was down
        outcome.counts["not_started"] = len(todo) - answered - failed
    by_server = servers.summary()
    if by_server:
        outcome.counts["by_server"] = by_server
    return outcome


def report_failures(outcomes: list[Outcome], out_dir: Path, checkpoint_db: str) -> None:
    """Print the first failures and where they are listed; raise the server error that stopped the run early
    (the CLI prints it as one line)."""
    failures = [line for outcome in outcomes for line in outcome.failures]
    for failure in failures[:10]:
        print(f"failed (continued from its checkpoint on rerun): {failure}")
    if failures:
        print(
            f"{len(failures)} failed questions are listed in {out_dir / FAILURES}; "
            f"their checkpoints are in {describe_target(checkpoint_db)}"
        )
    for outcome in outcomes:
        if outcome.server_down:
            raise outcome.server_down


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
    base_url: str | Sequence[str] | None = None,
    trace_db: str | None = None,
    checkpoint_db: str | None = None,
    samples: int = 1,
    permute_options: int = 1,
    progress: bool = True,
    calibration: str | os.PathLike[str] | None = None,
    abstain_below: float | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Load the benchmarks (names, or paths of JSONL question files), report bad rows, run every system.

    `model` is every agent's chat model (None: the context's default); `overrides` are context fields (e.g.
    `snippets_k=6`, `max_searches=2`), applied to each graph that has them; None leaves a field at its default.
    `data_dir`: the data root holding `benchmarks/`, or the benchmarks folder (None: ERMEDRAG_SHARED_DATA, else
    upstream). `checkpoint_db`: where questions in flight keep their checkpoints (None: `OUT/checkpoints.sqlite`).
    `permute_options`: ask each question in that many cyclic option orders (`evals.position_bias`); 1 = as given.
    `progress`: one progress bar on stderr for the whole eval. `calibration` (a file of `ermedrag calibrate`, for
    the one configuration run) gives each answer its conformal set; `abstain_below` withholds answers whose
    confidence is below it (`evals.conformal`): both are written beside the answer, which they never change."""
    systems = list(systems)
    for system in systems:
        graph_spec(system)  # an unknown name fails before anything runs
    if not 1 <= permute_options <= MAX_OPTIONS:
        raise ValueError(
            f"--permute-options {permute_options}: expected 1 (the options as given) to {MAX_OPTIONS} "
            "(one order per option at most)"
        )
    if model:
        overrides = {"extractor_model": model, "respondent_model": model, **overrides}
    unused = [
        key
        for key, value in overrides.items()
        if value is not None and not any(key in context_fields(s) for s in systems)
    ]
    if unused:
        raise ValueError(f"setting(s) {unused} belong to none of the graphs {systems}")
    configs = [EvalConfig.for_graph(system, overrides, samples) for system in systems]
    selective = selective_for(configs, calibration, abstain_below)
    out_dir = Path(out_dir)
    with results_folder_lock(out_dir):
        return _run_configs(
            configs,
            benchmarks,
            out_dir,
            data_dir=data_dir,
            limit=limit,
            seed=seed,
            concurrency=concurrency,
            base_url=base_url,
            trace_db=trace_db,
            checkpoint_db=checkpoint_db,
            permute_options=permute_options,
            progress=progress,
            selective=selective,
        )


def selective_for(
    configs: list[EvalConfig], calibration: str | os.PathLike[str] | None, abstain_below: float | None
) -> Selective:
    """The answer sets and abstention asked for, the calibration checked against the configuration it is for."""
    fitted = None
    if calibration is not None:
        fitted = load_calibration(calibration)
        if len(configs) != 1:
            raise ValueError("--calibration belongs to one configuration: run one graph with it")
        fitted.check(configs[0])
    return Selective(fitted, abstain_below)


ResultsFolderBusy = locks.Busy  # another eval is writing the same results folder


def results_folder_lock(out_dir: Path) -> contextlib.AbstractContextManager[None]:
    """One writer per results folder: two evals on one `--out` would answer every question twice."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return locks.held(out_dir / LOCK, str(out_dir), "wait for it to finish or use another --out")


def load_questions(
    benchmarks: Iterable[str | Path], out_dir: Path, *, data_dir: str | None, limit: int | None, seed: int
) -> list[Question]:
    """The questions of every benchmark (a name, or a JSONL file of the user's own); bad rows listed in
    `OUT/bad_rows.jsonl` and named once."""
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
    return questions


def _run_configs(
    configs: list[EvalConfig],
    benchmarks: Iterable[str | Path],
    out_dir: Path,
    *,
    data_dir: str | None,
    limit: int | None,
    seed: int,
    concurrency: int,
    base_url: str | Sequence[str] | None,
    trace_db: str | None,
    checkpoint_db: str | None,
    permute_options: int,
    progress: bool,
    selective: Selective = NOTHING_BESIDE,
) -> dict[str, Any]:
    questions = load_questions(benchmarks, out_dir, data_dir=data_dir, limit=limit, seed=seed)
    trace_db = trace_db or default_trace_db()
    todo = [len(pending(config, questions, out_dir, permute_options)[0]) for config in configs]
    for config, count in zip(configs, todo):
        if count:  # nothing to load for a configuration whose questions are all recorded
            warm_up(config, server_list(base_url)[0], trace_db)
    bar = Progress(sum(todo), "eval " + ", ".join(c.system for c in configs), progress)
    outcomes: list[Outcome] = []
    try:
        for config in configs:
            outcome = asyncio.run(
                answer_config(
                    config,
                    questions,
                    out_dir,
                    bar,
                    concurrency=concurrency,
                    base_url=base_url,
                    trace_db=trace_db,
                    checkpoint_db=checkpoint_db,
                    permute_options=permute_options,
                    selective=selective,
                )
            )
            outcomes.append(outcome)
            if outcome.server_down:  # the next configuration would find the server down too (or another one)
                break
    finally:
        bar.close()
    report_failures(outcomes, out_dir, checkpoint_db or str(out_dir / CHECKPOINTS))
    return {config.system: outcome.counts for config, outcome in zip(configs, outcomes)}
