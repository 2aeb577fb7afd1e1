"""The bench's inputs from the shared data: passages, cached passage vectors, the BioASQ qrels split into
tuning and held-out questions, and the long documents rebuilt from passages of the same source document."""

from __future__ import annotations

import gzip
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ermedrag.tools.retrieval.corpus import Document

HELD_OUT = 1000  # questions reported; the rest of the seeded order is the tuning split
DOCUMENT_JOIN = "\n\n"


@dataclass(frozen=True)
class SharedData:
    root: Path

    @property
    def corpora(self) -> list[Path]:
        return sorted((self.root / "corpora").glob("*.jsonl.gz"))

    @property
    def qrels(self) -> Path:
        return self.root / "retrieval" / "bioasq_qrels.jsonl"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def check(self) -> None:
        missing = [
            str(p)
            for p in (self.qrels, self.cache / "minilm_passages_f16.npy", self.cache / "minilm_passages_ids.txt.gz")
            if not p.exists()
        ]
        if not self.corpora or missing:
            sys.exit(
                f"shared data not found under {self.root} (missing: {missing or ['corpora/*.jsonl.gz']}); "
                "pass --data or set ERMEDRAG_SHARED_DATA"
            )


def load_passages(data: SharedData) -> list[Document]:
    """All passages via tools.corpus.read_documents (a repeated id with other text becomes `id~2`, ...)."""
    from ermedrag.tools.retrieval.corpus import read_documents

    return read_documents(data.corpora)


def unique_ids(ids: list[str]) -> list[str]:
    """The renaming read_documents applies, for the cached vector ids."""
    seen: Counter[str] = Counter()
    out = []
    for doc_id in ids:
        seen[doc_id] += 1
        out.append(doc_id if seen[doc_id] == 1 else f"{doc_id}~{seen[doc_id]}")
    return out


def passage_vectors(data: SharedData, passages: list[Document]) -> dict[str, np.ndarray]:
    """Passage id -> cached all-MiniLM-L6-v2 vector of f"{title}. {text}" (what build_index embeds)."""
    vectors = np.load(data.cache / "minilm_passages_f16.npy", mmap_mode="r")
    with gzip.open(data.cache / "minilm_passages_ids.txt.gz", "rt") as handle:
        ids = unique_ids([line.strip() for line in handle if line.strip()])
    if ids != [p.id for p in passages] or len(ids) != vectors.shape[0]:
        sys.exit(f"{data.cache}: cached vector ids do not match the corpora (order or content changed): recompute them")
    vectors = np.asarray(vectors, dtype=np.float32)
    return {p.id: vectors[i] for i, p in enumerate(passages)}


def split_qrels(data: SharedData, seed: int, held_out: int = HELD_OUT) -> tuple[list[dict], list[dict]]:
    """(tuning, held_out): one seeded order; the first `held_out` questions are reported, the rest tune."""
    qrels = [json.loads(line) for line in data.qrels.read_text().splitlines() if line.strip()]
    order = random.Random(seed).sample(range(len(qrels)), len(qrels))
    return [qrels[i] for i in order[held_out:]], [qrels[i] for i in order[:held_out]]


# ---------------------------------------------------------------- long documents


def source_document(passage: Document) -> str:
    """The source document a passage came from: its PubMed article, OpenStax module or MedQuAD document."""
    if "pmid" in passage.meta:
        return f"pmid-{passage.meta['pmid']}"
    if passage.id.startswith("openstax-"):
        return passage.id.rsplit("/", 1)[0]
    if passage.id.startswith("medquad-"):
        return passage.id.split("~")[0].rsplit("-", 1)[0]
    return passage.id


@dataclass(frozen=True)
class Span:
    doc_id: str
    start: int
    end: int


def long_documents(passages: list[Document]) -> tuple[list[Document], dict[str, Span]]:
    """Documents rebuilt by joining passages of the same source document in corpus order, and where each
    passage now lies in its document (to score snippets against gold passages by character overlap)."""
    groups: dict[str, list[Document]] = {}
    for passage in passages:
        groups.setdefault(source_document(passage), []).append(passage)
    documents, spans = [], {}
    for doc_id, members in groups.items():
        cursor, pieces = 0, []
        for passage in members:
            spans[passage.id] = Span(doc_id, cursor, cursor + len(passage.text))
            pieces.append(passage.text)
            cursor += len(passage.text) + len(DOCUMENT_JOIN)
        first = members[0]
        title = first.title if len(members) == 1 else first.title.split(" (")[0].split(":")[0]
        documents.append(Document(id=doc_id, text=DOCUMENT_JOIN.join(pieces), title=title, source=first.source))
    return documents, spans


def single_passage_vectors(
    documents: list[Document], spans: dict[str, Span], vectors: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Document id -> its passage's cached vector, for documents made of one passage (same title and text)."""
    members: dict[str, list[str]] = {}
    for passage_id, span in spans.items():
        members.setdefault(span.doc_id, []).append(passage_id)
    return {d.id: vectors[members[d.id][0]] for d in documents if len(members[d.id]) == 1}
