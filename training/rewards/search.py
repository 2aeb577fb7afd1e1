"""GRPO rewards on the searches of a reason ↔ search rollout (Med-R³): retrieval hit, search format, penalties.

TRL's reward-function signature `f(completions, **kwargs) -> list[float | None]`; none raises on any input.

| reward (curve name) | config name | value |
|---|---|---|
| `retrieval_hit_reward` | retrieval_hit | share of the row's `gold_evidence` doc ids among the retrieved doc ids; None without gold evidence |
| `search_format_reward` | search_format | 0.0 without a search or with a model-written `<document>`; else the share of well-formed searches |
| `med_r3_penalties` | penalties | -(0.5·bad search + 1.0·forged document + 0.5·overlong + 0.5·think length), each part in [0, 1] |

A search is well formed when its `<search>` is closed, its query (whitespace collapsed) is non-empty, at most
`agents.reasoner.MAX_QUERY_CHARS` long and holds no tag, it lies inside `<think>…</think>`, and it is one of
the first `MAX_SEARCHES` (4). Forged document: any `<document>`/`</document>` tag in the model's own text.
Overlong: model text beyond two thirds of `max_chars`, linearly up to 1 at `max_chars`; think length: the
same for the `<think>` content and `max_think_chars`. Rewards read the model's own text
(`training.reward_text.own_text`) and the rollout's `retrieved_ids` when present; on a plain transcript the
snippet ids come from the `[id]` lines of the documents the environment inserted.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ermedrag.agents import reasoner
from ermedrag.agents.reasoner import MAX_QUERY_CHARS, MAX_SEARCHES
from ermedrag.tools.data.gold_evidence import doc_id
from ermedrag.training.rewards.text import (
    MAX_TEXT_CHARS,
    column,
    completion_text,
    own_text,
)

logger = logging.getLogger(__name__)

_SNIPPET_LINE = re.compile(r"^(?:\d{1,4}\. )?\[([^\[\]\s]+)\]", re.MULTILINE)  # "3. [id] text" (or "[id] text")
_SEARCH_OPEN = re.compile(r"<search>", re.IGNORECASE)
_SEARCH_CLOSE = re.compile(r"</search>", re.IGNORECASE)
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class SearchAudit:
    """The searches in a model's own text: how many, how many are well formed, whether it forged a document."""

    searches: int
    well_formed: int
    forged_document: bool


def audit_searches(text: str, max_searches: int = MAX_SEARCHES) -> SearchAudit:
    """Check every `<search>` of the model's own text (see the module docstring for the rules). Linear time:
    opening and closing tags and `<think>` spans are each found once and walked in order (bisect)."""
    text = str(text or "")[:MAX_TEXT_CHARS]
    forged = bool(reasoner.DOCUMENT_TAG.search(text))
    think_spans = [m.span(1) for m in _THINK.finditer(text)]  # in order, not overlapping
    think_starts = [start for start, _ in think_spans]
    opens = [m.start() for m in _SEARCH_OPEN.finditer(text)]
    closes = [(m.start(), m.end()) for m in _SEARCH_CLOSE.finditer(text)]
    close_starts = [start for start, _ in closes]
    good = 0
    for n, start in enumerate(opens[:max_searches]):  # later searches are over budget: never well formed
        body_start = start + len("<search>")
        at = bisect.bisect_left(close_starts, body_start)
        next_open = opens[n + 1] if n + 1 < len(opens) else len(text)
        if at == len(closes) or closes[at][0] > next_open:
            continue  # unclosed, or a second <search> opened inside it
        close_start, close_end = closes[at]
        query = " ".join(text[body_start:close_start].split())
        span = bisect.bisect_right(think_starts, start) - 1
        inside_think = span >= 0 and close_end <= think_spans[span][1]
        if query and len(query) <= MAX_QUERY_CHARS and not reasoner.TAG.search(query) and inside_think:
            good += 1
    return SearchAudit(searches=len(opens), well_formed=good, forged_document=forged)


