"""Med-R³ progressive RL: three GRPO stages over the reason ↔ search loop of `graphs.med_r3`.

    stage 1 reasoning   no retrieval       correctness + format + length
    stage 2 retrieval   search loop        retrieval hit (gold evidence found) + search format
    stage 3 joint       search loop        correctness + format + retrieval hit + search format + penalties

    from ermedrag.training.med_r3 import train_med_r3
    summary = train_med_r3("training/configs/med_r3.yaml", stages=[1, 2, 3])   # or stages=[2]: rerun one
    # CLI: ermedrag train med-r3 --stages 1,2,3 --config training/configs/med_r3.yaml

Rollouts (`make_med_r3_rollout`, TRL's `rollout_func`). The search loop runs at token level, as the graph
runs it at text level: the policy generates until it closes `</search>` or `</answer>` (or EOS, or its token
budget); after a closed search the query is run with `tools.retrieval.retrieve` (top `search_k`), the
results are rendered with `agents.reasoner.render_documents` (tags inside them neutralised), tokenised on
their own and appended to the completion, and generation continues from the exact token sequence. At most
`max_searches` searches; `max_completion_length` bounds the tokens the *model* writes over all steps
(inserted documents are not counted). An empty query, a search over budget or a search without budget left
ends the rollout, as in the graph. Each rollout returns `env_mask`: 1 for every token the model sampled, 0
for every inserted document token, exactly; TRL multiplies it into the loss mask ("tool mask"), so
retrieved tokens carry no gradient and do not count in `completions/mean_length`. Extra fields returned
per completion reach the reward functions: `model_text` (what the model wrote: its segments, without the
inserted documents), `retrieved_ids` (doc ids of every retrieved snippet, deduplicated, in order),
`searches` (`{"query", "snippet_ids"}` per executed search).

Why `rollout_func` and not `tools=` / `environment_factory=`: TRL's tool loop parses JSON tool calls with the
chat template's response schema and inserts results as `tool` turns, while Med-R³ searches inline
(`<search>q</search>` inside the assistant turn) and continues the same turn; `rollout_func` gives exact
control of stop strings and of the token sequence, and works without vLLM (the rollout calls the trainer's
own model through `trl.models.utils.unwrap_model_for_generation`, as TRL's transformers path does).
Limits: generation is transformers' `generate` (no vLLM: `use_vllm: true` is refused) and no sampling
log-probs are returned (TRL recomputes them). A rollout that ended at `</answer>` is closed with an EOS
token, so TRL counts it terminated; one cut by the token budget, or ended by a search beyond the limit or an
empty query, has none and counts as truncated (`completions/clipped_ratio`; `mask_truncated_completions: true`
leaves those out of the loss).

Reward functions (TRL signature `f(completions, **kwargs) -> list[float | None]`; none raises on any input):

| reward | name in the config | value |
|---|---|---|
| `well_formed_correctness_reward` | correctness | `training.rewards.well_formed_correctness_reward` on the model's own text (documents removed): an answer counts only in a well-formed reply, else stage 1 learns to skip its reasoning |
| `format_reward` | format | `training.rewards.format_reward` on the model's own text |
| `length_penalty` | length | `training.rewards.make_length_penalty(max_chars)` on the model's own text |
| `retrieval_hit_reward` | retrieval_hit | share of the row's `gold_evidence` doc ids among the retrieved doc ids; None without gold evidence |
| `search_format_reward` | search_format | 0.0 without a search or with a model-written `<document>`; else the share of well-formed searches |
| `med_r3_penalties` | penalties | -(0.5·bad search + 1.0·forged document + 0.5·overlong + 0.5·think length), each part in [0, 1] |

A search is well formed when its `<search>` is closed, its query (whitespace collapsed) is non-empty, at most
`agents.reasoner.MAX_QUERY_CHARS` long and holds no tag, it lies inside `<think>…</think>`, and it is one of
the first `MAX_SEARCHES` (4). Forged document: any `<document>`/`</document>` tag in the model's own text.
Overlong: model text beyond two thirds of `max_chars`, linearly up to 1 at `max_chars`; think length: the
same for the `<think>` content and `max_think_chars`. Rewards read `model_text` / `retrieved_ids` from the
rollout when present; on a plain transcript they strip the documents the environment inserted (a
`\\n<document>\\n…\\n</document>\\n` block right after `</search>`) and read snippet ids from their `[id]` lines.

Stages chain by merging: each stage trains a fresh LoRA adapter on the previous stage's model, saves it in
`OUTPUT/stageN/` (with `metrics.jsonl`, `curves.png`, `training_config.json`), then merges it into the
weights and saves the merged model and tokenizer in `OUTPUT/stageN/merged/`, which the next stage loads by
path (TRL's supported path: a model by path plus `peft_config`; with `beta > 0` the reference is that stage's
starting model, the adapter disabled). Without LoRA the stage's full model in `OUTPUT/stageN/` is the next
start. `OUTPUT/stageN/med_r3_stage.json` records where a stage's model is; a stage run alone starts from the
previous stage's record (an error names the missing one), and `OUTPUT/med_r3_summary.json` collects runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import StoppingCriteria

from ermedrag.agents import reasoner
from ermedrag.agents.reasoner import MAX_QUERY_CHARS, SEARCH_STOP, render_documents
from ermedrag.tools.gold_evidence import doc_id
from ermedrag.training.config import GRPOTrainingConfig, config_from_dict, load_config
from ermedrag.training.rewards import (
    MAX_TEXT_CHARS,
    RewardFunc,
    _column,
    completion_text,
    correctness_reward,
    format_reward,
    make_length_penalty,
    well_formed_correctness_reward,
)

logger = logging.getLogger(__name__)

ANSWER_STOP = "</answer>"
MAX_SEARCHES = 4
STAGE_RECORD = "med_r3_stage.json"
SUMMARY_FILE = "med_r3_summary.json"
MERGED_DIR = "merged"

# ---------------------------------------------------------------------------------------------------------
# Reading a transcript: the model's own text, its searches, the documents the environment inserted
# ---------------------------------------------------------------------------------------------------------

_ENV_DOCUMENT = re.compile(r"(?<=</search>)\n<document>\n.*?\n</document>\n", re.DOTALL | re.IGNORECASE)
_SNIPPET_LINE = re.compile(r"^\[([^\[\]\s]+)\]", re.MULTILINE)
_DOCUMENT_TAG = re.compile(r"</?\s*document\s*>", re.IGNORECASE)
_SEARCH_OPEN = re.compile(r"<search>", re.IGNORECASE)
_SEARCH_CLOSE = re.compile(r"</search>", re.IGNORECASE)
_ANY_TAG = re.compile(r"</?\s*(document|search|answer|think)\s*>", re.IGNORECASE)
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL | re.IGNORECASE)


def strip_environment_documents(transcript: str) -> str:
    """The transcript without the document blocks the search loop inserted (right after `</search>`)."""
    return _ENV_DOCUMENT.sub("", transcript)


def _model_texts(completions: list, kwargs: dict[str, Any]) -> list[str]:
    """Per completion: the rollout's `model_text` when given, else the transcript without inserted documents."""
    texts = []
    for i, completion in enumerate(completions):
        given = _column(kwargs, "model_text", i)
        text = given if isinstance(given, str) else strip_environment_documents(completion_text(completion))
        texts.append(text[:MAX_TEXT_CHARS])
    return texts


