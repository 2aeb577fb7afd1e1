"""Recorded traces → training data in TRL's conversational formats.

- DPO pairs for the extractor: each recorded extractor call's exact prompt is replayed to sample N
  alternative extractions; the recorded one and the samples are scored with `extractor_reward` and the best
  and worst become chosen/rejected when their reward margin is large enough.
- GRPO prompts for the respondent: each finished ER-MedRAG run with a gold answer is rebuilt from its
  recorded triplets, with a fraction of distractor triplets from other runs shuffled in (robustness to
  retrieval noise); the columns carry what the reward functions need.
- GRPO prompts written from benchmark questions live in `training.evidence_export` (they read no traces).
- Med-R³ GRPO prompts: each finished Med-R³ run with a gold answer gives its first reasoner prompt exactly
  as recorded, with the columns of `training.med_r3_data`.

Exports are resumable and idempotent (`export_resumable`, the one loop all three run): every processed trace
event or run is appended to `OUT/log.jsonl` as soon as it is done (a killed export loses at most the one in
flight and redoes it); the dataset (`OUT/dataset`, `datasets.load_from_disk`) and `OUT/data.jsonl` are
rebuilt from the log at the end.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ermedrag.agents import extractor, respondent
from ermedrag.agents.base import to_chat, to_langchain
from ermedrag.tools.agent_calls import text_with_stop
from ermedrag.tools.records.jsonl import AppendLog, read_records
from ermedrag.tools.records.traces import TraceStore
from ermedrag.training.med_r3.data import med_r3_row

LOG = "log.jsonl"
CLOSED = "closed after its last complete triplet"  # the origin of a candidate close_cut_lists added


def export_resumable(
    out: Path,
    items: Sequence[dict[str, Any]],
    id_key: str,
    to_record: Callable[[Any], dict],
    *,
    row_key: str,
    limit: int | None,
    progress: bool,
    unit: str,
) -> dict[str, int]:
    """The loop of every export: the `items` (trace events or runs) whose `id_key` is not yet in
    `OUT/log.jsonl`, at most `limit` of them, each turned into a log record (carrying `id_key`, and its
    dataset row under `row_key`) and appended as soon as it is done; then the dataset is rebuilt from the log.
    Returns counts: processed, skipped_done (records already in the log), rows."""
    from tqdm.auto import tqdm

    done = {r[id_key] for r in read_records(out / LOG)}
    todo = [item for item in items if item[id_key] not in done]
    todo = todo[:limit] if limit is not None else todo
    with AppendLog(out / LOG) as log:
        for item in tqdm(todo, desc=f"{unit}s", unit=unit, disable=not progress):
            log.write(to_record(item))
    return {"processed": len(todo), "skipped_done": len(done), **_write_dataset(out, row_key)}


def _as_dict(value: Any) -> dict[str, Any]:
    return asdict(value) if is_dataclass(value) else dict(value)


# ------------------------------------------------------------------------------------------------ DPO


@dataclass
class DPOExportConfig:
    traces: str = field(metadata={"help": "trace database (SQLite) to read"})
    out: str = field(metadata={"help": "output folder: log.jsonl, data.jsonl, dataset/"})
    model: str | None = field(
        default=None,
        metadata={"help": "chat model that samples alternatives; default: the model recorded for each call"},
    )
    base_url: str | None = field(default=None, metadata={"help": "server for openai: models"})
    samples: int = field(default=4, metadata={"help": "alternative extractions sampled per recorded call"})
    temperature: float = field(
        default=0.7,
        metadata={
            "help": "sampling temperature for the alternatives (0.7: plausible rejected extractions; at 1.0 the "
            "offline model's samples are mostly broken and DPO learned little, benches/README.md)"
        },
    )
    max_new_tokens: int = field(default=96, metadata={"help": "generation budget of one extraction"})
    margin: float = field(default=0.1, metadata={"help": "minimum reward gap between chosen and rejected"})
    usefulness: bool = field(
        default=True,
        metadata={
            "help": "score usefulness: does the respondent reach the gold answer from this extraction alone "
            "(one respondent call per candidate; only for runs with a gold answer)"
        },
    )
    limit: int | None = field(default=None, metadata={"help": "process at most this many extractor calls"})
    close_cut_lists: bool = field(
        default=True,
        metadata={
            "help": "also score each candidate whose JSON list the token budget cut, ended after its last complete "
            "triplet (its own words, then `]`): pairs can then prefer ending the list to running past the "
            "budget (on by default: it beat no closing in 3 of 3 seeds, benches/README.md)"
        },
    )


def _usefulness(model: Any, run: dict[str, Any], parsed: extractor.Extraction) -> float | None:
    if not run or not run.get("gold") or not parsed["triplets"]:
        return None
    question = run["question"]
    reply = model.invoke(
        respondent.build_messages(
            question["question"], question.get("options"), extractor.render_triplets(parsed["triplets"])
        ),
        stop=respondent.STOP,
    )
    answer = respondent.parse_answer(text_with_stop(reply, respondent.STOP), question.get("options"))
    return 1.0 if answer["answer"] == run["gold"] else 0.0


def export_dpo(
    config: DPOExportConfig, progress: bool = True, reward: Callable[..., Any] | None = None
) -> dict[str, int]:
    """Write extractor preference pairs; returns counts. `reward` defaults to
    `training.extractor_reward.extractor_reward`."""
    from ermedrag.tools.models import load_chat_model

    if reward is None:
        from ermedrag.training.rewards.extraction import extractor_reward as reward
    store = TraceStore(config.traces)
    models: dict[str, Any] = {}

    def model_for(spec: str) -> Any:
        if spec not in models:
            models[spec] = load_chat_model(
                spec, temperature=config.temperature, base_url=config.base_url, max_new_tokens=config.max_new_tokens
            )
        return models[spec]

    def record(event: dict[str, Any]) -> dict[str, Any]:
        model = model_for(config.model or event["model"])
        return _dpo_record(event, store.run(event["run_id"]) or {}, model, config, reward)

    return export_resumable(
        Path(config.out),
        list(store.events(agent="extractor")),
        "event_id",
        record,
        row_key="pair",
        limit=config.limit,
        progress=progress,
        unit="extractor call",
    )


def _snippet_id(event: dict[str, Any]) -> str:
    return (event.get("inputs") or {}).get("snippet_id") or (event.get("parsed") or {}).get("snippet_id", "")


def _dpo_record(
    event: dict[str, Any], run: dict[str, Any], model: Any, config: DPOExportConfig, reward: Callable[..., Any]
) -> dict[str, Any]:
    inputs = event.get("inputs") or {}
    snippet_id = _snippet_id(event)
    snippet, question = inputs.get("snippet", ""), inputs.get("question", "")
    messages = to_langchain(event["messages"])
    samples = (
        [text_with_stop(r, extractor.STOP) for r in model.batch([messages] * config.samples, stop=extractor.STOP)]
        if config.samples
        else []
    )  # a list that ended at its `}]` keeps it: it is whole, not cut
    candidates = dict.fromkeys([event["completion"], *samples], "recorded or sampled")  # identical ones count once
    if config.close_cut_lists:
        for text in list(candidates):
            if (closed := extractor.closed_list(text)) is not None:
                candidates.setdefault(closed, CLOSED)
    scored = []
    for text, origin in candidates.items():
        parsed = extractor.parse_triplets(text, snippet_id)
        useful = _usefulness(model, run, parsed) if config.usefulness else None
        components = _as_dict(reward(text, snippet, question=question, usefulness=useful))
        scored.append({"completion": text, "reward": components["total"], "components": components, "origin": origin})
    scored.sort(key=lambda c: c["reward"], reverse=True)
    return {"event_id": event["event_id"], "pair": preference_pair(event, scored, config.margin), "candidates": scored}


def preference_pair(event: dict[str, Any], scored: Sequence[dict[str, Any]], margin: float) -> dict[str, Any] | None:
    """The best and the worst of one extractor call's scored candidates (best first), when their rewards differ
    by at least `margin`."""
    if len(scored) < 2 or scored[0]["reward"] - scored[-1]["reward"] < margin:
        return None
    best, worst = scored[0], scored[-1]
    return {
        "prompt": to_chat(event["messages"]),
        "chosen": [{"role": "assistant", "content": best["completion"]}],
        "rejected": [{"role": "assistant", "content": worst["completion"]}],
        "chosen_reward": best["reward"],
        "rejected_reward": worst["reward"],
        "run_id": event["run_id"],
        "event_id": event["event_id"],
        "snippet_id": _snippet_id(event),
    }


def reselect_pairs(traces: str, export: Path, out: Path, margin: float, closed: bool = True) -> dict[str, int]:
    """Pairs chosen again from an earlier DPO export's scored candidates, without sampling or scoring again: with
    another `margin`, or without the candidates `close_cut_lists` added (`closed` False), so that two settings
    compare on the same samples. Written to `out` as an export of its own; returns its counts."""
    events = {e["event_id"]: e for e in TraceStore(traces).events(agent="extractor")}
    out.mkdir(parents=True, exist_ok=True)
    (out / LOG).unlink(missing_ok=True)
    with AppendLog(out / LOG) as log:
        for record in read_records(export / LOG):
            kept = [c for c in record["candidates"] if closed or c.get("origin") != CLOSED]
            log.write({**record, "candidates": kept, "pair": preference_pair(events[record["event_id"]], kept, margin)})
    return _write_dataset(out, "pair")


# ----------------------------------------------------------------------------------------------- GRPO


@dataclass
class GRPOExportConfig:
    traces: str = field(metadata={"help": "trace database (SQLite) to read"})
    out: str = field(metadata={"help": "output folder: log.jsonl, data.jsonl, dataset/"})
    noise_fraction: float = field(
        default=0.25, metadata={"help": "fraction of each prompt's triplets that are distractors drawn from other runs"}
    )
    seed: int = field(default=0, metadata={"help": "seed for drawing and shuffling distractors"})
    limit: int | None = field(default=None, metadata={"help": "process at most this many runs"})


def _run_triplets(store: TraceStore, run_id: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    triplets, respondent_event = [], None
    for event in store.events(run_id=run_id):
        if event["agent"] == "extractor" and event.get("parsed"):
            triplets.extend(event["parsed"].get("triplets", []))
        elif event["agent"] == "respondent":
            respondent_event = event
    return triplets, respondent_event


def distractor_count(own: int, fraction: float) -> int:
    """How many distractors make `fraction` of the final list (at least one when noise is asked for)."""
    if fraction <= 0:
        return 0
    return max(1, round(fraction * own / (1 - fraction))) if fraction < 1 else max(own, 1)


def export_grpo(config: GRPOExportConfig, progress: bool = True) -> dict[str, int]:
    """Write respondent prompts with noise injection; returns counts."""
    if not 0 <= config.noise_fraction < 1:
        raise ValueError(f"noise_fraction must be in [0, 1), got {config.noise_fraction}")
    store = TraceStore(config.traces)
    runs = _finished_runs(store, "er_medrag")
    per_run = {r["run_id"]: _run_triplets(store, r["run_id"]) for r in runs}  # distractors come from every run
    return export_resumable(
        Path(config.out),
        runs,
        "run_id",
        lambda run: _grpo_record(run, per_run, config),
        row_key="row",
        limit=config.limit,
        progress=progress,
        unit="run",
    )


def _finished_runs(store: TraceStore, graph: str) -> list[dict[str, Any]]:
    """The finished runs of `graph` that have a gold answer (something to reward), by run id."""
    runs = (r for r in store.runs() if r["graph"] == graph and r.get("gold") and r.get("finished_at"))
    return sorted(runs, key=lambda r: r["run_id"])


def _grpo_record(run: dict[str, Any], per_run: dict[str, tuple[list, Any]], config: GRPOExportConfig) -> dict:
    own, respondent_event = per_run[run["run_id"]]
    rng = random.Random(f"{config.seed}:{run['run_id']}")
    pool = [t for other, (triplets, _) in sorted(per_run.items()) if other != run["run_id"] for t in triplets]
    distractors = rng.sample(pool, min(len(pool), distractor_count(len(own), config.noise_fraction)))
    question = run["question"]
    row = respondent_row(question["question"], question.get("options"), run["gold"], own, distractors, rng)
    row.update(run_id=run["run_id"], event_id=respondent_event["event_id"] if respondent_event else None)
    return {"run_id": run["run_id"], "row": row}


def respondent_row(
    question: str,
    options: dict[str, str] | None,
    gold: str,
    own: Sequence[dict[str, str]],
    distractors: Sequence[dict[str, str]],
    rng: random.Random,
) -> dict[str, Any]:
    """One respondent GRPO prompt: the question's own triplets and the distractors, flagged and shuffled (`rng`),
    rendered as the graph renders them, with the columns the rewards read (`gold`, `options`, `triplets`)."""
    mixed = [{**t, "distractor": False} for t in own] + [{**t, "distractor": True} for t in distractors]
    rng.shuffle(mixed)
    messages = respondent.build_messages(question, options, extractor.render_triplets(mixed))
    return {
        "prompt": to_chat(messages),
        "question": question,
        "options": options,
        "gold": gold,
        "triplets": mixed,
        "n_distractors": len(distractors),
        "snippet_ids": sorted({t["snippet_id"] for t in own}),
    }


@dataclass
class MedR3ExportConfig:
    traces: str = field(metadata={"help": "trace database (SQLite) to read"})
    out: str = field(metadata={"help": "output folder: log.jsonl, data.jsonl, dataset/"})
    questions: list[str] = field(
        default_factory=list,
        metadata={
            "help": "benchmark JSONL files the runs' questions came from: a run whose question text matches one gets "
            "that question's gold evidence (PubMedQA abstract, BioASQ snippets) for the retrieval reward"
        },
    )
    qrels: str | None = field(default=None, metadata={"help": "bioasq_qrels.jsonl, for BioASQ questions"})
    corpus_dir: str | None = field(default=None, metadata={"help": "corpora folder, for exact PubMedQA ids"})
    limit: int | None = field(default=None, metadata={"help": "process at most this many runs"})


def export_med_r3(config: MedR3ExportConfig, progress: bool = True) -> dict[str, int]:
    """Med-R³ GRPO prompts replayed from recorded `med_r3` runs: each finished run with a gold answer gives its
    first reasoner prompt exactly as recorded, with the columns the Med-R³ rewards read
    (`training.med_r3_data`: `gold`, `options`, `gold_evidence`) and provenance. Resumable like the other
    exports."""
    store = TraceStore(config.traces)
    known = _known_questions(config)
    return export_resumable(
        Path(config.out),
        _finished_runs(store, "med_r3"),
        "run_id",
        lambda run: {"run_id": run["run_id"], "row": _med_r3_row(store, run, known)},
        row_key="row",
        limit=config.limit,
        progress=progress,
        unit="run",
    )


def _med_r3_row(store: TraceStore, run: dict[str, Any], questions: dict[str, KnownQuestion]) -> dict[str, Any] | None:
    """The run's first reasoner call (empty transcript) as a prompt; None when the run has none."""
    first = next(
        (
            e
            for e in store.events(run_id=run["run_id"], agent="reasoner")
            if not (e.get("inputs") or {}).get("transcript")
        ),
        None,
    )
    if first is None:
        return None
    question = run["question"]
    known = questions.get(_question_key(question["question"]))
    row = med_r3_row(
        to_chat(first["messages"]),
        gold=run["gold"],
        options=question.get("options"),
        gold_evidence=known.gold_evidence if known else [],
        row_id=run["run_id"],
        benchmark=known.benchmark if known else "",
        conclusion=known.conclusion if known else None,
    )
    return {**row, "run_id": run["run_id"], "event_id": first["event_id"]}


