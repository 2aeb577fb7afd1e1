"""The triage policy's rewards (MMedAgent-RL): does the reply name the row's gold specialty, among the
specialties the row lists, and is it a triage at all (well formed, naming one of them). The registry
(`training.rewards.REWARDS`) names them `triage_correctness`, `triage_correctness_ungated` and `triage_format`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ermedrag.agents import triage as triage_role
from ermedrag.training.rewards.answers import is_well_formed
from ermedrag.training.rewards.text import MAX_TEXT_CHARS, column, own_text

logger = logging.getLogger(__name__)


def _listed(kwargs: Mapping[str, Any], index: int) -> list[str]:
    """The specialties the row offers (its `specialties`, bounded; blanks and non-text dropped)."""
    listed = column(kwargs, "specialties", index)
    if not isinstance(listed, (list, tuple)):
        return []
    return [s for s in listed[: triage_role.MAX_SPECIALTIES] if isinstance(s, str) and s.strip()]


def _named_specialty(text: str, names: list[str]) -> str | None:
    """The listed specialty the reply's answer names (`agents.triage.parse_triage`), else None."""
    if not names:
        return None
    try:
        parsed = triage_role.parse_triage(text[:MAX_TEXT_CHARS], names, fallback=names[0])
    except Exception:  # parse_triage is meant never to raise; a reward must not depend on it
        logger.warning("parse_triage raised; scoring the triage reply as naming none", exc_info=True)
        return None
    return parsed["specialty"] if parsed["ok"] else None


def _triage_hit(text: str, kwargs: Mapping[str, Any], index: int) -> bool:
    """The reply names the row's `gold_specialty` among the row's `specialties`."""
    names = _listed(kwargs, index)
    gold = triage_role.canonical_specialty(column(kwargs, "gold_specialty", index), names) if names else None
    return gold is not None and _named_specialty(text, names) == gold


def triage_correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the specialty the reply names is the row's `gold_specialty`, else 0.0 (the paper's)."""
    return [1.0 if _triage_hit(own_text(c, kwargs, i), kwargs, i) else 0.0 for i, c in enumerate(completions)]


def triage_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 for a well-formed reply (`is_well_formed`) whose answer names one of the row's `specialties`, else 0.0.
    The tag structure alone is not a triage: rewarded for it, the offline 270M model learned to copy the worked
    example's specialty, which no row lists (48 of 48 held-out replies, accuracy 0; benches/README.md)."""
    rewards = []
    for i, completion in enumerate(completions):
        text = own_text(completion, kwargs, i)
        named = is_well_formed(text) and _named_specialty(text, _listed(kwargs, i)) is not None
        rewards.append(1.0 if named else 0.0)
    return rewards


def well_formed_triage_correctness_reward(completions: list, **kwargs: Any) -> list[float]:
    """`triage_correctness_reward`, but 0.0 for a reply that is not well formed (`is_well_formed`)."""
    rewards = []
    for i, completion in enumerate(completions):
        text = own_text(completion, kwargs, i)
        rewards.append(1.0 if is_well_formed(text) and _triage_hit(text, kwargs, i) else 0.0)
    return rewards