def _retrieved(completion: Any, kwargs: dict[str, Any], index: int) -> set[str]:
    given = _column(kwargs, "retrieved_ids", index)
    if isinstance(given, (list, tuple)):
        return {doc_id(d) for d in given if d is not None}
    text = completion_text(completion)[:MAX_TEXT_CHARS]
    return {doc_id(sid) for block in _ENV_DOCUMENT.findall(text) for sid in _SNIPPET_LINE.findall(block)}


@dataclass(frozen=True)
class SearchAudit:
    """The searches in a model's own text: how many, how many are well formed, whether it forged a document."""

    searches: int
    well_formed: int
    forged_document: bool


def audit_searches(text: str, max_searches: int = MAX_SEARCHES) -> SearchAudit:
    """Check every `<search>` of the model's own text (see the module docstring for the rules)."""
    text = str(text or "")[:MAX_TEXT_CHARS]
    forged = bool(_DOCUMENT_TAG.search(text))
    think_spans = [m.span(1) for m in _THINK.finditer(text)]
    opens = [m.start() for m in _SEARCH_OPEN.finditer(text)]
    good = 0
    for n, start in enumerate(opens):
        body_start = start + len("<search>")
        close = _SEARCH_CLOSE.search(text, body_start)
        next_open = opens[n + 1] if n + 1 < len(opens) else len(text)
        if close is None or close.start() > next_open:
            continue  # unclosed, or a second <search> opened inside it
        query = " ".join(text[body_start:close.start()].split())
        inside_think = any(s <= start and close.end() <= e for s, e in think_spans)
        if query and len(query) <= MAX_QUERY_CHARS and not _ANY_TAG.search(query) and inside_think \
                and n < max_searches:
            good += 1
    return SearchAudit(searches=len(opens), well_formed=good, forged_document=forged)


def _log(kwargs: dict[str, Any], name: str, values: Sequence[float]) -> None:
    log_metric = kwargs.get("log_metric")
    if callable(log_metric) and values:
        try:
            log_metric(name, float(sum(values) / len(values)))
        except Exception:  # logging must never stop training
            logger.debug("log_metric failed for %s", name, exc_info=True)


# ---------------------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------------------


def _on_model_text(func: RewardFunc) -> RewardFunc:
    """`func` applied to the model's own text (documents removed), under the same name."""

    def wrapped(completions: list, **kwargs: Any) -> list[float | None]:
        try:
            texts = _model_texts(list(completions or []), kwargs)
            return func([[{"role": "assistant", "content": t}] for t in texts], **kwargs)
        except Exception:
            logger.warning("%s failed; scoring 0.0", func.__name__, exc_info=True)
            return [0.0] * len(completions or [])

    wrapped.__name__ = wrapped.__qualname__ = func.__name__
    wrapped.__doc__ = f"{func.__doc__ or func.__name__} Read from the model's own text, without inserted documents."
    return wrapped


