"""Extractor: one evidence snippet → zero or more condition–relation–conclusion triplets.

The triplets are what the respondent reads instead of raw text: short, structured, tied to the snippet
they came from. The output format is a JSON list; `parse_triplets` also accepts `condition | relation |
conclusion` lines, and never raises.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypedDict

from ermedrag.agents.base import chat_messages, clip

SYSTEM_PROMPT = """You extract medical evidence. Read the snippet and write the facts in it that help answer the question, as a JSON list of triplets:
[{"condition": "<patient group, disease or situation>", "relation": "<how they connect: causes, treats, indicates, increases, ...>", "conclusion": "<the outcome or fact>"}]
Use only what the snippet says. Keep each field short. If the snippet says nothing useful, write []."""

USER_TEMPLATE = """Question: {question}
Snippet: {snippet}
Triplets:"""

EXAMPLE = (
    USER_TEMPLATE.format(
        question="Which vitamin deficiency causes rickets?",
        snippet="Rickets in children is caused by vitamin D deficiency, which impairs bone mineralisation; "
        "sunlight exposure and supplements prevent it.",
    ),
    '[{"condition": "vitamin D deficiency in children", "relation": "causes", "conclusion": "rickets"}]',
)

STOP = ["}]"]  # the end of a non-empty JSON list: saves generating past it
MAX_TRIPLETS = 8
NO_EVIDENCE = "(no evidence found)"
MAX_FIELD_CHARS = 400
MAX_PARSE_CHARS = 20_000
MAX_JSON_ATTEMPTS = 200  # bounds the work on adversarial text full of brackets
FIELDS = ("condition", "relation", "conclusion")


class Triplet(TypedDict):
    condition: str
    relation: str
    conclusion: str
    snippet_id: str


class Extraction(TypedDict):
    """Parsed extractor output.

    `ok`: something triplet-shaped was found (else `error` says why); `strict`: it was a complete JSON list,
    not salvaged from truncated JSON or `a | b | c` lines.
    """

    snippet_id: str
    triplets: list[Triplet]
    ok: bool
    strict: bool
    error: str | None


def build_messages(question: str, snippet_text: str) -> list:
    user = USER_TEMPLATE.format(question=clip(question), snippet=clip(snippet_text))
    return chat_messages(SYSTEM_PROMPT, user, EXAMPLE)


def parse_triplets(completion: str, snippet_id: str) -> Extraction:
    text = (completion or "")[:MAX_PARSE_CHARS]
    raw, strict = _first_json_triplets(text)
    if raw is None:
        raw = _salvaged_fields(text) or _pipe_lines(text)
    if raw is None:
        error = "empty completion" if not text.strip() else "no JSON triplet list or 'a | b | c' lines"
        return Extraction(snippet_id=snippet_id, triplets=[], ok=False, strict=False, error=error)
    triplets = [t for t in (_triplet(item, snippet_id) for item in raw[:MAX_TRIPLETS]) if t]
    return Extraction(snippet_id=snippet_id, triplets=triplets, ok=True, strict=strict, error=None)


def _first_json_triplets(text: str) -> tuple[list[Any] | None, bool]:
    """The first JSON list (or lone object) in the text whose items look like triplets ([] counts), and
    whether it was a whole list (a lone object is what is left of a list cut short)."""
    decoder = json.JSONDecoder()
    for attempt, match in enumerate(re.finditer(r"[\[{]", text)):
        if attempt >= MAX_JSON_ATTEMPTS:
            break
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except (ValueError, RecursionError):
            continue
        items = value if isinstance(value, list) else [value]
        if all(isinstance(item, dict) for item in items) and (
            not items or any(_lower_keys(item).keys() & set(FIELDS) for item in items)
        ):
            return items, isinstance(value, list)
    return None, False


FIELD_VALUE = re.compile(r'"(condition|relation|conclusion)"\s*:\s*"((?:[^"\\]|\\.){0,400})"', re.IGNORECASE)


def _salvaged_fields(text: str) -> list[dict[str, str]] | None:
    """Triplets from `"condition": "…"` pairs of JSON cut off by the token budget, in order of appearance."""
    rows: list[dict[str, str]] = []
    for match in FIELD_VALUE.finditer(text):
        name = match.group(1).lower()
        if not rows or name in rows[-1]:
            rows.append({})
        rows[-1][name] = match.group(2).replace('\\"', '"')
    rows = [row for row in rows if "condition" in row and "conclusion" in row]
    return rows or None


def _pipe_lines(text: str) -> list[dict[str, str]] | None:
    rows = []
    for line in text.splitlines():
        parts = [p.strip(" -*•\t") for p in line.split("|")]
        if len(parts) == 3 and all(parts):
            rows.append(dict(zip(FIELDS, parts)))
    return rows or None


def _lower_keys(item: dict[Any, Any]) -> dict[str, Any]:
    return {str(k).strip().lower(): v for k, v in item.items()}


def _triplet(item: dict[Any, Any], snippet_id: str) -> Triplet | None:
    fields = _lower_keys(item)
    values = [" ".join(str(fields.get(name) or "").split())[:MAX_FIELD_CHARS] for name in FIELDS]
    if not values[0] or not values[2]:
        return None
    return Triplet(condition=values[0], relation=values[1], conclusion=values[2], snippet_id=snippet_id)


def render_triplets(triplets: list[Triplet]) -> str:
    """The evidence block the respondent reads: one numbered line per triplet, with its snippet id."""
    if not triplets:
        return NO_EVIDENCE
    return "\n".join(
        f"{i}. [{t['snippet_id']}] {t['condition']} — {t['relation']} — {t['conclusion']}"
        for i, t in enumerate(triplets, 1)
    )
