"""Citations: which of the evidence items an answer was shown it says it rests on, resolved to where they came from.

Every agent that answers from evidence sees it as a numbered list (`evidence_items` gives the same numbers as the
renderers: `extractor.render_triplets`, `respondent.render_snippets`, `reasoner.render_documents` numbered across
a Med-R³ transcript, `attending.render_opinions`). Its reasoning cites an item by that number: `[2]`, `[1, 3]`,
"evidence 2", "triplet #3", "document 4", "specialists 1 and 3"; or by the snippet id the line shows in brackets
(`[kb-002@0-388]`). `cite` resolves each citation to the item as shown and its snippet's provenance (document id,
title, source, character offsets). A number or id that names nothing shown is kept, flagged `shown=False`, and
never resolved: a citation of evidence the model never saw is the model's invention, and a reader must see that.

One parser (`cited_numbers`, `citation_keys`) serves the graphs, the eval report and the evidence-use reward
(`training.rewards.answers`). Linear in the reasoning's length: literal-led patterns with bounded repeats, at most
`MAX_CITATIONS` kept, on the first `MAX_CITED_CHARS` characters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from typing_extensions import TypedDict  # pydantic (Studio's schemas) rejects typing.TypedDict on Python < 3.12

EvidenceKind = Literal["triplet", "snippet", "document", "opinion"]

MAX_CITATIONS = 32  # distinct items one answer may cite; more are not read
MAX_CITED_CHARS = 20_000  # the reasoning is read up to here (what `Answer.reasoning` keeps)
MAX_SHOWN_CHARS = 300  # what a citation keeps of the item's text
MAX_BRACKET_CHARS = 200  # a bracket's content is read up to here (a snippet id is at most 200 characters)

# `[2]`, `[1, 3]`, `[1; 2]` and `[kb-002@0-388]`: a bracket and what it holds, up to the next bracket or line end.
BRACKETED = re.compile(rf"\[([^\[\]\n]{{1,{MAX_BRACKET_CHARS}}}+)\]")
NUMBER_LIST = re.compile(r"\s*+(\d{1,3})\s*+(?:[,;]\s*+(\d{1,3})\s*+){0,15}")
ONE_NUMBER = re.compile(r"\d{1,3}")
# "evidence 2", "triplets #3 and 4", "document no. 1", "specialists 1 and 3": a word that names the evidence list,
# then numbers. A model numbering its own thoughts ("Point 1:", "Step 2") cites nothing.
NAMED_NUMBERS = re.compile(
    r"\b(?:evidence|triplets?|facts?|documents?|snippets?|sources?|specialists?|opinions?)\s{0,3}"
    r"(?:#|no\.?|number)?\s{0,3}(\d{1,3}(?:\s{0,3}(?:,|and|&)\s{0,3}\d{1,3}){0,7})\b",
    re.IGNORECASE,
)


class EvidenceItem(TypedDict):
    """One numbered item of the evidence an agent was shown, with its snippet's provenance (None where the item
    has none: a specialist's opinion is model output, not a document)."""

    number: int
    kind: EvidenceKind | None
    text: str
    snippet_id: str | None
    doc_id: str | None
    title: str | None
    source: str | None
    start: int | None
    end: int | None


class Citation(EvidenceItem):
    """A cited item: `shown` False when its number or id names nothing the agent was shown (then only `number`,
    or `snippet_id` for an id, says what was cited, and the rest is None)."""

    shown: bool


def _clipped(text: Any) -> str:
    flat = " ".join(str(text or "")[: MAX_SHOWN_CHARS * 4].split())
    return flat if len(flat) <= MAX_SHOWN_CHARS else flat[:MAX_SHOWN_CHARS] + " …"


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def snippet_item(
    number: int, snippet: Mapping[str, Any], kind: EvidenceKind = "snippet", text: Any = None
) -> EvidenceItem:
    """Item `number`: a retrieved snippet (or what was shown of it: `text`, e.g. a triplet written from it)."""
    snippet_id = str(snippet.get("id") or "") or None
    return EvidenceItem(
        number=number,
        kind=kind,
        text=_clipped(snippet.get("text") if text is None else text),
        snippet_id=snippet_id,
        doc_id=str(snippet.get("doc_id") or "") or (snippet_id.rsplit("@", 1)[0] if snippet_id else None),
        title=_clipped(snippet.get("title")) or None,
        source=str(snippet.get("source") or "") or None,
        start=_int_or_none(snippet.get("start")),
        end=_int_or_none(snippet.get("end")),
    )


def snippet_items(
    snippets: Sequence[Mapping[str, Any]], first: int = 1, kind: EvidenceKind = "snippet"
) -> list[EvidenceItem]:
    """Snippets numbered from `first`, as `render_snippets` (from 1) and `render_documents` (from `first`) show
    them."""
    return [snippet_item(first + i, s, kind) for i, s in enumerate(snippets)]


