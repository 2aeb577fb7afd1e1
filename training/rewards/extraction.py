"""The extractor's reward for ranking alternative extractions into DPO pairs (not a GRPO reward: it scores one
extraction against its snippet and returns named components; `training.export` uses it).

Every function here reads model output, which is untrusted: none of them raises on any completion string,
whatever its content or length (configuration errors, such as a negative weight, do raise, at build time).
Parsing is the agent's own (`agents.extractor.parse_triplets`), so the reward sees a completion exactly as
the graph does.

`extractor_reward(completion, snippet, question=..., usefulness=...)` scores one
extraction and returns its named components (each in [0, 1]) and their weighted mean:

| component | default weight | value |
|---|---|---|
| `structure` | 0.3 | 1.0 strict JSON list with ≥1 complete triplet; 0.5 salvaged (truncated JSON, `a \\| b \\| c` lines); for a strict `[]`: 1.0 if the snippet shares no content token with the question, else 0.3; 0.0 unparseable or no usable triplet |
| `faithfulness` | 0.4 | share of the triplets' condition and conclusion content tokens found in the snippet, or `faithfulness_judge`; left out of `total` for an empty list (it makes no claim) |
| `conciseness` | 0.1 | 1.0 when the triplets' characters are ≤ 40% of the snippet's, linearly down to 0.0 at ≥ 100%; left out for an empty list |
| `usefulness` | 0.2 | given by the caller (did the respondent reach gold with this extraction); None: left out, weights renormalised |

Content tokens: lowercased alphanumeric runs, stop words removed, a light suffix-stripping stemmer
(`causes`, `caused`, `cause` → `caus`). Relations are not counted in faithfulness: the prompt asks for a
normalised connective ("causes", "treats", …) that need not be in the snippet's words.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ermedrag.agents.extractor import FIELDS, parse_triplets
from ermedrag.training.rewards.text import MAX_TEXT_CHARS, completion_text, content_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtractorRewardWeights:
    """Weights of the extractor reward's components; the total is their weighted mean."""

    structure: float = field(
        default=0.3,
        metadata={
            "help": "Weight of `structure`: a strict JSON triplet list "
            "scores 1.0, a salvaged one 0.5, `[]` 1.0 on an irrelevant snippet (0.3 else)."
        },
    )
    faithfulness: float = field(
        default=0.4,
        metadata={
            "help": "Weight of `faithfulness`: share of the "
            "triplets' content tokens found in the snippet, or the judge's score."
        },
    )
    conciseness: float = field(
        default=0.1,
        metadata={"help": "Weight of `conciseness`: 1.0 at ≤40% of the snippet's characters, 0.0 at ≥100%."},
    )
    usefulness: float = field(
        default=0.2,
        metadata={
            "help": "Weight of `usefulness`: whether the respondent "
            "reached gold with this extraction; left out (renormalised) when not given."
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"weight {f.name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class ExtractorReward:
    """One extraction's reward: components in [0, 1] (`usefulness` None when not given) and `total`, their
    mean weighted by `ExtractorRewardWeights` over the components present."""

    structure: float
    faithfulness: float
    conciseness: float
    usefulness: float | None
    total: float

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


CONCISE_RATIO = 0.4  # triplet characters / snippet characters at or below which conciseness is 1.0
VERBOSE_RATIO = 1.0  # … at or above which it is 0.0
EMPTY_ON_RELEVANT = 0.3


def extractor_reward(
    completion: str,
    snippet: str,
    *,
    question: str = "",
    usefulness: float | None = None,
    weights: ExtractorRewardWeights | None = None,
    faithfulness_judge: Callable[[str, str], float] | None = None,
) -> ExtractorReward:
    """Score one extractor completion for `snippet` (see the module docstring for each component).

    `question` decides whether an empty list was right (no content token shared with the snippet) — pass
    it, or `[]` always counts as right. `faithfulness_judge(snippet, claim) -> [0, 1]`, when given, replaces
    token overlap: it is called once per triplet with the triplet as one sentence ("condition relation
    conclusion") and the scores are averaged — plug in an NLI model (premise=snippet, hypothesis=claim) or an
    LLM judge. A judge that raises or returns a non-number is logged and token overlap is used instead.
    """
    weights = weights or ExtractorRewardWeights()
    text = completion_text(completion)[:MAX_TEXT_CHARS]
    snippet = str(snippet or "")
    try:
        parsed = parse_triplets(text, "snippet")
    except Exception:  # parse_triplets is meant never to raise
        logger.warning("parse_triplets raised; scoring the extraction as unparseable", exc_info=True)
        parsed = {"triplets": [], "ok": False, "strict": False}
    triplets = [t for t in parsed.get("triplets") or [] if isinstance(t, dict)]

    structure = _structure(text, parsed, triplets, snippet, str(question or ""))
    faithfulness = _faithfulness(triplets, snippet, faithfulness_judge)
    conciseness = _conciseness(triplets, snippet)
    if usefulness is not None:
        try:
            usefulness = float(usefulness)
        except (TypeError, ValueError):
            usefulness = None
        usefulness = None if usefulness is None or math.isnan(usefulness) else min(1.0, max(0.0, usefulness))

    parts = [(weights.structure, structure)]
    if triplets:  # faithfulness and conciseness judge claims; an empty list makes none (else DPO learns
        # to prefer extracting irrelevant facts over a correct `[]`)
        parts += [(weights.faithfulness, faithfulness), (weights.conciseness, conciseness)]
    if usefulness is not None:
        parts.append((weights.usefulness, usefulness))
    weight_sum = sum(w for w, _ in parts)
    total = sum(w * v for w, v in parts) / weight_sum if weight_sum > 0 else 0.0
    return ExtractorReward(
        structure=structure, faithfulness=faithfulness, conciseness=conciseness, usefulness=usefulness, total=total
    )


_FIELD_NAME = re.compile(r'"(condition|relation|conclusion)"', re.IGNORECASE)


def _structure(text: str, parsed: dict[str, Any], triplets: list[dict[str, Any]], snippet: str, question: str) -> float:
    if not parsed.get("ok"):
        return 0.0
    if triplets:
        return 1.0 if parsed.get("strict") else 0.5
    if parsed.get("strict") and not _FIELD_NAME.search(text):  # a deliberate `[]`, not a list of broken items
        relevant = set(content_tokens(snippet)) & set(content_tokens(question))
        return EMPTY_ON_RELEVANT if relevant else 1.0
    return 0.0


def _faithfulness(triplets: list[dict[str, Any]], snippet: str, judge: Callable[[str, str], float] | None) -> float:
    if not triplets:
        return 0.0
    if judge is not None:
        try:
            claims = [" ".join(str(t.get(name) or "") for name in FIELDS) for t in triplets]
            scores = [float(judge(snippet, claim)) for claim in claims]
            if all(math.isfinite(s) for s in scores):
                return min(1.0, max(0.0, sum(scores) / len(scores)))
            logger.warning("faithfulness judge returned a non-finite score; using token overlap")
        except Exception:
            logger.warning("faithfulness judge failed; using token overlap", exc_info=True)
    claimed = [tok for t in triplets for name in ("condition", "conclusion") for tok in content_tokens(t.get(name))]
    if not claimed:
        return 0.0
    source = set(content_tokens(snippet))
    return sum(tok in source for tok in claimed) / len(claimed)


def _conciseness(triplets: list[dict[str, Any]], snippet: str) -> float:
    chars = sum(len(str(t.get(name) or "")) for t in triplets for name in FIELDS)
    if not chars:
        return 1.0
    if not snippet:
        return 0.0
    ratio = chars / len(snippet)
    if ratio <= CONCISE_RATIO:
        return 1.0
    return max(0.0, (VERBOSE_RATIO - ratio) / (VERBOSE_RATIO - CONCISE_RATIO))