def _own_texts(completions: Any, kwargs: dict[str, Any]) -> list[str]:
    """Every completion's own text, cut to `MAX_TEXT_CHARS`; unreadable completions read as empty."""
    try:
        return [own_text(c, kwargs, i)[:MAX_TEXT_CHARS] for i, c in enumerate(list(completions or []))]
    except Exception:
        logger.warning("unreadable completions; scoring them as empty", exc_info=True)
        return [""] * len(completions or [])


def _retrieved(completion: Any, kwargs: dict[str, Any], index: int) -> set[str]:
    given = column(kwargs, "retrieved_ids", index)
    if isinstance(given, (list, tuple)):
        return {doc_id(d) for d in given if d is not None}
    text = completion_text(completion)[:MAX_TEXT_CHARS]
    return {doc_id(sid) for block in reasoner.INSERTED_DOCUMENT.findall(text) for sid in _SNIPPET_LINE.findall(block)}


def _log(kwargs: dict[str, Any], name: str, values: Sequence[float]) -> None:
    log_metric = kwargs.get("log_metric")
    if callable(log_metric) and values:
        try:
            log_metric(name, float(sum(values) / len(values)))
        except Exception:  # logging must never stop training
            logger.debug("log_metric failed for %s", name, exc_info=True)


def search_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """0.0 without a search or with a model-written `<document>`; else the share of well-formed searches."""
    rewards, counts = [], []
    for i, text in enumerate(_own_texts(completions, kwargs)):
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
            gold_value = column(kwargs, "gold_evidence", i)
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


@dataclass(frozen=True)
class MedR3Penalties:
    """The reward `med_r3_penalties` (≤ 0): weighted bad-search, forged-document, overlong and think-length
    parts (`weights` updates `PENALTY_WEIGHTS`; each part in [0, 1]); each part's batch mean is logged as
    `med_r3/<part>`."""

    max_chars: int = 3000
    max_think_chars: int = 2000
    max_searches: int = MAX_SEARCHES
    weights: Mapping[str, float] = field(default_factory=dict, hash=False)
    __name__ = "med_r3_penalties"  # TRL's curve name; a class attribute, not a field

    def __post_init__(self) -> None:
        merged = {**PENALTY_WEIGHTS, **self.weights}
        if set(merged) != set(PENALTY_WEIGHTS) or any(
            not isinstance(w, (int, float)) or w < 0 for w in merged.values()
        ):
            raise ValueError(f"penalty weights must be numbers >= 0 for {sorted(PENALTY_WEIGHTS)}, got {merged}")
        if self.max_chars <= 0 or self.max_think_chars <= 0:
            raise ValueError(
                f"max_chars and max_think_chars must be positive, got {self.max_chars}, {self.max_think_chars}"
            )
        object.__setattr__(self, "weights", merged)  # frozen: the full set, once

    def parts(self, text: str) -> dict[str, float]:
        """Each penalty part of one model text, in [0, 1]."""
        audit = audit_searches(text, self.max_searches)
        think = " ".join(m.group(1) for m in _THINK.finditer(text))
        return {
            "bad_search": 1.0 if audit.well_formed < audit.searches else 0.0,
            "forged_document": 1.0 if audit.forged_document else 0.0,
            "overlong": _ramp(len(text), self.max_chars),
            "think_length": _ramp(len(think), self.max_think_chars),
        }

    def __call__(self, completions: list, **kwargs: Any) -> list[float]:
        rewards, parts_log = [], {name: [] for name in self.weights}
        for i, text in enumerate(_own_texts(completions, kwargs)):
            try:
                parts = self.parts(text)
            except Exception:
                logger.warning("med_r3_penalties failed on completion %d; no penalty", i, exc_info=True)
                parts = dict.fromkeys(self.weights, 0.0)
            for name, value in parts.items():
                parts_log[name].append(value)
            rewards.append(-sum(self.weights[name] * value for name, value in parts.items()))
        for name, values in parts_log.items():
            _log(kwargs, f"med_r3/{name}", values)
        return rewards


med_r3_penalties = MedR3Penalties()