def triplet_items(triplets: Sequence[Mapping[str, Any]], snippets: Iterable[Mapping[str, Any]]) -> list[EvidenceItem]:
    """Triplets numbered as `render_triplets` shows them, each with the provenance of the snippet it came from."""
    by_id = {str(s.get("id")): s for s in snippets}
    items = []
    for number, triplet in enumerate(triplets, 1):
        text = " — ".join(str(triplet.get(name) or "") for name in ("condition", "relation", "conclusion"))
        sid = str(triplet.get("snippet_id") or "")
        items.append(snippet_item(number, by_id.get(sid, {"id": sid}), "triplet", text))
    return items


def opinion_items(opinions: Sequence[Mapping[str, Any]]) -> list[EvidenceItem]:
    """Specialists' opinions numbered by specialist, as `attending.render_opinions` shows them."""
    return [
        EvidenceItem(
            number=int(o["specialist"]),
            kind="opinion",
            text=_clipped(f"answer {o.get('answer')} — {o.get('reasoning') or ''}"),
            snippet_id=None,
            doc_id=None,
            title=_clipped(f"Specialist {o['specialist']} ({o.get('specialty')})"),
            source=str(o.get("model") or "") or None,
            start=None,
            end=None,
        )
        for o in opinions
    ]


def cited_numbers(reasoning: str) -> list[int]:
    """The numbers `reasoning` cites (bracketed or after a word naming the evidence), in order, each once, at most
    MAX_CITATIONS."""
    return [key for key in citation_keys(reasoning) if isinstance(key, int)]


def citation_keys(reasoning: str) -> list[int | str]:
    """What `reasoning` cites, in order of first mention, each once, at most MAX_CITATIONS: numbers, and the text
    of brackets that hold no number list (a snippet id, to be matched against what was shown)."""
    text = (reasoning or "")[:MAX_CITED_CHARS]
    found: list[tuple[int, int | str]] = []  # (position, key)
    for match in BRACKETED.finditer(text):
        inside = match.group(1)
        numbers = NUMBER_LIST.fullmatch(inside)
        if numbers:
            found.extend((match.start(), int(n)) for n in ONE_NUMBER.findall(inside))
        else:
            found.append((match.start(), inside.strip()))
    for match in NAMED_NUMBERS.finditer(text):
        found.extend((match.start(), int(n)) for n in ONE_NUMBER.findall(match.group(1)))
    keys: dict[int | str, None] = {}
    for _, key in sorted(found, key=lambda pair: pair[0]):
        if key != "" and key != 0:
            keys.setdefault(key)
        if len(keys) >= MAX_CITATIONS:
            break
    return list(keys)


def cite(reasoning: str, shown: Sequence[EvidenceItem]) -> list[Citation]:
    """The citations of `reasoning`, each resolved to the item shown under its number (or snippet id), or flagged
    not shown. A bracket holding neither a number nor a shown snippet id (`[sic]`, `[note]`) is not a citation."""
    by_number = {item["number"]: item for item in shown}
    by_snippet = {}
    for item in shown:
        if item["snippet_id"]:
            by_snippet.setdefault(item["snippet_id"].casefold(), item)
    citations: dict[int | str, Citation] = {}
    for key in citation_keys(reasoning):
        item = by_number.get(key) if isinstance(key, int) else by_snippet.get(key.casefold())
        if item is not None:
            citations.setdefault(item["number"], Citation(**item, shown=True))
        elif isinstance(key, int):
            citations.setdefault(key, unshown(number=key))
        elif SNIPPET_ID_SHAPE.fullmatch(key):
            citations.setdefault(key, unshown(snippet_id=key))
    return list(citations.values())


# What a bracketed snippet id looks like (`doc@start-end`): a bracket of words that is not one is not a citation.
SNIPPET_ID_SHAPE = re.compile(r"[^\s@]{1,150}+@\d{1,9}-\d{1,9}(?:~\d{1,4})?")


def unshown(number: int | None = None, snippet_id: str | None = None) -> Citation:
    return Citation(
        number=number if number is not None else 0,
        kind=None,
        text="",
        snippet_id=snippet_id,
        doc_id=None,
        title=None,
        source=None,
        start=None,
        end=None,
        shown=False,
    )


def valid_citations(citations: Iterable[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    return [c for c in citations or () if c.get("shown")]


def render_citations(citations: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Lines for a reader: each cited item with its provenance; one not shown, flagged."""
    lines = []
    for c in citations or ():
        if not c.get("shown"):
            what = f"[{c['snippet_id']}]" if c.get("snippet_id") else f"[{c.get('number')}]"
            lines.append(f"  {what} NOT SHOWN to the model: no such evidence item (the citation is invented)")
            continue
        where = c.get("doc_id") or "-"
        span = f" chars {c['start']}-{c['end']}" if c.get("start") is not None and c.get("end") is not None else ""
        origin = ", ".join(p for p in (f"doc {where}{span}", c.get("source"), repr(c.get("title") or "")) if p)
        lines.append(f"  [{c['number']}] {c['kind']}: {c['text']}")
        lines.append(f"       from {origin}")
    return lines
