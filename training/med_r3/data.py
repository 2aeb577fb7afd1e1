"""Med-R³ GRPO datasets: conversational reasoner prompts with the columns its rewards read.

    build_med_r3_dataset(["pubmedqa_train.jsonl", "bioasq_yesno.jsonl"], "data/med_r3/dataset",
                         qrels="bioasq_qrels.jsonl", corpus_dir="corpora")
    # CLI: python -m ermedrag.training.med_r3.train dataset FILE.jsonl ... --out DIR [--qrels Q] [--corpus-dir C]

A row: `prompt` (`agents.reasoner.build_messages` with an empty transcript, in chat format), `gold`,
`options`, `gold_evidence` (doc ids, possibly empty: `tools.gold_evidence`), `id`, `benchmark`, and
`reference_reply` (`agents.reasoner.reference_reply`: the question's own conclusion, then its gold answer; null
where the benchmark states no conclusion), which `ermedrag train sft` warm-starts the reasoner on before stage 1.
Rows replayed from recorded graph runs (`training.export.export_med_r3`) have the same columns.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ermedrag.agents import reasoner
from ermedrag.agents.base import to_chat


def med_r3_row(
    prompt: list[dict[str, str]],
    *,
    gold: Any,
    options: Mapping[str, Any] | None,
    gold_evidence: Iterable[Any],
    row_id: Any,
    benchmark: Any,
    conclusion: str | None = None,
) -> dict[str, Any]:
    """One dataset row: the prompt in chat format, the reward columns as plain strings, and the SFT warm start's
    reference reply written from `conclusion` (the benchmark's own, where it states one)."""
    gold = None if gold is None else str(gold)
    return {
        "prompt": prompt,
        "gold": gold,
        "options": {str(k): str(v) for k, v in options.items()} if options else None,
        "gold_evidence": [str(g) for g in gold_evidence],
        "id": str(row_id or ""),
        "benchmark": str(benchmark or ""),
        "reference_reply": reasoner.reference_reply(conclusion, gold),
    }


def med_r3_dataset(questions: Iterable[Any]):
    """A `datasets.Dataset` of Med-R³ rows (module docstring). A question is an `tools.benchmarks.Question` or
    a dict with `question`, `options`, `gold` (or `answer`), and optionally `gold_evidence`, `id`,
    `benchmark`, `conclusion`."""
    from datasets import Dataset

    rows = []
    for question in questions:
        q = (
            question
            if isinstance(question, dict)
            else {**dataclasses.asdict(question), "conclusion": question.conclusion}
        )
        options = q.get("options") or None
        rows.append(
            med_r3_row(
                to_chat(reasoner.build_messages(str(q.get("question") or ""), options, "")),
                gold=q.get("gold", q.get("answer")),
                options=options,
                gold_evidence=q.get("gold_evidence") or [],
                row_id=q.get("id"),
                benchmark=q.get("benchmark"),
                conclusion=q.get("conclusion"),
            )
        )
    if not rows:
        raise ValueError("med_r3_dataset: no questions")
    return Dataset.from_list(rows)


def build_med_r3_dataset(
    paths: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    qrels: str | os.PathLike[str] | None = None,
    corpus_dir: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Questions from JSONL files in the shared schema (`pubmedqa_train.jsonl`, `bioasq_yesno.jsonl`, any
    benchmark file; the benchmark is named after the file) → `out` (`Dataset.save_to_disk`). BioASQ needs
    `qrels` (`retrieval/bioasq_qrels.jsonl`); `corpus_dir` (the corpora folder) gives PubMedQA's exact ids.
    `limit` samples that many questions per file (seeded)."""
    from ermedrag.tools.data.benchmarks import load_questions_file
    from ermedrag.tools.data.gold_evidence import question_gold_evidence

    questions, counts = [], {}
    for path in paths:
        loaded = load_questions_file(path, limit=limit, seed=seed)
        for q in loaded:
            questions.append(
                {
                    "id": q.id,
                    "question": q.question,
                    "options": q.options,
                    "gold": q.answer,
                    "benchmark": q.benchmark,
                    "gold_evidence": question_gold_evidence(q, qrels, corpus_dir),
                    "conclusion": q.conclusion,
                }
            )
        counts[str(path)] = len(loaded)
    dataset = med_r3_dataset(questions)
    dataset.save_to_disk(str(out))
    with_gold = sum(1 for q in questions if q["gold_evidence"])
    with_reference = sum(1 for row in dataset if row["reference_reply"])
    return {
        "rows": len(questions),
        "with_gold_evidence": with_gold,
        "with_reference_reply": with_reference,
        "per_file": counts,
        "out": str(out),
    }
