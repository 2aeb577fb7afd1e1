"""MMedAgent-RL training data: recorded `mmedagent` runs → a triage dataset and the attending's curriculum.

    export_mmedagent(MMedAgentExportConfig(traces="traces.sqlite", out="data/mmedagent/export", data="../shared/data"))
    # CLI: ermedrag export mmedagent --out DIR [--trace-db DB] [--data DIR] [--questions FILE ...] [--limit N]

Written under `out` (each folder a resumable export of `training.export`: `log.jsonl`, `data.jsonl`,
`dataset/` for `datasets.load_from_disk`):

- `triage/`: one GRPO prompt per finished run with a known gold specialty: the exact messages the graph sent
  the triage doctor (its recorded triage event), `gold_specialty`, `reference_reply` (the reply naming it, which
  `ermedrag train sft --config sft_triage` warm-starts the triage on), `specialties` (the run's list),
  `label_source`. A run whose gold specialty is unknown is LEFT OUT, never guessed, and counted; so is one
  whose gold specialty is not in the run's list, or that has no triage event (oracle or fixed triage).
- `easy/`, `medium/`, `hard/`: the attending's prompts by curriculum bucket (the run's specialist agreement
  s: every specialist right = easy, some = medium, none = hard): the exact messages of the run's first
  attending call, the specialists' opinions frozen in them, with `gold`, `options`, `agreement`, `bucket`,
  `majority`, `specialty` and `reference_reply` (`agents.attending.reference_reply`: the gold answer, naming the
  specialists who gave it). Runs without a gold answer have no bucket and are counted, not exported.
- `attending/`: the rows of every bucket in one dataset, what `ermedrag train sft --config sft_attending`
  warm-starts the attending on before its curriculum.

The gold specialty of a run: the `gold_specialty` its input carried (recorded as the triage event's gold),
else the benchmark metadata of its question (`gold_specialty_for`), found by question text and option texts
in the benchmark files of `data` (the shared data root or its `benchmarks/` folder; default
ERMEDRAG_SHARED_DATA) and `questions`. Nothing is downloaded.

The mapping table is `tools.specialties` (its docstring).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ermedrag.agents import attending as attending_role, triage as triage_role
from ermedrag.agents.base import to_chat
from ermedrag.tools.data.specialties import (
    LABEL_TABLES,
    LABELLED_BENCHMARKS,
    MAX_LABEL_CHARS,
    benchmark_family,
    fold_label,
    gold_specialty_for,
    question_field,
)
from ermedrag.tools.records.traces import TraceStore
from ermedrag.training.export import export_resumable

GRAPH = "mmedagent"
TRIAGE_DIR = "triage"
ATTENDING_DIR = "attending"  # every bucket's rows together: the attending's SFT warm start
BUCKETS: tuple[attending_role.Bucket, ...] = ("easy", "medium", "hard")
# ---------------------------------------------------------------------------------- labels by question


def question_key(question: str, options: Mapping[str, Any] | None) -> tuple[str, frozenset[str]]:
    """A question as a run and a benchmark file both spell it: its text and its option texts (any order: an
    eval may ask with the options permuted), without case or extra spaces."""
    texts = frozenset(fold_label(text) for text in (options or {}).values())
    return " ".join(str(question).split()).casefold(), texts


@dataclass(frozen=True)
class Label:
    specialty: str | None  # None: the benchmark knows the question but names no specialty (or disagrees)
    source: str


def labels_from_questions(questions: Iterable[Any]) -> dict[tuple[str, frozenset[str]], Label]:
    """Each question's label by `question_key`; a key whose rows disagree gets None (not a guess)."""
    found: dict[tuple[str, frozenset[str]], Label] = {}
    for q in questions:
        key = question_key(q.question, q.options)
        family = benchmark_family(q.benchmark, str((q.meta or {}).get("source") or ""))
        field_name = LABEL_TABLES[family][0] if family else "subject"
        value = str(question_field(q, field_name) or "")
        label = Label(gold_specialty_for(q), f"{q.benchmark} {field_name} {value!r}")
        earlier = found.get(key)
        if earlier is not None and earlier.specialty != label.specialty:
            label = Label(None, f"{earlier.source} and {label.source} disagree"[:MAX_LABEL_CHARS])
        found[key] = label
    return found


def load_labels(
    data: str | os.PathLike[str] | None, questions: Sequence[str | os.PathLike[str]] = ()
) -> dict[tuple[str, frozenset[str]], Label]:
    """Labels of the benchmark files that have a table (from the `data` folder: the root holding `benchmarks/`
    or that folder; default ERMEDRAG_SHARED_DATA; a benchmark whose file is absent is skipped) and of the
    question files in `questions`. Never downloads."""
    from ermedrag.tools.data.benchmarks import (
        BENCHMARKS,
        benchmarks_folder,
        default_data_dir,
        load_benchmark,
        load_questions_file,
    )

    folder = benchmarks_folder(data) if data else default_data_dir()
    loaded: list[Any] = []
    for name in LABELLED_BENCHMARKS:
        if folder is not None and all((folder / f).is_file() for f in BENCHMARKS[name].local_files):
            loaded.extend(load_benchmark(name, folder))
    for path in questions:
        loaded.extend(load_questions_file(path))
    return labels_from_questions(loaded)


# ------------------------------------------------------------------------------------------------ export


@dataclass
class MMedAgentExportConfig:
    traces: str = field(metadata={"help": "trace database (SQLite) to read"})
    out: str = field(metadata={"help": "output folder: triage/, easy/, medium/, hard/, attending/"})
    data: str | None = field(
        default=None,
        metadata={
            "help": "shared data root (or its benchmarks/ folder) whose metadata labels the triage; default "
            "ERMEDRAG_SHARED_DATA"
        },
    )
    questions: list[str] = field(
        default_factory=list, metadata={"help": "more benchmark JSONL files whose metadata labels the triage"}
    )
    limit: int | None = field(default=None, metadata={"help": "process at most this many runs per dataset"})


def finished_runs(store: TraceStore) -> list[dict[str, Any]]:
    """The finished runs of the mmedagent graph, by run id."""
    return sorted((r for r in store.runs() if r["graph"] == GRAPH and r.get("finished_at")), key=lambda r: r["run_id"])


def _first(events: Iterable[dict[str, Any]], agent: str) -> dict[str, Any] | None:
    """The run's first call of `agent` (the attending's sample 0: every sample has the same prompt)."""
    return next((e for e in events if e["agent"] == agent), None)


def triage_row(
    run: dict[str, Any], events: Sequence[dict[str, Any]], labels: Mapping[tuple[str, frozenset[str]], Label]
) -> tuple[dict[str, Any] | None, str]:
    """The run's triage row, or None and why it is left out (`no_triage_event`, `no_gold_specialty`,
    `not_in_specialties`)."""
    event = _first(events, "triage")
    if event is None:
        return None, "no_triage_event"
    question = run["question"]
    specialties = [str(s) for s in ((event.get("inputs") or {}).get("specialties") or [])][
        : triage_role.MAX_SPECIALTIES
    ]
    given = event.get("gold")  # the input's gold_specialty
    if isinstance(given, str) and given.strip():
        label = Label(given, "input gold_specialty")
    else:
        label = labels.get(question_key(question["question"], question.get("options"))) or Label(None, "")
    if label.specialty is None:
        return None, "no_gold_specialty"
    gold = triage_role.canonical_specialty(label.specialty, specialties)
    if gold is None:
        return None, "not_in_specialties"
    return {
        "prompt": to_chat(event["messages"]),
        "gold_specialty": gold,
        "reference_reply": triage_role.reference_reply(gold),
        "specialties": specialties,
        "label_source": label.source,
        "question": question["question"],
        "run_id": run["run_id"],
        "event_id": event["event_id"],
    }, "ok"