def _question_key(text: str) -> str:
    return " ".join(str(text).split()).lower()


class KnownQuestion(NamedTuple):
    """What `--questions` tells of a recorded run's question: its benchmark, gold evidence and stated conclusion."""

    benchmark: str
    gold_evidence: list[str]
    conclusion: str | None


def _known_questions(config: MedR3ExportConfig) -> dict[str, KnownQuestion]:
    from ermedrag.tools.data.benchmarks import load_questions_file
    from ermedrag.tools.data.gold_evidence import question_gold_evidence

    found = {}
    for path in config.questions:
        for q in load_questions_file(path):
            evidence = question_gold_evidence(q, config.qrels, config.corpus_dir)
            found[_question_key(q.question)] = KnownQuestion(q.benchmark, evidence, q.conclusion)
    return found


# ------------------------------------------------------------------------------------------- dataset


def _write_dataset(out: Path, key: str) -> dict[str, int]:
    """Rebuild `data.jsonl` and `dataset/` from the log (swapped in by rename: never half written)."""
    from datasets import Dataset

    rows = [r[key] for r in read_records(out / LOG) if r.get(key)]
    unique = list({(r["event_id"], r["run_id"]): r for r in rows}.values())
    (out / "data.jsonl.tmp").write_text("".join(json.dumps(r) + "\n" for r in unique), encoding="utf-8")
    (out / "data.jsonl.tmp").replace(out / "data.jsonl")
    if unique:
        staging = Path(tempfile.mkdtemp(prefix=".dataset-", dir=out))
        Dataset.from_list(unique).save_to_disk(str(staging))
        shutil.rmtree(out / "dataset", ignore_errors=True)
        staging.rename(out / "dataset")
    return {"rows": len(unique)}
