"""Multi-turn rollouts for TRL's `rollout_func`: generation that ends at stop strings and, given a search
function, runs the reason ↔ search loop at token level with the inserted documents masked out of the loss.

    rollout = make_search_rollout(index_search(index, k=5))          # Med-R³ stages 2 and 3
    rollout = make_search_rollout(None, end_stops=["</answer>"], force_answer=False)  # plain GRPO: one step

The search loop runs at token level, as `graphs.med_r3` runs it at text level: the policy generates until it
closes `</search>` or an end stop such as `</answer>` (or EOS, or its token budget); after a closed search
the query is run (`index_search`: the graph's own `tools.retrieval.search`, top `k`), the results are
rendered with `agents.reasoner.render_documents` (every field defused), tokenised on their own and appended
to the completion, and generation continues from the exact token sequence. What follows a step is
`agents.reasoner.after_step`, the graph's rule: search (at most `max_searches`), continue a step cut by its
own limit, or force the answer — the system's `<answer>` prompt is inserted and the model writes the answer
(`ANSWER_MAX_NEW_TOKENS`), as the graph's `force_answer` node does. `max_total_tokens` bounds the tokens the
*model* writes over the reasoning steps (inserted text is not counted). Each rollout returns `env_mask`: 1 for
every token the model sampled, 0 for every inserted token (documents, the forcing prompt), exactly; TRL
multiplies it into the loss mask ("tool mask"), so inserted tokens carry no gradient and do not count in
`completions/mean_length`. Extra fields returned per completion reach the reward functions: `model_text`
(what the model wrote: its segments only; format and search rewards read it), `answer_text` (the model's
segments and the forcing prompt, never a document; correctness reads it), `forced_answer` (why the answer was
forced, or None), `retrieved_ids` (doc ids of every retrieved snippet, deduplicated, in order), `searches`
(`{"query", "snippet_ids"}` per executed search). With `search=None, force_answer=False` a rollout is one
step: it ends at an end stop (kept in the completion), EOS or the budget. The graphs' answer extraction (an
answer naming no option is read back once, `graphs.steps.extract_if_unparsed`) is deliberately not applied
here: a reward must judge the answer the policy itself wrote, or garbage answers would earn correctness.

Why `rollout_func` and not `tools=` / `environment_factory=`: TRL's tool loop parses JSON tool calls with the
chat template's response schema and inserts results as `tool` turns, while Med-R³ searches inline
(`<search>q</search>` inside the assistant turn) and continues the same turn; `rollout_func` gives exact
control of stop strings and of the token sequence, and works without vLLM (the rollout calls the trainer's
own model through `trl.models.utils.unwrap_model_for_generation`, as TRL's transformers path does).
Limits: generation is transformers' `generate` (no vLLM) and no sampling log-probs are returned (TRL
recomputes them). A rollout that ended at an end stop (its own or the forced answer's) is closed with an EOS
token, so TRL counts it terminated; one cut by a token budget has none and counts as truncated (`completions/clipped_ratio`; `mask_truncated_completions: true` leaves those out of
the loss).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import StoppingCriteria

from ermedrag.agents import reasoner
from ermedrag.agents.reasoner import (
    ANSWER_MAX_NEW_TOKENS,
    ANSWER_STOP,
    MAX_SEARCHES,
    MAX_TOTAL_TOKENS,
    SEARCH_STOP,
    STEP_MAX_NEW_TOKENS,
    render_documents,
)
from ermedrag.tools.data.gold_evidence import doc_id
from ermedrag.tools.retrieval.search import COARSE_K, SEARCH_K

SearchFn = Callable[[str], list[dict]]
RolloutFunc = Callable[[list, Any], dict[str, Any]]


def index_search(index: Any, k: int = SEARCH_K, coarse_k: int = COARSE_K) -> SearchFn:
    """A search function over an opened index: the graph's search (`tools.retrieval.search`, top `k`)."""
    from ermedrag.tools.retrieval.search import search

    return lambda query: search(index, query, k=k, coarse_k=coarse_k)


# Why a rollout ended: the model wrote its answer (an end stop), its EOS, the budget cut it mid-answer, or the
# system asked for the answer (answer forcing).
ENDINGS = ("answer", "eos", "budget", "forced")


