"""Documents whose id the index already holds: which of them a build keeps unchanged, replaces, renames (id~N), skips or refuses (`--on-duplicate-id`), planned before anything is written (`tools.retrieval.index.build_index`)."""

from __future__ import annotations
import re
from dataclasses import dataclass, field, replace
from ermedrag.tools.retrieval.corpus import EXAMPLES_KEPT, Chunk, Document, id_key, shown_id


RENAMED = re.compile(r"(.*)~\d+", re.S)


OUTCOMES = ("new", "unchanged", "replaced", "renamed", "skipped")


@dataclass(frozen=True)
class StoredChunk:
    """A committed chunk as the vector store holds it; `text` None when the store lost it."""

    id: str
    doc_id: str
    start: int
    end: int
    title: str = ""
    text: str | None = None
    source: str = ""


@dataclass
class IdPlan:
    """What a build does with each document: the chunks it indexes (final ids: new ones, and the committed ones
    of documents already there), the committed chunks it removes, the counts, and the refused documents."""

    chunks: list[Chunk] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    examples: dict[str, list[str]] = field(default_factory=lambda: {outcome: [] for outcome in OUTCOMES[1:]})
    refused: list[tuple[Document, str]] = field(default_factory=list)  # and where the indexed one came from
    other_source: int = 0  # replaced documents that had been indexed from another source

    def add(self, outcome: str, doc: Document, chunks: list[Chunk], shown: str = "", note: str = "") -> None:
        self.counts[outcome] += 1
        self.chunks.extend(chunks)
        if outcome != "new" and len(self.examples[outcome]) < EXAMPLES_KEPT:
            self.examples[outcome].append(shown_id(doc, shown) + note)


def settle_ids(
    documents: list[Document],
    chunks: dict[str, list[Chunk]],
    held: dict[str, dict[str, list[str]]],
    stored: dict[str, StoredChunk],
    committed: set[str],
    policy: str,
) -> IdPlan:
    """Each document against the index (`held_ids`, their `stored` chunks, every `committed` chunk id), under
    `policy` (see `build_index`). Nothing is written here."""
    plan = IdPlan()
    families: dict[str, list[str]] = {}  # id key -> held keys of it and its copies id~N (rename)
    for key in held:
        families.setdefault(key, []).append(key)
        if found := RENAMED.fullmatch(key):
            families.setdefault(found[1], []).append(key)
    taken = {id_key(doc.id) for doc in documents}
    for doc in documents:
        new, forms = chunks[doc.id], held.get(id_key(doc.id), {})
        same = _as_stored(forms, new, stored)
        if same is None and policy == "rename":  # the same text kept as a copy by an earlier run
            family = families.get(id_key(doc.renamed_from or doc.id), [])
            same = next((found for key in family if (found := _as_stored(held[key], new, stored))), None)
        if same is not None:
            plan.add("unchanged", doc, same)
        elif not forms:
            plan.add("new", doc, new)
        elif policy == "error":
            plan.refused.append(
                (doc, ", ".join(sorted({stored[c].source for cs in forms.values() for c in cs} - {""})))
            )
        elif policy == "skip":
            plan.add("skipped", doc, [])
        elif policy == "rename":
            base, n = doc.renamed_from or doc.id, 2
            while id_key(f"{base}~{n}") in taken or id_key(f"{base}~{n}") in held:
                n += 1
            name = f"{base}~{n}"
            taken.add(id_key(name))
            plan.add("renamed", doc, [replace(c, id=f"{name}#{c.start}-{c.end}", doc_id=name) for c in new], name)
        else:
            _replace(plan, doc, new, [stored[cid] for cids in forms.values() for cid in cids], committed)
    plan.chunks = list({c.id: c for c in plan.chunks}.values())  # two ids may meet one indexed copy (rename)
    return plan


def _as_stored(forms: dict[str, list[str]], new: list[Chunk], stored: dict[str, StoredChunk]) -> list[Chunk] | None:
    """`new` under the committed ids, when the index holds exactly these chunks (offsets, title, text) under one
    id; else None. A chunk the store lost is taken to be the same as the new one on its offsets."""
    if len(forms) != 1:
        return None
    ((doc_id, cids),) = forms.items()
    old = {(stored[cid].start, stored[cid].end): stored[cid] for cid in cids}
    if len(old) != len(cids) or set(old) != {(c.start, c.end) for c in new}:
        return None
    same = []
    for c in new:
        s = old[(c.start, c.end)]
        if s.text is not None and (s.title, s.text) != (c.title, c.text):
            return None
        same.append(replace(c, id=s.id, doc_id=doc_id))
    return same


def _replace(plan: IdPlan, doc: Document, new: list[Chunk], old: list[StoredChunk], committed: set[str]) -> None:
    """The new version's chunks: an unchanged chunk keeps its committed id; another on an id that is committed
    (the old version's, same offsets) gets the first free `id~N`. The old chunks not kept are removed."""
    spans = {(s.doc_id, s.start, s.end): s for s in old}
    kept: set[str] = set()
    chunks = []
    for c in new:
        s = spans.get((c.doc_id, c.start, c.end))
        if s is not None and (s.text is None or (s.title, s.text) == (c.title, c.text)):
            kept.add(s.id)
            chunks.append(replace(c, id=s.id))
            continue
        cid, n = c.id, 1
        while cid in committed:
            n += 1
            cid = f"{c.id}~{n}"
        chunks.append(replace(c, id=cid))
    plan.removed.extend(s.id for s in old if s.id not in kept)
    sources = sorted({s.source for s in old} - {""})
    other = bool(sources) and doc.source not in sources
    plan.other_source += other
    plan.add("replaced", doc, chunks, note=f" (indexed from {', '.join(sources)})" if other else "")