def attending_row(run: dict[str, Any], events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's attending row (the opinions frozen in its recorded prompt), or None without an attending call."""
    event = _first(events, "attending")
    if event is None:
        return None
    answer, question = run.get("answer") or {}, run["question"]
    specialist_answers = list(answer.get("specialist_answers") or [])
    return {
        "prompt": to_chat(event["messages"]),
        "gold": run["gold"],
        "options": question.get("options"),
        "agreement": answer.get("agreement"),
        "bucket": answer.get("bucket"),
        "majority": answer.get("majority"),
        "specialty": answer.get("specialty"),
        "specialist_answers": specialist_answers,
        "reference_reply": attending_role.reference_reply(run["gold"], specialist_answers, question.get("options")),
        "question": question["question"],
        "run_id": run["run_id"],
        "event_id": event["event_id"],
    }


def export_mmedagent(config: MMedAgentExportConfig, progress: bool = True) -> dict[str, Any]:
    """Write the triage, per-bucket and all-bucket attending datasets (module docstring); return the counts: per
    dataset (`triage`, `easy`, `medium`, `hard`, `attending`) those of `training.export.export_resumable`, plus `runs`,
    `labelled_questions` (benchmark questions whose metadata names a specialty), `triage_left_out` (reason →
    runs) and `no_bucket` (runs without a gold answer or an attending call)."""
    store = TraceStore(config.traces)
    labels = load_labels(config.data, config.questions)
    out = Path(config.out)
    triage_items, left_out = [], Counter()
    by_bucket: dict[str, list[dict[str, Any]]] = {b: [] for b in BUCKETS}
    no_bucket = 0
    runs = finished_runs(store)
    for run in runs:
        events = list(store.events(run_id=run["run_id"]))
        row, why = triage_row(run, events, labels)
        if row is None:
            left_out[why] += 1
        else:  # the label is part of the key: a rerun with other labels redoes the run, never keeps a stale one
            triage_items.append({"key": f"{run['run_id']}:{row['gold_specialty']}", "row": row})
        bucket = (run.get("answer") or {}).get("bucket")
        attending = attending_row(run, events) if run.get("gold") and bucket in by_bucket else None
        if attending is None:
            no_bucket += 1
        else:
            by_bucket[bucket].append({"key": run["run_id"], "row": attending})
    counts: dict[str, Any] = {
        "runs": len(runs),
        "labelled_questions": sum(1 for label in labels.values() if label.specialty),
    }
    every_bucket = [item for items in by_bucket.values() for item in items]
    for name, items in ((TRIAGE_DIR, triage_items), *by_bucket.items(), (ATTENDING_DIR, every_bucket)):
        counts[name] = export_resumable(
            out / name,
            items,
            "key",
            lambda item: item,
            row_key="row",
            limit=config.limit,
            progress=progress,
            unit=f"{name} run",
        )
    counts["triage_left_out"] = dict(sorted(left_out.items()))
    counts["no_bucket"] = no_bucket
    return counts


def export_summary(counts: Mapping[str, Any], out: str | os.PathLike[str]) -> str:
    """One line for the CLI: rows per dataset, what was left out and why, where the datasets are."""
    left = counts["triage_left_out"]
    why = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in left.items())
    buckets = ", ".join(f"{b} {counts[b]['rows']}" for b in BUCKETS)
    return (
        f"mmedagent: {counts['runs']} finished runs → triage {counts[TRIAGE_DIR]['rows']} rows "
        f"({sum(left.values())} left out{': ' + why if why else ''}; labels: the runs' gold_specialty and "
        f"{counts['labelled_questions']} benchmark questions); attending {buckets} "
        f"({counts['no_bucket']} without a bucket: no gold answer); "
        f"datasets in {Path(out)}/{{triage,easy,medium,hard,attending}}/dataset"
    )