med_r3_correctness_reward = _on_model_text(correctness_reward)  # plain: what evaluation counts
med_r3_well_formed_correctness_reward = _on_model_text(well_formed_correctness_reward)  # what training rewards
med_r3_format_reward = _on_model_text(format_reward)


def search_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """0.0 without a search or with a model-written `<document>`; else the share of well-formed searches."""
    rewards, counts = [], []
    for i, text in enumerate(_safe_model_texts(completions, kwargs)):
        try:
            audit = audit_searches(text)
            counts.append(float(audit.searches))
            ok = audit.searches and not audit.forged_document
            rewards.append(audit.well_formed / audit.searches if ok else 0.0)
        except Exception:
            logger.warning("search_format_reward failed on completion %d; scoring 0.0", i, exc_info=True)
            rewards.append(0.0)
    _log(kwargs, "med_r3/searches", counts)
    return rewards


def retrieval_hit_reward(completions: list, **kwargs: Any) -> list[float | None]:
    """Share of the row's `gold_evidence` doc ids that the rollout's searches retrieved; None when the row has
    no gold evidence (the reward does not apply to it)."""
    rewards: list[float | None] = []
    for i, completion in enumerate(completions or []):
        try:
            gold_value = _column(kwargs, "gold_evidence", i)
            gold = {doc_id(g) for g in gold_value if g} if isinstance(gold_value, (list, tuple)) else set()
            if not gold:
                rewards.append(None)
                continue
            rewards.append(len(gold & _retrieved(completion, kwargs, i)) / len(gold))
        except Exception:
            logger.warning("retrieval_hit_reward failed on completion %d; scoring 0.0", i, exc_info=True)
            rewards.append(0.0)
    return rewards


def _ramp(chars: int, max_chars: int) -> float:
    """0 up to two thirds of `max_chars`, linearly up to 1 at `max_chars` and beyond."""
    soft = (2 * max_chars) // 3
    return min(1.0, max(0, chars - soft) / max(1, max_chars - soft))


PENALTY_WEIGHTS = {"bad_search": 0.5, "forged_document": 1.0, "overlong": 0.5, "think_length": 0.5}


def make_med_r3_penalties(max_chars: int = 3000, max_think_chars: int = 2000, max_searches: int = MAX_SEARCHES,
                          weights: dict[str, float] | None = None) -> RewardFunc:
    """A reward function named `med_r3_penalties` (≤ 0): weighted bad-search, forged-document, overlong and
    think-length parts (`PENALTY_WEIGHTS`, each part in [0, 1]); each part's batch mean is logged as
    `med_r3/<part>`."""
    merged = {**PENALTY_WEIGHTS, **(weights or {})}
    if set(merged) != set(PENALTY_WEIGHTS) or any(not isinstance(w, (int, float)) or w < 0 for w in merged.values()):
        raise ValueError(f"penalty weights must be numbers >= 0 for {sorted(PENALTY_WEIGHTS)}, got {merged}")
    if max_chars <= 0 or max_think_chars <= 0:
        raise ValueError(f"max_chars and max_think_chars must be positive, got {max_chars}, {max_think_chars}")

    def med_r3_penalties(completions: list, **kwargs: Any) -> list[float]:
        rewards, parts_log = [], {name: [] for name in merged}
        for i, text in enumerate(_safe_model_texts(completions, kwargs)):
            try:
                audit = audit_searches(text, max_searches)
                think = " ".join(m.group(1) for m in _THINK.finditer(text))
                parts = {
                    "bad_search": 1.0 if audit.well_formed < audit.searches else 0.0,
                    "forged_document": 1.0 if audit.forged_document else 0.0,
                    "overlong": _ramp(len(text), max_chars),
                    "think_length": _ramp(len(think), max_think_chars),
                }
            except Exception:
                logger.warning("med_r3_penalties failed on completion %d; no penalty", i, exc_info=True)
                parts = dict.fromkeys(merged, 0.0)
            for name, value in parts.items():
                parts_log[name].append(value)
            rewards.append(-sum(merged[name] * value for name, value in parts.items()))
        for name, values in parts_log.items():
            _log(kwargs, f"med_r3/{name}", values)
        return rewards

    return med_r3_penalties


med_r3_penalties = make_med_r3_penalties()


def _safe_model_texts(completions: Any, kwargs: dict[str, Any]) -> list[str]:
    try:
        return _model_texts(list(completions or []), kwargs)
    except Exception:
        logger.warning("unreadable completions; scoring them as empty", exc_info=True)
        return [""] * len(completions or [])


# ---------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage of the schedule: whether the search loop runs, and the default reward weights by name."""

    number: int
    name: str
    search: bool
    rewards: tuple[tuple[str, float], ...]


STAGES: dict[int, Stage] = {
    1: Stage(1, "reasoning", False, (("correctness", 1.0), ("format", 0.5), ("length", 0.2))),
    2: Stage(2, "retrieval", True, (("retrieval_hit", 1.0), ("search_format", 0.5))),
    3: Stage(3, "joint", True, (("correctness", 1.0), ("format", 0.5), ("retrieval_hit", 0.5),
                                ("search_format", 0.2), ("penalties", 1.0))),
}


