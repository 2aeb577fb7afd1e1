"""The triage policy's rewards (MMedAgent-RL): does the reply name the row's gold specialty, among the
specialties the row lists. The registry (`training.rewards.REWARDS`) names them `triage_correctness` and `triage_correctness_ungated`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ermedrag.agents import triage as triage_role
from ermedrag.training.rewards.answers import is_well_formed
from ermedrag.training.rewards.text import MAX_TEXT_CHARS, column, own_text

logger = logging.getLogger(__name__)


def _triage_hit(text: str, kwargs: Mapping[str, Any], index: int) -> bool:
    """The reply names the row's `gold_specialty` among the row's `specialties` (`agents.triage.parse_triage`)."""
    listed = column(kwargs, "specialties", index)
    names = (
        [s for s in listed[: triage_role.MAX_SPECIALTIES] if isinstance(s, str) and s.strip()]
        if isinstance(listed, (list, tuple))
        else []
    )
    gold = triage_role.canonical_specialty(column(kwargs, "gold_specialty", index), names) if names else None
    if gold is None:
        return False
    try:
        parsed = triage_role.parse_triage(text[:MAX_TEXT_CHARS], names, fallback=names[0])
    except Exception:  # parse_triage is meant never to raise; a reward must not depend on it
        logger.warning("parse_triage raised; scoring the triage reply as wrong", exc_info=True)
        return False
    return parsed["ok"] and parsed["specialty"] == gold


def triage_correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the specialty the reply names is the row's `gold_specialty`, else 0.0 (the paper's)."""
    return [1.0 if _triage_hit(own_text(c, kwargs, i), kwargs, i) else 0.0 for i, c in enumerate(completions)]


def well_formed_triage_correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """`triage_correctness_reward`, but 0.0 for a reply that is not well formed (`is_well_formed`)."""
    rewards = []
    for i, completion in enumerate(completions):
        text = own_text(completion, kwargs, i)
        rewards.append(1.0 if is_well_formed(text) and _triage_hit(text, kwargs, i) else 0.0)
    return rewards
