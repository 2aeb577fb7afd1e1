"""What an eval records per question: the configuration its results are keyed by (`EvalConfig`), each asking of a question (a sample, an option order), and the rows it writes: results (answer, tokens, timings, panel fields) and failures."""

from __future__ import annotations
import hashlib
import json
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping
from ermedrag.tools.data.benchmarks import Question
from ermedrag.tools.data.specialties import gold_specialty_for
from ermedrag.agents import attending, triage
from ermedrag.tools.settings import parse_bool
from ermedrag.graphs.registry import context_fields, graph_spec, load_graph, resolved_settings
from ermedrag.tools.records.jsonl import read_records
from ermedrag.tools.records.traces import TraceStore
from ermedrag.evals.position_bias import option_orders, original_key, rotate_options, shown_key


MAX_ERROR_CHARS = 2000  # a server's error text is untrusted and unbounded


@dataclass(frozen=True)
class EvalConfig:
    """What defines a result: the graph, its prompts' version and every setting it uses (`graphs.registry`), the
    samples per question. Change any of them and the questions are answered again. `plumbing` holds the other
    context fields given (where the vectors are served, ...): they reach the graph but do not change its answers,
    so not the key."""

    system: str
    settings: dict[str, Any] = field(default_factory=dict)
    samples: int = 1
    plumbing: dict[str, Any] = field(default_factory=dict)
    prompt_version: str = ""  # the graph's prompts (`graphs.registry.PROMPT_VERSIONS`); "" = the current ones

    def __post_init__(self) -> None:
        if not self.prompt_version:
            object.__setattr__(self, "prompt_version", graph_spec(self.system).prompt_version)

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
        return {
            "system": self.system,
            "model": self.model,
            "settings": self.settings,
            "samples": self.samples,
            "prompt_version": self.prompt_version,
        }

    def key(self) -> str:
        identity = {
            "system": self.system,
            "prompt_version": self.prompt_version,
            "settings": self.settings,
            "samples": self.samples,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def context(self, base_url: str | None, trace_db: str) -> dict[str, Any]:
        return {**self.plumbing, **self.settings, "trace_db": trace_db, **({"base_url": base_url} if base_url else {})}


def parse_overrides(pairs: Iterable[str], systems: Iterable[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings → context overrides, each value converted to the type of the field it sets (a bool
    field takes true/false, 1/0, yes/no, on/off); a key that no graph in `systems` has is an error naming the keys
    they do have."""
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
            overrides[key] = parse_bool(value) if kind is bool else kind(value) if kind in (int, float) else value
        except ValueError:
            takes = "true or false" if kind is bool else f"a{'n' if kind is int else ''} {kind.__name__}"
            raise ValueError(f"--set {pair!r}: {key} takes {takes}") from None
    return overrides


@dataclass(frozen=True)
class Asking:
    """One time a question is asked: which sample, and in which of its `orders` option orders (0 = as given)."""

    question: Question
    sample: int = 0
    order: int = 0
    orders: int = 1

    @property
    def options(self) -> dict[str, str]:
        """The options as this order shows them (`evals.position_bias.rotate_options`)."""
        options = self.question.options
        return rotate_options(options, self.order) if self.order and options else options

    @property
    def shown_gold(self) -> str | None:
        """The letter the gold option stands at in this order."""
        if not self.question.options:
            return self.question.answer
        return shown_key(list(self.question.options), self.question.answer, self.order)

    def key(self, config: EvalConfig) -> tuple[str, str, str, int, int]:
        return (config.key(), self.question.benchmark, self.question.id, self.sample, self.order)


def askings(question: Question, samples: int, permute_options: int) -> list[Asking]:
    """Every (order, sample) a question is asked in: orders interleaved, so a cut-short run has whole questions."""
    orders = option_orders(question.options, permute_options)
    return [Asking(question, sample, order, orders) for order in range(orders) for sample in range(samples)]


def done_keys(path: Path) -> set[tuple[str, str, str, int, int]]:
    """Keys already recorded, (config, benchmark, question, sample, order); a row written before orders existed is
    order 0. A line cut short by a kill is not one: its question is redone."""
    return {
        (r["config_key"], r["benchmark"], r["question_id"], r["sample"], int(r.get("order") or 0))
        for r in read_records(path)
        if {"config_key", "benchmark", "question_id", "sample"} <= r.keys()
    }


def question_thread(out_dir: Path, config: EvalConfig, question: Question, sample: int, order: int = 0) -> str:
    """The checkpoint thread of one (config, question, sample, order) of this results folder: the same on every
    rerun (so a rerun finds it), different for another folder (so folders sharing a Postgres store never meet).
    Order 0 is named as before orders existed, so a run killed before them continues."""
    identity = [str(out_dir.resolve()), config.key(), question.benchmark, question.id, sample]
    identity += [order] if order else []
    return "eval-" + hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]


def failure_record(
    config: EvalConfig, question: Question, sample: int, thread_id: str, err: BaseException, order: int = 0
) -> dict[str, Any]:
    """One line of `failures.jsonl`: which question failed, how, and when."""
    return {
        "config_key": config.key(),
        "system": config.system,
        "benchmark": question.benchmark,
        "question_id": question.id,
        "sample": sample,
        "order": order,
        "thread_id": thread_id,
        "error_type": type(err).__name__,
        "error": str(err)[:MAX_ERROR_CHARS],
        "time": time.time(),
    }


def respondent_stats(store: TraceStore, run_id: str) -> dict[str, Any]:
    """Tokens over the whole run, and the mean token entropy of the respondent's completion (when known)."""
    return token_stats(list(store.events(run_id=run_id)))


def token_stats(events: list[dict[str, Any]]) -> dict[str, Any]:
    """`respondent_stats` of a run's events."""
    output_tokens, entropy = 0, None
    for event in events:
        output_tokens += (event.get("usage") or {}).get("output_tokens", 0)
        if event["agent"] == "respondent":
            values = [t["entropy"] for t in event.get("logprobs") or [] if t.get("entropy") is not None]
            entropy = sum(values) / len(values) if values else None
    return {"output_tokens": output_tokens, "token_entropy": entropy}


def call_seconds(events: list[dict[str, Any]]) -> dict[str, float | None]:
    """The model's own time over a run's calls (`compute_s`, else the call's `latency_s`), and the time the calls
    waited before computing (`queue_s`, summed; None when no call recorded it: a backend that does not queue)."""
    model_seconds, wait_seconds = 0.0, None
    for event in events:
        compute = event.get("compute_s")
        model_seconds += float(compute if compute is not None else event.get("latency_s") or 0.0)
        if event.get("queue_s") is not None:
            wait_seconds = (wait_seconds or 0.0) + float(event["queue_s"])
    return {"model_seconds": model_seconds, "wait_seconds": wait_seconds}


def result_row(
    config: EvalConfig, asking: Asking, state: dict[str, Any], store: TraceStore, seconds: float
) -> dict[str, Any]:
    """The row of one answered question. `answer`, `gold` and `correct` are in the question's own option keys
    whatever order it was asked in; `answer_position`/`gold_position` are the letters in the order it saw."""
    question = asking.question
    answer = state.get("answer") or {}
    shown = answer.get("answer")
    keys = list(question.options or {})
    chosen = original_key(keys, shown, asking.order) if keys else shown
    events = list(store.events(run_id=state["run_id"]))
    return {
        "config_key": config.key(),
        "config": config.record(),
        "benchmark": question.benchmark,
        "question_id": question.id,
        "subject": question.subject,
        "sample": asking.sample,
        "order": asking.order,
        "orders": asking.orders,
        "options_count": len(keys),
        "gold": question.answer,
        "answer": chosen,
        "answer_position": shown if shown in keys else None,
        "gold_position": asking.shown_gold,
        "ok": bool(answer.get("ok")),
        "well_formed": bool(answer.get("well_formed")),
        "extracted": bool(answer.get("extracted")),
        "correct": chosen == question.answer,
        "error": answer.get("error"),
        "run_id": state.get("run_id"),
        "timings": state.get("timings", {}),
        "seconds": seconds,
        **token_stats(events),
        **call_seconds(events),
        **panel_fields(state, asking, config.settings.get("specialties")),
        **evidence_fields(state, keys, asking.order),
    }


def evidence_fields(state: Mapping[str, Any], keys: list[str], order: int) -> dict[str, Any]:
    """What the answer rests on and how sure it is: its citations (number, shown, doc id), the documents its
    evidence came from, and its option probabilities in the question's own keys with the chosen one's."""
    answer = state.get("answer") or {}
    probs = answer.get("option_probs")
    if probs and keys:
        probs = {original_key(keys, shown, order): p for shown, p in probs.items()}
    shown_docs = [s.get("doc_id") for s in [*(state.get("snippets") or []), *(state.get("documents") or [])]]
    return {
        "citations": [
            {"number": c.get("number"), "shown": bool(c.get("shown")), "doc_id": c.get("doc_id")}
            for c in answer.get("citations") or []
        ],
        "evidence_doc_ids": list(dict.fromkeys(d for d in shown_docs if d)),
        "option_probs": probs or None,
        "confidence": answer.get("confidence"),
    }


def panel_inputs(graph_inputs: set[str], question: Question) -> dict[str, Any]:
    """A panel graph's extra input: the question's specialty from its benchmark metadata (`tools.specialties`),
    the triage's gold label; nothing for a graph without that input or a question no table labels."""
    specialty = gold_specialty_for(question) if "gold_specialty" in graph_inputs else None
    return {"gold_specialty": specialty} if specialty else {}


def panel_fields(state: Mapping[str, Any], asking: Asking, specialties: str | None) -> dict[str, Any]:
    """A panel graph's (`mmedagent`) row fields: the specialty triage chose and whether it was the gold one (None
    when no gold specialty is known or the configuration's list lacks it), the curriculum bucket, and the
    specialists' majority vote (ties go to the answer given first, the attending's own rule) in the question's
    own keys and whether it was right: the majority-vote baseline, from the same run."""
    if "specialty" not in state:
        return {}
    keys = list(asking.question.options or {})
    answers = [o.get("answer") for o in state.get("opinions", [])]
    chosen = attending.vote(answers)
    majority = answers[chosen] if chosen is not None else None
    majority = original_key(keys, majority, asking.order) if keys else majority
    # The gold the run was given (`panel_inputs`), spelled as the configuration's list spells it (None if absent).
    gold_specialty = triage.canonical_specialty(
        state.get("gold_specialty"), triage.parse_specialties(specialties or ",".join(triage.SPECIALTIES))
    )
    fell_back = bool((state.get("triage") or {}).get("fell_back"))
    return {
        "specialty": state.get("specialty"),
        "gold_specialty": gold_specialty,
        # a fallback is the default specialty, not a triage: right only by the default's luck (a copied example
        # or a reply naming nothing falls back), so it never counts as a correct triage
        "triage_correct": None
        if gold_specialty is None
        else state.get("specialty") == gold_specialty and not fell_back,
        "triage_fell_back": fell_back,
        "bucket": state.get("bucket"),
        "majority": majority,
        "majority_correct": majority is not None and majority == asking.question.answer,
        "followed_majority": state.get("followed_majority"),
    }