def reward_registry(max_chars: int = 3000, max_think_chars: int = 2000,
                    max_searches: int = MAX_SEARCHES) -> dict[str, RewardFunc]:
    """Every reward a stage may use, by its config name."""
    return {
        "correctness": med_r3_well_formed_correctness_reward,
        "format": med_r3_format_reward,
        "length": _on_model_text(make_length_penalty(max_chars)),
        "retrieval_hit": retrieval_hit_reward,
        "search_format": search_format_reward,
        "penalties": make_med_r3_penalties(max_chars, max_think_chars, max_searches),
    }


def stage_rewards(stage: int, overrides: dict[str, float] | None = None, **registry_kwargs: Any
                  ) -> tuple[list[RewardFunc], list[float]]:
    """The reward functions and weights of `stage`: its defaults, updated by `overrides` (name → weight;
    a new name adds that reward, weight 0 drops it)."""
    registry = reward_registry(**registry_kwargs)
    weights = dict(STAGES[stage].rewards)
    unknown = set(overrides or {}) - set(registry)
    if unknown:
        raise ValueError(f"stage {stage}: unknown reward(s) {sorted(unknown)}; known: {sorted(registry)}")
    weights.update({name: float(w) for name, w in (overrides or {}).items()})
    kept = [(name, w) for name, w in weights.items() if w != 0]
    if not kept:
        raise ValueError(f"stage {stage}: every reward weight is 0")
    return [registry[name] for name, _ in kept], [w for _, w in kept]


# ---------------------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------------------


def _chat(messages: list) -> list[dict[str, str]]:
    from ermedrag.training.export import ROLE_TO_CHAT

    return [{"role": ROLE_TO_CHAT.get(m.type, "user"), "content": m.text} for m in messages]


def med_r3_dataset(questions: Iterable[Any]):
    """A `datasets.Dataset` of conversational GRPO prompts (`agents.reasoner.build_messages`, empty transcript)
    with the columns the rewards read: `gold`, `options`, `gold_evidence` (doc ids, possibly empty), plus `id`
    and `benchmark`. A question is an `tools.benchmarks.Question` or a dict with `question`, `options`,
    `gold` (or `answer`), and optionally `gold_evidence`, `id`, `benchmark`."""
    from datasets import Dataset

    rows = []
    for question in questions:
        q = question if isinstance(question, dict) else dataclasses.asdict(question)
        options = q.get("options") or None
        gold = q.get("gold", q.get("answer"))
        rows.append({
            "prompt": _chat(reasoner.build_messages(str(q.get("question") or ""), options, "")),
            "gold": None if gold is None else str(gold),
            "options": {str(k): str(v) for k, v in options.items()} if options else None,
            "gold_evidence": [str(g) for g in (q.get("gold_evidence") or [])],
            "id": str(q.get("id") or ""),
            "benchmark": str(q.get("benchmark") or ""),
        })
    if not rows:
        raise ValueError("med_r3_dataset: no questions")
    return Dataset.from_list(rows)