@dataclass
class Rollout:
    """One completion of the search loop. `env_mask[i]` is 0 exactly where `completion_ids[i]` was inserted
    (documents, the answer-forcing prompt); `segments` are the same pieces as text (`agents.reasoner.Segment`)."""

    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    segments: list[reasoner.Segment] = field(default_factory=list)
    searches: list[dict[str, Any]] = field(default_factory=list)
    generated_tokens: int = 0
    ended: str = ""  # one of ENDINGS, or without answer forcing the reason the loop stopped
    forced_reason: str | None = None  # why the answer was forced (`agents.reasoner.ForceReason`)

    @property
    def model_text(self) -> str:
        return reasoner.model_text(self.segments)

    @property
    def answer_text(self) -> str:
        return reasoner.answer_text(self.segments)

    @property
    def retrieved_ids(self) -> list[str]:
        return list(dict.fromkeys(d for s in self.searches for d in s["doc_ids"]))

    def add(self, kind: reasoner.SegmentKind, token_ids: list[int], text: str) -> None:
        self.completion_ids += token_ids
        self.env_mask += [1 if kind == "model" else 0] * len(token_ids)
        self.segments.append(reasoner.Segment(kind=kind, text=text))
        if kind == "model":
            self.generated_tokens += len(token_ids)


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


def _generate_step(
    model: Any,
    tokenizer: Any,
    contexts: list[list[int]],
    budgets: list[int],
    generation_config: Any,
    stops: list[str],
    logits_processor: Sequence[Any] | None,
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
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        generation_config=config,
        stopping_criteria=StoppingCriteriaList([criterion]),
        logits_processor=LogitsProcessorList(list(logits_processor or [])),
    )
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


def _inserted_ids(tokenizer: Any, text: str) -> list[int]:
    # split_special_tokens: a retrieved "<|im_end|>" stays text, never a control token
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def run_search_rollouts(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    generation_config: Any,
    search: SearchFn | None,
    max_searches: int = MAX_SEARCHES,
    step_max_new_tokens: int = STEP_MAX_NEW_TOKENS,
    max_total_tokens: int = MAX_TOTAL_TOKENS,
    logits_processor: Sequence[Any] | None = None,
    end_stops: Sequence[str] = (ANSWER_STOP,),
    force_answer: bool = True,
) -> list[Rollout]:
    """The reason ↔ search loop for a batch of tokenised prompts, with `model.generate` (call under
    `torch.no_grad`), following `agents.reasoner.after_step` as the graph does: search, continue a step cut by
    its limit, or force the answer. `search=None` disables retrieval. `force_answer=False` makes a plain
    one-step rollout instead: it ends at an `end_stops` string (kept in the completion), EOS or the budget."""
    stops = [SEARCH_STOP, *end_stops] if search is not None else list(end_stops)
    eos_id = next(iter(_eos_ids(generation_config, tokenizer)), None)
    rollouts = [Rollout() for _ in prompt_ids]
    active, to_force = list(range(len(rollouts))), []
    while active:
        budgets = [min(step_max_new_tokens, max_total_tokens - rollouts[i].generated_tokens) for i in active]
        contexts = [list(prompt_ids[i]) + rollouts[i].completion_ids for i in active]
        steps = _generate_step(model, tokenizer, contexts, budgets, generation_config, stops, logits_processor)
        still_active = []
        for i, budget, (tokens, why) in zip(active, budgets, steps):
            rollout = rollouts[i]
            rollout.add("model", tokens, tokenizer.decode(tokens, skip_special_tokens=True))
            if search is None and not force_answer:
                _end(rollout, why, eos_id)
                continue
            raw = tokenizer.decode(tokens, skip_special_tokens=False)
            step = reasoner.parse_step(raw[: raw.index(SEARCH_STOP) + len(SEARCH_STOP)] if why == SEARCH_STOP else raw)
            action, reason = reasoner.after_step(
                step,
                hit_step_limit=why == "budget" and len(tokens) >= budget,
                searches_done=len(rollout.searches),
                generated_tokens=rollout.generated_tokens,
                max_searches=max_searches if search else 0,
                max_total_tokens=max_total_tokens,
            )
            if action == "answered":
                _end(rollout, why, eos_id)
            elif action == "search":
                snippets = search(step["query"])
                shown_before = sum(len(s["snippet_ids"]) for s in rollout.searches)
                documents = render_documents(snippets, shown_before + 1)
                rollout.add("document", _inserted_ids(tokenizer, documents), documents)
                rollout.searches.append(
                    {
                        "query": step["query"],
                        "snippet_ids": [s["id"] for s in snippets],
                        "doc_ids": [str(s.get("doc_id") or doc_id(s["id"])) for s in snippets],
                    }
                )
                still_active.append(i)
            elif action == "continue":
                still_active.append(i)
            elif not force_answer:
                rollout.ended = str(reason)
            else:
                if why == "eos":  # the model's EOS would end the sequence before the answer it is asked for
                    rollout.completion_ids.pop()
                    rollout.env_mask.pop()
                rollout.forced_reason = reason
                to_force.append(i)
        active = still_active
    if to_force:
        _force_answers(
            [rollouts[i] for i in to_force],
            [prompt_ids[i] for i in to_force],
            model,
            tokenizer,
            generation_config,
            logits_processor,
            eos_id,
        )
    return rollouts


def _end(rollout: Rollout, why: str, eos_id: int | None) -> None:
    """End a rollout whose last step ended for `why` (eos, budget, or an end stop: the answer)."""
    rollout.ended = why if why in ("eos", "budget") else "answer"
    if rollout.ended == "answer":
        _close_with_eos(rollout, eos_id)


def _close_with_eos(rollout: Rollout, eos_id: int | None) -> None:
    """TRL counts a completion without a final EOS as truncated (clipped_ratio, and mask_truncated_completions
    would drop it from the loss); ending at a stop string is the model's choice, so it is closed with EOS."""
    if eos_id is not None:
        rollout.completion_ids.append(eos_id)
        rollout.env_mask.append(1)


def _force_answers(
    rollouts: list[Rollout],
    prompt_ids: Sequence[Sequence[int]],
    model: Any,
    tokenizer: Any,
    generation_config: Any,
    logits_processor: Sequence[Any] | None,
    eos_id: int | None,
) -> None:
    """The graph's `force_answer` node at token level: the system's `<answer>` is inserted (masked) and the
    model writes the answer, up to `ANSWER_MAX_NEW_TOKENS` and `</answer>`."""
    for rollout in rollouts:
        prompt = reasoner.force_answer_prompt(rollout.model_text)
        rollout.add("prompt", _inserted_ids(tokenizer, prompt), prompt)
    contexts = [list(p) + r.completion_ids for p, r in zip(prompt_ids, rollouts)]
    steps = _generate_step(
        model,
        tokenizer,
        contexts,
        [ANSWER_MAX_NEW_TOKENS] * len(rollouts),
        generation_config,
        [ANSWER_STOP],
        logits_processor,
    )
    for rollout, (tokens, why) in zip(rollouts, steps):
        rollout.add("model", tokens, tokenizer.decode(tokens, skip_special_tokens=True))
        rollout.ended = "forced"
        if why == ANSWER_STOP:
            _close_with_eos(rollout, eos_id)


def make_search_rollout(
    search: SearchFn | None,
    *,
    max_searches: int = MAX_SEARCHES,
    step_max_new_tokens: int = STEP_MAX_NEW_TOKENS,
    max_total_tokens: int | None = None,
    logits_processor: Sequence[Any] | None = None,
    end_stops: Sequence[str] = (ANSWER_STOP,),
    force_answer: bool = True,
) -> RolloutFunc:
    """A TRL `rollout_func(prompts, trainer) -> dict` running the search loop with the trainer's model.

    Returns `prompt_ids`, `completion_ids`, `logprobs` (None: TRL recomputes them), `env_mask` and, per
    completion, `model_text`, `answer_text`, `forced_answer`, `retrieved_ids`, `searches`. `max_total_tokens`
    defaults to the trainer's `max_completion_length`; `logits_processor` (transformers LogitsProcessors)
    constrains sampling. With `search=None, force_answer=False` it is a plain rollout that ends at an
    `end_stops` string (`GRPOTrainingConfig.stop_strings`)."""
    import torch

    def search_rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        from trl.models.utils import unwrap_model_for_generation

        tokenizer = trainer.processing_class
        prompt_ids = _prompt_ids(prompts, trainer)
        total = max_total_tokens or trainer.max_completion_length
        dist = getattr(trainer, "_dist", None)
        full_params = (
            dist.summon_full_params(trainer.model_wrapped, recurse=False) if dist else contextlib.nullcontext()
        )
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=getattr(trainer, "generation_kwargs", None),
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
            full_params,
        ):
            rollouts = run_search_rollouts(
                model,
                tokenizer,
                prompt_ids,
                generation_config=trainer.generation_config,
                search=search,
                max_searches=max_searches,
                step_max_new_tokens=step_max_new_tokens,
                max_total_tokens=total,
                logits_processor=logits_processor,
                end_stops=end_stops,
                force_answer=force_answer,
            )
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": None,
            "env_mask": [r.env_mask for r in rollouts],
            "model_text": [r.model_text for r in rollouts],
            "answer_text": [r.answer_text for r in rollouts],
            "forced_answer": [r.forced_reason for r in rollouts],
            "retrieved_ids": [r.retrieved_ids for r in rollouts],
            "searches": [
                [{"query": s["query"], "snippet_ids": s["snippet_ids"]} for s in r.searches] for r in rollouts
            ],
        }

    return search_rollout


def _prompt_ids(prompts: list, trainer: Any) -> list[list[int]]:
    """The prompts tokenised as TRL's own generation path does (chat template for conversational prompts)."""
    from trl.data_utils import is_conversational

    tokenizer = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        prompt_ids = tokenizer.apply_chat_template(
            conversation=prompts,
            chat_template=getattr(trainer, "chat_template", None),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )["input_ids"]
    else:
        prompt_ids = tokenizer(text=prompts)["input_ids"]
    return [list(ids) for ids in prompt_ids]
