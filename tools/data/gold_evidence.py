"""Gold evidence of benchmark questions: which corpus passages answer them.

PubMedQA question `pubmedqa-<pmid>` → the passages of its own abstract (corpus ids `pubmed-<pmid>-<i>`);
BioASQ → the `gold` passage ids of `retrieval/bioasq_qrels.jsonl`; other benchmarks have none. Training
(the Med-R³ retrieval reward) and evaluation (RAG quality) both read it from here.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from ermedrag.tools import settings
from ermedrag.tools.records.jsonl import read_records

QRELS_FILE = Path("retrieval") / "bioasq_qrels.jsonl"
PUBMEDQA_CORPUS = "pubmedqa_contexts.jsonl.gz"
PUBMEDQA_ID = re.compile(r"^pubmedqa-(\d+)$")
_COPY_SUFFIX = re.compile(r"~\d+$")  # tools.corpus renames a reused id with other text to `id~2`


def doc_id(snippet_id: Any) -> str:
    """The corpus passage id of a snippet id `"<doc_id>@<start>-<end>"` (an id without `@` is returned as is),
    without the `~N` suffix that indexing gives a reused id."""
    return _COPY_SUFFIX.sub("", str(snippet_id).rsplit("@", 1)[0].strip())


@dataclass(frozen=True)
class GoldEvidence:
    """The gold passages of one question: concrete `ids`, or a `prefix` rule whose full set is unknown.

    `doc in gold` tells whether a passage is gold; `reference_ids(retrieved)` gives the ids to score against;
    `complete` says whether those are the whole gold set (so recall is meaningful).
    """

    ids: frozenset[str] = frozenset()
    prefix: str | None = None

    def __contains__(self, doc: object) -> bool:
        return isinstance(doc, str) and (doc in self.ids or (self.prefix is not None and doc.startswith(self.prefix)))

    @property
    def complete(self) -> bool:
        return self.prefix is None

    def reference_ids(self, retrieved: Iterable[str] = ()) -> list[str]:
        """The concrete gold ids; for a prefix rule, the retrieved ids it matches (plus any known ids)."""
        ids = set(self.ids)
        if self.prefix is not None:
            ids.update(doc for doc in retrieved if doc.startswith(self.prefix))
        return sorted(ids)


def default_qrels_path() -> Path | None:
    """`$ERMEDRAG_SHARED_DATA/retrieval/bioasq_qrels.jsonl`, when that variable is set."""
    env = settings.read("ERMEDRAG_SHARED_DATA")
    return Path(env) / QRELS_FILE if env else None


@lru_cache(maxsize=4)
def load_qrels(path: str) -> dict[str, tuple[str, ...]]:
    """Question id → gold passage ids, from a qrels JSONL file (`{"id", "gold": [...]}` a line)."""
    qrels: dict[str, tuple[str, ...]] = {}
    for record in read_records(Path(path)):
        if "id" in record and isinstance(record.get("gold"), list):
            qrels[str(record["id"])] = tuple(str(g) for g in record["gold"])
    return qrels


@lru_cache(maxsize=4)
def pubmedqa_passages(corpus: str) -> dict[str, tuple[str, ...]]:
    """PMID → its passage ids, from `pubmedqa_contexts.jsonl.gz` (a file, or the corpora folder holding it)."""
    path = Path(corpus)
    if path.is_dir():
        path = path / PUBMEDQA_CORPUS
    if not path.is_file():
        raise FileNotFoundError(
            f"PubMedQA corpus not found: {path} (pass the corpora folder holding {PUBMEDQA_CORPUS})"
        )
    by_pmid: dict[str, list[str]] = defaultdict(list)
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            passage = str(record["id"])
            match = re.match(r"^pubmed-(\d+)-\d+$", passage)
            pmid = str(record.get("pmid") or (match.group(1) if match else ""))
            if pmid:
                by_pmid[pmid].append(passage)
    return {pmid: tuple(ids) for pmid, ids in by_pmid.items()}


def benchmark_family(benchmark: str) -> str | None:
    """'pubmedqa' or 'bioasq' for benchmarks with gold evidence (also file-named ones like 'pubmedqa_test')."""
    name = (benchmark or "").lower()
    for family in ("pubmedqa", "bioasq"):
        if name.startswith(family):
            return family
    return None


def gold_evidence(
    question_id: str,
    benchmark: str,
    qrels_path: str | os.PathLike[str] | None = None,
    corpus_dir: str | os.PathLike[str] | None = None,
) -> GoldEvidence | None:
    """The gold evidence of a question, or None when its benchmark (or the question) has none.

    PubMedQA: the prefix rule `pubmed-<pmid>-`, expanded into concrete ids when `corpus_dir` is given.
    BioASQ: the ids of `qrels_path` (default `default_qrels_path()`; FileNotFoundError when there is none).
    """
    family = benchmark_family(benchmark)
    if family == "pubmedqa":
        match = PUBMEDQA_ID.match(str(question_id))
        if not match:
            return None
        pmid = match.group(1)
        if corpus_dir is not None:
            return GoldEvidence(ids=frozenset(pubmedqa_passages(str(corpus_dir)).get(pmid, ())))
        return GoldEvidence(prefix=f"pubmed-{pmid}-")
    if family == "bioasq":
        path = Path(qrels_path) if qrels_path is not None else default_qrels_path()
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"BioASQ gold evidence needs the qrels file (retrieval/bioasq_qrels.jsonl): pass qrels_path "
                f"or set ERMEDRAG_SHARED_DATA (looked for {path})"
            )
        gold = load_qrels(str(path)).get(str(question_id))
        return GoldEvidence(ids=frozenset(gold)) if gold else None
    return None


def question_gold_evidence(
    question: Any, qrels: str | os.PathLike[str] | None = None, corpus_dir: str | os.PathLike[str] | None = None
) -> list[str]:
    """Gold evidence doc ids of a `tools.benchmarks.Question`: PubMedQA → its own abstract's passages
    (`pubmed-<pmid>-<i>`, the concrete ids of `corpus_dir` when given, else one per context), BioASQ → the
    qrels' snippet ids; other benchmarks → []."""
    gold = gold_evidence(question.id, question.benchmark, qrels_path=qrels, corpus_dir=corpus_dir)
    if gold is None:
        return []
    if gold.prefix is not None:  # PubMedQA without the corpus: one passage per context, as the corpus numbers them
        return [f"{gold.prefix}{i}" for i in range(len(question.contexts))]
    return sorted(gold.ids)