def build_med_r3_dataset(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *,
                         qrels: str | os.PathLike[str] | None = None,
                         corpus_dir: str | os.PathLike[str] | None = None,
                         limit: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Questions from JSONL files in the shared schema (`pubmedqa_train.jsonl`, `bioasq_yesno.jsonl`, any
    benchmark file; the benchmark is named after the file) → `out` (`Dataset.save_to_disk`). BioASQ needs
    `qrels` (`retrieval/bioasq_qrels.jsonl`); `corpus_dir` (the corpora folder) gives PubMedQA's exact ids.
    `limit` samples that many questions per file (seeded)."""
    from ermedrag.tools.benchmarks import load_questions_file
    from ermedrag.tools.gold_evidence import question_gold_evidence

    questions, counts = [], {}
    for path in paths:
        loaded = load_questions_file(path, limit=limit, seed=seed)
        for q in loaded:
            questions.append({"id": q.id, "question": q.question, "options": q.options, "gold": q.answer,
                              "benchmark": q.benchmark,
                              "gold_evidence": question_gold_evidence(q, qrels, corpus_dir)})
        counts[str(path)] = len(loaded)
    dataset = med_r3_dataset(questions)
    dataset.save_to_disk(str(out))
    with_gold = sum(1 for q in questions if q["gold_evidence"])
    return {"rows": len(questions), "with_gold_evidence": with_gold, "per_file": counts, "out": str(out)}


# ---------------------------------------------------------------------------------------------------------
# Rollout: the search loop at token level
# ---------------------------------------------------------------------------------------------------------

SearchFn = Callable[[str], list[dict]]


def index_search(index: Any, k: int = 5, coarse_k: int = 8) -> SearchFn:
    """A search function over an opened index: the graph's search (`tools.retrieval.search`, top `k`)."""
    from ermedrag.tools.retrieval import search

    return lambda query: search(index, query, k=k, coarse_k=coarse_k)


@dataclass
class Rollout:
    """One completion of the search loop. `env_mask[i]` is 0 exactly where `completion_ids[i]` was inserted."""

    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    model_segments: list[str] = field(default_factory=list)
    searches: list[dict[str, Any]] = field(default_factory=list)
    generated_tokens: int = 0
    ended: str = ""  # answer | eos | budget | search_budget (a search beyond max_searches) | bad_search (empty query)

    @property
    def model_text(self) -> str:
        return "".join(self.model_segments)

    @property
    def retrieved_ids(self) -> list[str]:
        return list(dict.fromkeys(d for s in self.searches for d in s["doc_ids"]))


class _StopOnStrings(StoppingCriteria):
    """Stopping criterion: a row stops once the text it generated in this call contains a stop string; the
    generate-call length at which it stopped is kept in `stopped_at`."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], input_length: int):
        self.tokenizer, self.stops, self.input_length = tokenizer, list(stops), input_length
        self.window = max(len(s) for s in stops) + 2  # tokens; every token covers at least one character
        self.stopped_at: dict[int, int] = {}

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        length = input_ids.shape[1]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        start = max(self.input_length, length - self.window)
        for row in range(input_ids.shape[0]):
            if row in self.stopped_at:
                done[row] = True
                continue
            tail = self.tokenizer.decode(input_ids[row, start:].tolist(), skip_special_tokens=False)
            if any(stop in tail for stop in self.stops):
                self.stopped_at[row] = length
                done[row] = True
        return done


def _eos_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """The generation config's EOS token ids (the tokenizer's when it has none)."""
    eos = generation_config.eos_token_id if generation_config.eos_token_id is not None else tokenizer.eos_token_id
    return [e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def _generate_step(model: Any, tokenizer: Any, contexts: list[list[int]], budgets: list[int],
                   generation_config: Any, stops: list[str], logits_processor: Sequence[Any] | None,
                   ) -> list[tuple[list[int], str]]:
    """One generation step for each context: (the segment's tokens, why it ended: a stop string, eos, budget)."""
    import torch
    from transformers import LogitsProcessorList, StoppingCriteriaList

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(c) for c in contexts)
    input_ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts])
    attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    device = next(model.parameters()).device
    config = copy.deepcopy(generation_config)
    config.max_new_tokens = max(budgets)
    eos_ids = set(_eos_ids(config, tokenizer))
    criterion = _StopOnStrings(tokenizer, stops, width)
    output = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                            generation_config=config, stopping_criteria=StoppingCriteriaList([criterion]),
                            logits_processor=LogitsProcessorList(list(logits_processor or [])))
    segments = []
    for row, budget in enumerate(budgets):
        new = output[row, width:].tolist()
        end, why = len(new), "budget"
        eos_at = next((j for j, t in enumerate(new) if t in eos_ids), None)
        if eos_at is not None:
            end, why = eos_at + 1, "eos"
        if row in criterion.stopped_at and criterion.stopped_at[row] - width <= end:
            end = criterion.stopped_at[row] - width
            text = tokenizer.decode(new[:end], skip_special_tokens=False)
            why = min((s for s in stops if s in text), key=text.index, default="budget")
        if end > budget:
            end, why = budget, "budget"
        segments.append((new[:end], why))
    return segments


def run_search_rollouts(model: Any, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], *,
                        generation_config: Any, search: SearchFn | None, max_searches: int = MAX_SEARCHES,
                        step_max_new_tokens: int = 256, max_total_tokens: int = 1024,
                        logits_processor: Sequence[Any] | None = None,
                        end_stops: Sequence[str] = (ANSWER_STOP,)) -> list[Rollout]:
    """The Med-R³ loop for a batch of tokenised prompts, with `model.generate` (call under `torch.no_grad`).
    `search=None` disables retrieval: generation then stops only at an `end_stops` string (kept in the
    completion), EOS or the budget."""
    stops = [SEARCH_STOP, *end_stops] if search is not None else list(end_stops)
    eos_id = next(iter(_eos_ids(generation_config, tokenizer)), None)
    rollouts = [Rollout() for _ in prompt_ids]
    active = list(range(len(rollouts)))
    while active:
        budgets = [min(step_max_new_tokens, max_total_tokens - rollouts[i].generated_tokens) for i in active]
        contexts = [list(prompt_ids[i]) + rollouts[i].completion_ids for i in active]
        steps = _generate_step(model, tokenizer, contexts, budgets, generation_config, stops, logits_processor)
        still_active = []
        for i, (tokens, why) in zip(active, steps):
            rollout = rollouts[i]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            rollout.completion_ids += tokens
            rollout.env_mask += [1] * len(tokens)
            rollout.model_segments.append(text)
            rollout.generated_tokens += len(tokens)
            if why != SEARCH_STOP:
                rollout.ended = {"eos": "eos", "budget": "budget"}.get(why, "answer")
                if rollout.ended == "answer" and eos_id is not None:
                    # TRL counts a completion without a final EOS as truncated (clipped_ratio, and
                    # mask_truncated_completions would drop it from the loss); ending here is the model's choice
                    rollout.completion_ids.append(eos_id)
                    rollout.env_mask.append(1)
                continue
            raw = tokenizer.decode(tokens, skip_special_tokens=False)
            query = reasoner.parse_step(raw[: raw.index(SEARCH_STOP) + len(SEARCH_STOP)])["query"]
            action = reasoner.after_step(query, searches_done=len(rollout.searches),
                                         generated_tokens=rollout.generated_tokens, max_searches=max_searches,
                                         max_total_tokens=max_total_tokens)
            if action != "search":
                rollout.ended = {"no_search": "bad_search", "search_budget": "search_budget",
                                 "token_budget": "budget"}[action]
            else:
                snippets = search(query)
                # split_special_tokens: a retrieved "<|im_end|>" stays text, never a control token
                document_ids = tokenizer(render_documents(snippets), add_special_tokens=False,
                                         split_special_tokens=True)["input_ids"]
                rollout.completion_ids += document_ids
                rollout.env_mask += [0] * len(document_ids)
                rollout.searches.append({"query": query, "snippet_ids": [s["id"] for s in snippets],
                                         "doc_ids": [str(s.get("doc_id") or doc_id(s["id"])) for s in snippets]})
                still_active.append(i)
        active = still_active
    return rollouts


