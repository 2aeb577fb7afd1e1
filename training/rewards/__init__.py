"""The one registry of GRPO rewards (config name → reward function) and `resolve_rewards`, which turns named
weights into the reward functions and weights a `GRPOTrainer` takes.

| name | reward (curve `rewards/<name>/mean`) | scores | module |
|---|---|---|---|
| correctness | `well_formed_correctness_reward` | the answer equals `gold`, in a well-formed reply | `answers` |
| format | `format_reward` | one `<think>` then one `<answer>`, nothing else | `answers` |
| length | `length_penalty` | characters beyond two thirds of `max_chars` (≤ 0) | `answers` |
| evidence | `evidence_use_reward` | a correct answer grounded in a triplet the reasoning restates | `answers` |
| retrieval_hit | `retrieval_hit_reward` | share of the gold evidence the searches retrieved | `search` |
| search_format | `search_format_reward` | share of well-formed searches | `search` |
| penalties | `med_r3_penalties` | bad search, forged document, overlong, long thinking (≤ 0) | `search` |
| correctness_ungated | `correctness_reward` | the answer equals `gold`, whatever the format (MMedAgent's paper mode) | `answers` |
| triage_correctness | `well_formed_triage_correctness_reward` | the specialty named is `gold_specialty`, in a well-formed reply | `triage` |
| triage_correctness_ungated | `triage_correctness_reward` | the specialty named is `gold_specialty` (the paper's) | `triage` |
| triage_format | `triage_format_reward` | a well-formed reply whose answer names one of the listed specialties | `triage` |

Weights are named everywhere: `GRPOTrainingConfig.rewards` (the respondent: `RESPONDENT_REWARDS` when
unset) and each Med-R³ stage's `stage_overrides.N.rewards` (on top of `training.med_r3.STAGES`), e.g.
`rewards: {correctness: 1.0, format: 0.5, length: 0.2, evidence: 0.2}`. Given weights update the defaults: a
name not among them adds that reward, weight 0 drops one. A reward with parameters is a frozen dataclass
(`LengthPenalty`, `MedR3Penalties`); the trainer's `reward_settings()` (for Med-R³: `max_chars`,
`max_think_chars`, `max_searches`) set the fields of the same names. Every reward here is picklable.

`reward_code_sha256` fingerprints the code behind these rewards: a GRPO checkpoint records it, and a resume
under other reward code is refused (a reward's rule is code, not a setting).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ermedrag.training.rewards.answers import (
    correctness_reward,
    evidence_use_reward,
    format_reward,
    length_penalty,
    well_formed_correctness_reward,
)
from ermedrag.training.rewards.text import RewardFunc
from ermedrag.training.rewards.search import med_r3_penalties, retrieval_hit_reward, search_format_reward
from ermedrag.training.rewards.triage import (
    triage_correctness_reward,
    triage_format_reward,
    well_formed_triage_correctness_reward,
)

# The modules that define rewards (this registry's, the extractor's, MMedAgent's triage); with the parsers they
# call, they are what `reward_code_sha256` fingerprints.
REWARD_MODULES = (
    "ermedrag.training.rewards",
    *(f"ermedrag.training.rewards.{name}" for name in ("answers", "extraction", "search", "triage")),
)

REWARDS: dict[str, RewardFunc] = {
    "correctness": well_formed_correctness_reward,
    "correctness_ungated": correctness_reward,
    "format": format_reward,
    "length": length_penalty,
    "evidence": evidence_use_reward,
    "retrieval_hit": retrieval_hit_reward,
    "search_format": search_format_reward,
    "penalties": med_r3_penalties,
    "triage_correctness": well_formed_triage_correctness_reward,
    "triage_correctness_ungated": triage_correctness_reward,
    "triage_format": triage_format_reward,
}

RESPONDENT_REWARDS: dict[str, float] = {"correctness": 1.0, "format": 0.5, "length": 0.2, "evidence": 0.2}


@dataclass(frozen=True)
class WeightedReward:
    """One reward to train with: its config name, the function, its weight in the total reward."""

    name: str
    func: RewardFunc
    weight: float


def resolve_rewards(
    weights: Mapping[str, float] | None,
    defaults: Mapping[str, float],
    *,
    registry: Mapping[str, RewardFunc] = REWARDS,
    settings: Mapping[str, Any] | None = None,
    where: str = "rewards",
) -> list[WeightedReward]:
    """The rewards to train with: `defaults` updated by `weights` (name → weight; a new name adds that reward,
    weight 0 drops one), in that order, each built with the `settings` it has fields for.

    Raises ValueError (prefixed with `where`) for a name not in `registry` (listing the known ones), a weight
    that is not a finite number, or weights that are all 0."""
    merged = {**defaults, **(weights or {})}
    unknown = [name for name in merged if name not in registry]
    if unknown:
        raise ValueError(f"{where}: unknown reward(s) {unknown}; known: {sorted(registry)}")
    numbers = {name: _weight(w) for name, w in merged.items()}
    bad = {name: merged[name] for name, w in numbers.items() if w is None}
    if bad:
        raise ValueError(f"{where}: reward weights must be finite numbers, got {bad}")
    kept = [
        WeightedReward(name, _configured(registry[name], settings or {}), w) for name, w in numbers.items() if w != 0
    ]
    if not kept:
        raise ValueError(f"{where}: every reward weight is 0")
    return kept


def named_weights(rewards: list[WeightedReward]) -> dict[str, float]:
    """`{name: weight}` of resolved rewards, as run summaries record them."""
    return {reward.name: reward.weight for reward in rewards}


def _weight(value: Any) -> float | None:
    """A weight as a float (PyYAML reads `1e-1`, without a dot, as a string), or None when it is no number."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _configured(reward: RewardFunc, settings: Mapping[str, Any]) -> RewardFunc:
    """`reward` with the settings it has a field for (a reward with parameters is a dataclass)."""
    if not dataclasses.is_dataclass(reward):
        return reward
    own = {f.name for f in dataclasses.fields(reward)}
    chosen = {name: value for name, value in settings.items() if name in own}
    return dataclasses.replace(reward, **chosen) if chosen else reward


