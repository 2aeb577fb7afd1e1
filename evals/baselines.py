"""What trivial answers score on a set of questions: the figures every accuracy is read against.

A model that always answers "yes", copies its prompt's worked example or names one class for every case gets a
number that looks like learning on a set whose golds lean that way. Beside any accuracy, on the same questions:
- `chance`: the mean of 1 / (number of options);
- `majority`: always the most common gold answer of these very questions (the strongest constant answer);
- `first_option`: always the first option listed;
- `copy_example`: answering with the prompt's worked example's answer (only where prompts have one);
and, for a set of replies, `modal_share`: the share of its most common answer (a collapse detector: 1.0 is one
answer for everything). A gain counts only above the strongest baseline's 95% interval (`beats_baselines`).
`balanced_positions` moves each gold answer to a position of its own in turn (multiple choice), and
`balanced_by_answer` draws as many questions of each gold answer (yes/no/maybe, whose options cannot move), so
that a model that always names one answer scores chance on a held-out set, not the set's lean. `paired_change`
says whether a model's accuracy moved on the same questions by more than noise (McNemar's exact test).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ermedrag.agents.base import fold_case
from ermedrag.agents.respondent import parse_answer
from ermedrag.evals.metrics import wilson_interval


def share(hits: int, n: int) -> dict[str, Any]:
    """A rate with its count and Wilson 95% interval."""
    low, high = wilson_interval(hits, n)
    return {"rate": round(hits / n, 4) if n else None, "hits": hits, "n": n, "ci95": [round(low, 4), round(high, 4)]}


def modal_share(answers: Sequence[Hashable]) -> float | None:
    """The share of the most common answer (None, an unparsed one, counts as an answer of its own)."""
    return round(Counter(answers).most_common(1)[0][1] / len(answers), 4) if answers else None


def worked_example_answer(messages: Sequence[Any]) -> str | None:
    """What the worked example of a conversation answers (its first assistant turn's `<answer>`), or None without
    one; messages as LangChain messages or chat dicts (`{"role": "assistant", "content": ...}`)."""
    for message in messages[1:-1]:
        if isinstance(message, Mapping):
            text = message.get("content") if message.get("role") == "assistant" else None
        else:
            text = message.text if getattr(message, "type", None) == "ai" else None
        if isinstance(text, str):
            return parse_answer(text, None)["answer"]
    return None


def trivial_baselines(
    golds: Sequence[str | None],
    options: Sequence[Sequence[str]],
    prompts: Sequence[Sequence[Any]] | None = None,
) -> dict[str, Any]:
    """`chance`, `majority`, `first_option` and (with `prompts`) `copy_example` on these questions: `golds` the
    right answers, `options` each question's choices in the order shown (a question without options adds nothing
    to `chance` but counts in its mean)."""
    n = len(golds)
    known = Counter(fold_case(g) for g in golds if g is not None)  # a question without gold: no constant is right
    baselines: dict[str, Any] = {
        "chance": round(sum(1 / len(o) for o in options if o) / n, 4) if n else None,
        "majority": share(max(known.values(), default=0), n),
        "first_option": share(sum(same(g, o[0] if o else None) for g, o in zip(golds, options)), n),
    }
    if prompts is not None:
        copies = [worked_example_answer(p) for p in prompts]
        baselines["copy_example"] = share(sum(same(c, g) for c, g in zip(copies, golds)), n)
    return baselines


def same(answer: str | None, gold: str | None) -> bool:
    """Two answers name the same thing (any case, spaces collapsed); None matches nothing."""
    return (
        answer is not None
        and gold is not None
        and fold_case(" ".join(answer.split())) == fold_case(" ".join(gold.split()))
    )


def beats_baselines(rate: float | None, baselines: Mapping[str, Any]) -> bool:
    """`rate` is above every baseline's 95% interval (a bare number, such as chance, is its own bound)."""
    bounds = [b["ci95"][1] if isinstance(b, Mapping) else b for b in baselines.values() if b is not None]
    return rate is not None and rate > max(bounds, default=0.0)


def balanced_positions(questions: Sequence[Any]) -> list[Any]:
    """The questions (`tools.data.benchmarks.Question`) with their option texts rotated so that the i-th one's gold
    answer stands at position i mod its number of options: every position holds the gold equally often (within one)
    among questions of one size. The keys stay in order; the texts keep their cyclic order around the gold."""
    balanced = []
    for index, question in enumerate(questions):
        keys = list(question.options)
        texts = [question.options[key] for key in keys]
        gold_at = keys.index(question.answer)
        target = index % len(keys)
        shift = gold_at - target
        rotated = {key: texts[(i + shift) % len(keys)] for i, key in enumerate(keys)}
        balanced.append(dataclasses.replace(question, options=rotated, answer=keys[target]))
    return balanced


def balanced_by_answer(questions: Sequence[Any], n: int) -> list[Any]:
    """`n` of the questions, in their order, taking each gold answer in turn (yes, no, maybe, yes, …), so that every
    answer is gold equally often (within one); an answer whose questions run out leaves its turns to the others."""
    by_answer: dict[str, list[Any]] = {}
    for question in questions:
        by_answer.setdefault(question.answer, []).append(question)
    queues = [list(reversed(group)) for _, group in sorted(by_answer.items())]
    drawn: list[Any] = []
    while len(drawn) < n and any(queues):
        for queue in queues:
            if queue and len(drawn) < n:
                drawn.append(queue.pop())
    return drawn


def paired_change(before: Sequence[bool], after: Sequence[bool]) -> dict[str, Any]:
    """Whether a change of accuracy on the same questions is more than noise: the questions right only before and
    right only after, and McNemar's exact two-sided p-value on them (the chance that a fair coin splits the
    discordant questions at least this unevenly). A difference of two questions in 48 has p near 1."""
    if len(before) != len(after):
        raise ValueError(f"paired answers of {len(before)} and {len(after)} questions")
    lost = sum(b and not a for b, a in zip(before, after))
    gained = sum(a and not b for b, a in zip(before, after))
    discordant = lost + gained
    tail = sum(math.comb(discordant, k) for k in range(min(lost, gained) + 1)) / 2**discordant
    return {
        "n": len(before),
        "right_before": sum(before),
        "right_after": sum(after),
        "right_before_only": lost,
        "right_after_only": gained,
        "mcnemar_p": round(min(1.0, 2 * tail), 4),
    }