def make_med_r3_rollout(search: SearchFn | None, *, max_searches: int = MAX_SEARCHES,
                        step_max_new_tokens: int = 256, max_total_tokens: int | None = None,
                        logits_processor: Sequence[Any] | None = None,
                        end_stops: Sequence[str] = (ANSWER_STOP,)) -> Callable[[list, Any], dict[str, Any]]:
    """A TRL `rollout_func(prompts, trainer) -> dict` running the search loop with the trainer's model.

    Returns `prompt_ids`, `completion_ids`, `logprobs` (None: TRL recomputes them), `env_mask` and, per
    completion, `model_text`, `retrieved_ids`, `searches`. `max_total_tokens` defaults to the trainer's
    `max_completion_length`; `logits_processor` (transformers LogitsProcessors) constrains sampling. With
    `search=None` it is a plain rollout that ends at an `end_stops` string (`train_grpo`'s `stop_strings`)."""
    import torch

    def med_r3_rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        from trl.data_utils import is_conversational
        from trl.models.utils import unwrap_model_for_generation

        tokenizer = trainer.processing_class
        if is_conversational({"prompt": prompts[0]}):
            prompt_ids = tokenizer.apply_chat_template(
                conversation=prompts, chat_template=getattr(trainer, "chat_template", None),
                add_generation_prompt=True, tokenize=True, return_dict=True,
                **(getattr(trainer, "chat_template_kwargs", None) or {}))["input_ids"]
        else:
            prompt_ids = tokenizer(text=prompts)["input_ids"]
        prompt_ids = [list(ids) for ids in prompt_ids]
        total = max_total_tokens or trainer.max_completion_length
        dist = getattr(trainer, "_dist", None)
        full_params = dist.summon_full_params(trainer.model_wrapped, recurse=False) if dist else contextlib.nullcontext()
        with unwrap_model_for_generation(
            trainer.model_wrapped, trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=getattr(trainer, "generation_kwargs", None),
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model, torch.no_grad(), full_params:
            rollouts = run_search_rollouts(model, tokenizer, prompt_ids, generation_config=trainer.generation_config,
                                           search=search, max_searches=max_searches,
                                           step_max_new_tokens=step_max_new_tokens, max_total_tokens=total,
                                           logits_processor=logits_processor, end_stops=end_stops)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": None,
            "env_mask": [r.env_mask for r in rollouts],
            "model_text": [r.model_text for r in rollouts],
            "retrieved_ids": [r.retrieved_ids for r in rollouts],
            "searches": [[{"query": s["query"], "snippet_ids": s["snippet_ids"]} for s in r.searches]
                         for r in rollouts],
        }

    return med_r3_rollout


# ---------------------------------------------------------------------------------------------------------
# Configuration and the schedule
# ---------------------------------------------------------------------------------------------------------


@dataclass
class MedR3TrainingConfig(GRPOTrainingConfig):
    """GRPO fields (shared by the stages) plus the search loop's and the stages' settings. For Med-R³,
    `max_completion_length` is the number of tokens the model writes over all steps of one rollout (inserted
    documents are not counted) and `output_dir` holds one folder per stage."""

    index_dir: str | None = field(
        default=None, metadata={"help": "Corpus index (`ermedrag index`) searched in stages 2 and 3."})
    chroma_url: str | None = field(default=None, metadata={"help": "Chroma server URL instead of the on-disk store."})
    search_k: int = field(default=5, metadata={"help": "Snippets returned per search (Med-R³: top 5)."})
    coarse_k: int = field(default=8, metadata={"help": "Chunks kept by coarse hybrid retrieval before re-scoring."})
    max_searches: int = field(default=MAX_SEARCHES, metadata={"help": "Searches per rollout (Med-R³: 4)."})
    step_max_new_tokens: int = field(
        default=256, metadata={"help": "Tokens of one generation step (until a search closes or the answer ends)."})
    max_chars: int = field(
        default=3000, metadata={"help": "Model-written characters at which the length and overlong penalties are "
                                        "full; they start at two thirds of it."})
    max_think_chars: int = field(
        default=2000, metadata={"help": "Characters of <think> content at which the think-length penalty is full."})
    stage_overrides: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata={"help": "Per stage (1, 2, 3): fields of this config for that stage only (dataset, max_steps, "
                          "learning_rate, num_generations, ...), and `rewards`: {name: weight} updating the stage's "
                          "reward weights (names: correctness, format, length, retrieval_hit, search_format, "
                          "penalties; weight 0 drops one)."})