def reward_code_sha256() -> str:
    """A fingerprint of the rewards' rules: the code of `REWARD_MODULES` and of every ermedrag module they import,
    directly or not (the parsers that read a reply are part of its reward); docstrings and comments do not count,
    nor do package `__init__` files (a version bump is not a new rule)."""
    return code_sha256(reward_modules().values())


def reward_modules() -> dict[str, str]:
    """`REWARD_MODULES` and the ermedrag modules they import, recursively: name → source, in a stable order."""
    sources, pending = {}, list(REWARD_MODULES)
    while pending:
        name = pending.pop()
        if name in sources:
            continue
        sources[name] = Path(_module_file(name)).read_text(encoding="utf-8")
        pending.extend(_imported_modules(ast.parse(sources[name])))
    return dict(sorted(sources.items()))


def _imported_modules(tree: ast.Module) -> list[str]:
    """The ermedrag modules (not packages) an import statement anywhere in `tree` names."""
    candidates = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            candidates += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return [name for name in candidates if name.startswith("ermedrag.") and _is_module(name)]


def _is_module(name: str) -> bool:
    """A module file of the package (`from ermedrag.agents import reasoner` names one; `ermedrag.agents` does not)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None and not spec.origin.endswith("__init__.py")


def _module_file(name: str) -> str:
    return importlib.util.find_spec(name).origin


def code_sha256(sources: Iterable[str]) -> str:
    """A fingerprint of Python sources' syntax trees without docstrings: editing a comment, a docstring or the
    layout keeps it; any change to what runs (a statement, a constant, a name) changes it."""
    digest = hashlib.sha256()
    for source in sources:
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
                and _is_docstring(node.body[0])
            ):
                node.body = node.body[1:] or [ast.Pass()]
        digest.update(ast.dump(tree).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )
