"""The batch runner: questions × systems through the real graphs, concurrent, resumable.

Each finished question is appended to `OUT/results.jsonl` (a `tools.jsonl.AppendLog`) under a key made of the
run configuration and the question id; a rerun skips what is already there, so killing the process loses
at most the questions in flight. Every question is also a trace run (evals feed training).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ermedrag.tools.benchmarks import BadRow, Question, load_benchmark, load_questions_file
from ermedrag.graphs.registry import context_fields, graph_spec, load_graph, resolved_settings
from ermedrag.tools.jsonl import AppendLog, read_records
from ermedrag.tools.traces import TraceStore, default_trace_db

RESULTS = "results.jsonl"
BAD_ROWS = "bad_rows.jsonl"


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
        "correct": answer.get("answer") == question.answer, "error": answer.get("error"),
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
    progress: bool = True,
) -> dict[str, int]:
    """Answer every (question, sample) not yet recorded for `config`; returns counts."""
    from tqdm.auto import tqdm

    graph = load_graph(config.system)
    trace_db = trace_db or default_trace_db()
    store = TraceStore(trace_db)
    context = config.context(base_url, trace_db)
    results = out_dir / RESULTS
    done = done_keys(results)
    todo = [(q, s) for q in questions for s in range(config.samples)
            if (config.key(), q.benchmark, q.id, s) not in done]
    writer = AppendLog(results)
    semaphore = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    # Sync graph nodes run in the loop's executor: size it so `concurrency` questions (each fanning out
    # to snippets_k extractor calls) never queue behind each other's threads.
    loop = asyncio.get_running_loop()
    fan_out = int(config.settings.get("snippets_k", 0))
    loop.set_default_executor(ThreadPoolExecutor(max_workers=concurrency * (fan_out + 2)))
    bar = tqdm(total=len(todo), desc=f"{config.system} {config.model}", unit="q", disable=not progress)

    async def answer(question: Question, sample: int) -> None:
        async with semaphore:
            started = time.perf_counter()
            inputs = {"question": question.question, "options": question.options, "gold": question.answer}
            try:
                state = await graph.ainvoke(inputs, context=context)
            except Exception as err:  # noqa: BLE001 - recorded, retried on the next run
                failures.append(f"{question.benchmark}/{question.id}: {type(err).__name__}: {err}")
            else:
                writer.write(result_row(config, question, sample, state, store, time.perf_counter() - started))
            bar.update(1)

    try:
        await asyncio.gather(*(answer(q, s) for q, s in todo))
    finally:
        bar.close()
        writer.close()
    for failure in failures[:10]:
        print(f"failed (will be retried on rerun): {failure}")
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
    samples: int = 1,
    **overrides: Any,
) -> dict[str, Any]:
    """Load the benchmarks (names, or paths of JSONL question files), report bad rows, run every system.

    `model` is every agent's chat model (None: the context's default); `overrides` are context fields (e.g.
    `snippets_k=6`, `max_searches=2`), applied to each graph that has them; None leaves a field at its default."""
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
                                                     base_url=base_url, trace_db=trace_db))
            for config in configs}