def _check(config: MedR3TrainingConfig, stage: int) -> None:
    if config.use_vllm:
        raise ValueError("Med-R³ rollouts generate with transformers inside the rollout function; use_vllm is not "
                         "supported (set use_vllm: false)")
    if config.reward_weights is not None:
        raise ValueError("Med-R³ weights rewards per stage: use stage_overrides: {N: {rewards: {name: weight}}} "
                         "instead of reward_weights")
    if STAGES[stage].search and not config.index_dir:
        raise ValueError(f"stage {stage} ({STAGES[stage].name}) searches: set index_dir to a corpus index")


def stage_config(config: MedR3TrainingConfig, stage: int) -> tuple[MedR3TrainingConfig, dict[str, float]]:
    """The config of one stage (overrides applied, output in `output_dir/stageN`) and its reward overrides."""
    overrides = {str(k): v for k, v in (config.stage_overrides or {}).items()}
    unknown = sorted(set(overrides) - {str(n) for n in STAGES})
    if unknown:
        raise ValueError(f"stage_overrides has unknown stage(s) {unknown}; stages are 1, 2, 3")
    own = dict(overrides.get(str(stage)) or {})
    rewards = own.pop("rewards", None) or {}
    forbidden = sorted(set(own) & {"model", "output_dir", "stage_overrides"})
    if forbidden:
        raise ValueError(f"stage_overrides.{stage} may not set {forbidden}")
    data = {**dataclasses.asdict(config), **own, "stage_overrides": {}}
    data["output_dir"] = str(Path(config.output_dir) / f"stage{stage}")
    staged = config_from_dict(data, MedR3TrainingConfig, source=f"stage_overrides.{stage}")
    _check(staged, stage)
    return staged, {str(k): float(v) for k, v in rewards.items()}


def _parse_stages(stages: Iterable[int] | str) -> list[int]:
    items = stages.split(",") if isinstance(stages, str) else list(stages)
    try:
        numbers = sorted({int(str(s).strip()) for s in items if str(s).strip()})
    except ValueError:
        raise ValueError(f"stages must be numbers among 1, 2, 3, got {stages!r}") from None
    if not numbers or any(n not in STAGES for n in numbers):
        raise ValueError(f"stages must be among 1, 2, 3, got {stages!r}")
    if numbers != list(range(numbers[0], numbers[-1] + 1)):
        raise ValueError(f"stages must be consecutive (each starts from the previous one's output), got {numbers}")
    return numbers


def _stage_dir(config: MedR3TrainingConfig, stage: int) -> Path:
    return Path(config.output_dir) / f"stage{stage}"


def stage_start_model(config: MedR3TrainingConfig, stage: int) -> str:
    """Stage 1 starts from `config.model`; stage N from the model that stage N-1 recorded."""
    if stage == 1:
        return config.model_path()
    record = _stage_dir(config, stage - 1) / STAGE_RECORD
    if not record.is_file():
        raise FileNotFoundError(f"stage {stage} starts from stage {stage - 1}'s model, but {record} does not exist: "
                                f"run stage {stage - 1} first (--stages {stage - 1},{stage})")
    model_dir = json.loads(record.read_text(encoding="utf-8"))["model_dir"]
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"stage {stage - 1}'s model {model_dir} (from {record}) is missing: rerun stage "
                                f"{stage - 1}")
    return model_dir


