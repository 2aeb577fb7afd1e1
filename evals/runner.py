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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from ermedrag.tools.benchmarks import BadRow, Question, load_benchmark, load_questions_file
from ermedrag.tools.jsonl import AppendLog, read_records
from ermedrag.tools.traces import TraceStore, default_trace_db

RESULTS = "results.jsonl"
BAD_ROWS = "bad_rows.jsonl"


def systems() -> dict[str, Any]:
    from ermedrag.graphs.baselines import cot, vanilla_rag
    from ermedrag.graphs.er_medrag import graph
    from ermedrag.graphs.med_r3 import graph as med_r3

    return {"er_medrag": graph, "vanilla_rag": vanilla_rag, "cot": cot, "med_r3": med_r3}


@dataclass(frozen=True)
class EvalConfig:
    """What defines a result: change any field and the questions are answered again."""

    system: str
    model: str
    index_dir: str = ""
    snippets_k: int = 4
    temperature: float = 0.0
    samples: int = 1
    extractor_max_new_tokens: int = 96
    respondent_max_new_tokens: int = 192

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def context(self, base_url: str | None, trace_db: str) -> dict[str, Any]:
        context = {"extractor_model": self.model, "respondent_model": self.model, "snippets_k": self.snippets_k,
                   "temperature": self.temperature, "extractor_max_new_tokens": self.extractor_max_new_tokens,
                   "respondent_max_new_tokens": self.respondent_max_new_tokens, "trace_db": trace_db}
        if self.index_dir:
            context["index_dir"] = self.index_dir
        if base_url:
            context["base_url"] = base_url
        return context


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
        "config_key": config.key(), "config": asdict(config), "benchmark": question.benchmark,
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

    graph = systems()[config.system]
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
    loop.set_default_executor(ThreadPoolExecutor(max_workers=concurrency * (config.snippets_k + 2)))
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
    systems_: Iterable[str],
    benchmarks: Iterable[str | Path],
    model: str,
    out_dir: str | os.PathLike[str],
    *,
    data_dir: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    concurrency: int = 8,
    base_url: str | None = None,
    trace_db: str | None = None,
    **config_fields: Any,
) -> dict[str, Any]:
    """Load the benchmarks (names, or paths of JSONL question files), report bad rows, run every system."""
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
    summary = {}
    for system in systems_:
        if system not in systems():
            raise ValueError(f"unknown system {system!r}; choose from {', '.join(systems())}")
        config = EvalConfig(system=system, model=model, **config_fields)
        summary[system] = asyncio.run(run_questions(config, questions, out_dir, concurrency=concurrency,
                                                    base_url=base_url, trace_db=trace_db))
    return summary