def train_stage(config: MedR3TrainingConfig, stage: int, *, logits_processor: Sequence[Any] | None = None
                ) -> dict[str, Any]:
    """Run one stage from the previous stage's model; write its folder; return its summary."""
    from trl import GRPOTrainer

    from ermedrag.training.trainers import (
        METRICS_FILE,
        MetricsRecorder,
        _load_dataset,
        _load_tokenizer,
        _run,
    )

    staged, reward_overrides = stage_config(config, stage)
    start_model = stage_start_model(config, stage)
    spec = STAGES[stage]
    funcs, weights = stage_rewards(stage, reward_overrides, max_chars=staged.max_chars,
                                   max_think_chars=staged.max_think_chars, max_searches=staged.max_searches)
    search = None
    if spec.search:
        from ermedrag.tools.index import cached_index

        index = cached_index(str(Path(staged.index_dir).expanduser()), staged.chroma_url or None)
        search = index_search(index, k=staged.search_k, coarse_k=staged.coarse_k)
    rollout = make_med_r3_rollout(search, max_searches=staged.max_searches,
                                  step_max_new_tokens=staged.step_max_new_tokens,
                                  max_total_tokens=staged.max_completion_length, logits_processor=logits_processor,
                                  end_stops=staged.stop_strings or (ANSWER_STOP,))
    dataset = _load_dataset(staged.dataset)
    if "prompt" not in dataset.column_names:
        raise ValueError(f"Med-R³ dataset {staged.dataset} has no `prompt` column; it has {dataset.column_names} "
                         "(build one with training.med_r3.build_med_r3_dataset)")
    tokenizer = _load_tokenizer(start_model)
    args = staged.to_trl()
    args.reward_weights = weights
    output_dir = Path(staged.output_dir)
    recorder = MetricsRecorder(output_dir / METRICS_FILE)
    staged.model = start_model  # recorded in training_config.json and the plot title
    with warnings.catch_warnings():  # rollout_func is marked experimental in TRL 1.16: said once, in the docstring
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
        trainer = GRPOTrainer(model=start_model, reward_funcs=funcs, args=args, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=staged.lora_config(), callbacks=[recorder],
                              rollout_func=rollout)
    summary = _run(trainer, staged, recorder, kind=f"med-r3 stage{stage}")
    summary["reward_functions"] = list(trainer.reward_func_names)
    summary["reward_weights"] = weights
    main = trainer.accelerator.is_main_process
    accelerator = trainer.accelerator
    del trainer
    gc.collect()
    model_dir = output_dir
    if staged.use_lora:
        model_dir = output_dir / MERGED_DIR
        if main:
            _merge_adapter(output_dir, model_dir, staged.resolved_dtype())
        accelerator.wait_for_everyone()
    summary.update(stage=stage, name=spec.name, search=spec.search, start_model=start_model,
                   model_dir=str(model_dir), adapter_dir=str(output_dir) if staged.use_lora else None)
    if main:
        record = {k: summary[k] for k in ("stage", "name", "search", "start_model", "model_dir", "adapter_dir",
                                          "steps", "reward_functions", "reward_weights")}
        (output_dir / STAGE_RECORD).write_text(json.dumps({**record, "finished_at": time.time()}, indent=2),
                                               encoding="utf-8")
    return summary


def _merge_adapter(adapter_dir: Path, merged_dir: Path, dtype: str) -> None:
    """Fold the stage's LoRA adapter into its base weights; save model and tokenizer to `merged_dir`."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=dtype)
    merged = model.merge_and_unload()
    if merged_dir.exists():
        shutil.rmtree(merged_dir)
    merged.save_pretrained(str(merged_dir))
    AutoTokenizer.from_pretrained(str(adapter_dir)).save_pretrained(str(merged_dir))
    del model, merged
    gc.collect()


def train_med_r3(config: MedR3TrainingConfig | str | os.PathLike[str], stages: Iterable[int] | str = (1, 2, 3),
                 *, logits_processor: Sequence[Any] | None = None) -> dict[str, Any]:
    """Run the given stages in order (consecutive, among 1, 2, 3), each from the previous stage's model.

    `config` is a `MedR3TrainingConfig` or the path of its YAML file. `logits_processor` (transformers
    LogitsProcessors) constrains rollout sampling in every stage. Returns `{"stages": {N: summary},
    "final_model": path}` and updates `output_dir/med_r3_summary.json`."""
    if not isinstance(config, MedR3TrainingConfig):
        config = load_config(config, MedR3TrainingConfig)
    numbers = _parse_stages(stages)
    for n in numbers:
        stage_config(config, n)  # every stage's settings are checked before the first one trains
    results: dict[int, dict[str, Any]] = {}
    for n in numbers:
        logger.info("Med-R³ stage %d (%s)", n, STAGES[n].name)
        results[n] = train_stage(config, n, logits_processor=logits_processor)
    summary_path = Path(config.output_dir) / SUMMARY_FILE
    previous = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    merged = {**previous.get("stages", {}), **{str(n): s for n, s in results.items()}}
    final_model = results[numbers[-1]]["model_dir"]
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps({"stages": merged, "final_model": final_model}, indent=2, default=str),
                            encoding="utf-8")
    return {"stages": results, "final_model": final_model}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ermedrag.training.med_r3 dataset FILE.jsonl ... --out DIR [--qrels Q] [--corpus-dir C] [--limit N]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ermedrag.training.med_r3", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("dataset", help="build a Med-R³ GRPO dataset from question JSONL files")
    build.add_argument("paths", nargs="+", help="questions in the shared schema (pubmedqa_train.jsonl, ...)")
    build.add_argument("--out", required=True, help="dataset folder to write (datasets.load_from_disk)")
    build.add_argument("--qrels", help="bioasq_qrels.jsonl (needed for BioASQ files)")
    build.add_argument("--corpus-dir", help="corpora folder holding pubmedqa_contexts.jsonl.gz (exact PubMedQA ids)")
    build.add_argument("--limit", type=int, help="questions sampled per file")
    build.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = build_med_r3_dataset(args.paths, args.out, qrels=args.qrels, corpus_dir=args.corpus_dir,
                                  limit=args.limit, seed=args.seed)
    print(json.dumps(counts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
