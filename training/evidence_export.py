"""GRPO prompts written from benchmark questions (`ermedrag export grpo --questions`), to teach ER-MedRAG's
respondent to follow evidence and ignore noise, with the reference replies its SFT warm start trains on.

    export_grpo_evidence(EvidenceExportConfig(questions=["medmcqa_dev.jsonl"], out="data/grpo_evidence"))

Resumable like every export (`training.export.export_resumable`); the rows are `training.export.respondent_row`'s,
rendered as the graph renders them.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ermedrag.agents import respondent
from ermedrag.agents.markup import quote
from ermedrag.training.export import export_resumable, respondent_row

# ER-MedRAG's respondent must answer from the evidence it is given and ignore noise. Recorded traces of a small
# extractor rarely hold evidence that decides the answer, so this export writes the evidence itself: a triplet
# that supports the gold answer (the benchmark's own conclusion where it has one, PubMedQA's `long_answer`, else
# written from the gold option's text), mixed with distractor triplets of other questions; some prompts get only
# distractors (irrelevant evidence: answer from knowledge) and some none at all (what the graph shows when retrieval
# or extraction comes back empty: answer from knowledge too). Evidence ids are neutral digests: nothing in a line
# says which one is gold.
SUPPORT_RELATION = "is answered by"
CONCLUSION_RELATION = "concludes"
MAX_FOCUS_CHARS = 160


@dataclass
class EvidenceExportConfig:
    questions: list[str] = field(metadata={"help": "benchmark JSONL files (shared schema) to write prompts for"})
    out: str = field(metadata={"help": "output folder: log.jsonl, data.jsonl, dataset/"})
    max_distractors: int = field(
        default=4, metadata={"help": "distractor triplets per prompt: drawn uniformly from 0 to this"}
    )
    irrelevant_fraction: float = field(
        default=0.25, metadata={"help": "share of prompts whose evidence is only distractors (answer from knowledge)"}
    )
    no_evidence_fraction: float = field(
        default=0.1, metadata={"help": "share of prompts with no evidence at all (answer from knowledge)"}
    )
    seed: int = field(
        default=0, metadata={"help": "draws the questions used (with limit), their order, kinds and distractors"}
    )
    limit: int | None = field(default=None, metadata={"help": "write at most this many prompts"})


def question_focus(text: str) -> str:
    """What a triplet's condition says of a question: its opening words, whitespace collapsed, cut at a word
    (a vignette's opening tells it from other questions, where its final "What is the most likely cause?" does not)."""
    words = " ".join(str(text).split())
    if len(words) <= MAX_FOCUS_CHARS:
        return words
    cut = words.rfind(" ", 0, MAX_FOCUS_CHARS)
    return words[: cut if cut > 0 else MAX_FOCUS_CHARS] + " …"


def evidence_id(*parts: str) -> str:
    """A neutral evidence id: a digest that says nothing about what the line is for."""
    return "ev-" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:8]


def option_triplet(question: Any, key: str) -> dict[str, str]:
    """A triplet naming option `key`'s text as the answer to `question` (a `tools.data.benchmarks.Question`)."""
    return {
        "condition": question_focus(question.question),
        "relation": SUPPORT_RELATION,
        "conclusion": question.options[key],
        "snippet_id": evidence_id(question.id, key, question.options[key]),
    }


def gold_triplet(question: Any) -> dict[str, str]:
    """The evidence for the gold answer: the benchmark's own conclusion (PubMedQA's `long_answer`) where it has one,
    else the gold option's text."""
    conclusion = question.conclusion
    if conclusion:
        return {
            "condition": question_focus(question.question),
            "relation": CONCLUSION_RELATION,
            "conclusion": conclusion,
            "snippet_id": evidence_id(question.id, "conclusion"),
        }
    return option_triplet(question, question.answer)


def evidence_row(
    question: Any,
    supporting: Sequence[dict[str, str]],
    distractors: Sequence[dict[str, str]],
    rng: random.Random,
    kind: str,
    evidence_key: str | None,
) -> dict[str, Any]:
    """`respondent_row` for a benchmark question (`tools.data.benchmarks.Question`) with this evidence; `kind` and
    `evidence_key` (the option the supporting evidence names, None without one) say what the prompt tests."""
    row = respondent_row(question.question, question.options, question.answer, supporting, distractors, rng)
    answer = evidence_key if supporting else question.answer  # no line decides it: the gold, from knowledge
    reference = reference_reply(row["triplets"], answer, question.options)
    return {
        **row,
        "kind": kind,
        "evidence_key": evidence_key,
        "reference_reply": reference,
        "run_id": question.id,
        "event_id": None,
    }


MAX_REFERENCE_QUOTE_CHARS = 200
# What the reference reply reasons when no line supports an answer. Without it the warm start saw only replies
# citing a line, and with no evidence at all the offline model cited an "Evidence [1]" that did not exist and
# answered with a fragment naming no option (benches/README.md, evidence following, seed 1: 20 of 48).
NO_SUPPORT_REASONING = "None of the evidence answers this question, so I answer from what I know."
NO_EVIDENCE_REASONING = "No evidence was found for this question, so I answer from what I know."


def reference_reply(
    triplets: Sequence[dict[str, Any]], answer: str | None, options: dict[str, str] | None = None
) -> str | None:
    """The reply a respondent that follows its evidence writes, in the worked example's shape: the first supporting
    (not distractor) line cited by its number and its conclusion quoted, or with no such line
    `NO_SUPPORT_REASONING` (`NO_EVIDENCE_REASONING` without any line) and no citation; then the answer, naming the
    option by its text (`reference_answer`). The target of `train_sft`'s warm start; None without an answer."""
    if not answer:
        return None
    line = next((i for i, t in enumerate(triplets, 1) if not t.get("distractor")), None)
    if line is not None:
        reasoning = f"Evidence [{line}] says {quote(triplets[line - 1].get('conclusion'), MAX_REFERENCE_QUOTE_CHARS)}."
    else:
        reasoning = NO_SUPPORT_REASONING if triplets else NO_EVIDENCE_REASONING
    return f"<think>{reasoning}</think><answer>{reference_answer(answer, options)}</answer>"


def reference_answer(key: str, options: dict[str, str] | None) -> str:
    """Option `key` named by its text, as the options block shows it, where the parser reads that text back as
    `key` (`respondent.match_answer`), else by its letter. The text, because a small model copies the evidence's
    words exactly but maps them to the letter printed before them at chance: the offline 270M model after this warm
    start quoted the right line in 47 of 48 held-out prompts and wrote its letter in 11
    (benches/results/evidence_following_sft.json)."""
    if not options or key not in options:
        return key
    text = quote(options[key], respondent.MAX_OPTION_CHARS)
    return text if respondent.match_answer(text, options)[0] == key else key


def draw_distractors(
    pool: Sequence[tuple[str, dict[str, str]]], exclude: str, count: int, rng: random.Random
) -> list[dict[str, str]]:
    """`count` triplets of questions other than `exclude` from `pool` ((question id, triplet) pairs)."""
    picked: list[dict[str, str]] = []
    for index in rng.sample(range(len(pool)), min(len(pool), count + 1)):
        if pool[index][0] != exclude and len(picked) < count:
            picked.append(pool[index][1])
    return picked


def prompt_kind(draw: float, config: EvidenceExportConfig) -> str:
    """A prompt's kind from a uniform draw in [0, 1): `no_evidence`, `irrelevant` or `supporting`, in the
    config's shares."""
    if draw < config.no_evidence_fraction:
        return "no_evidence"
    return "irrelevant" if draw < config.no_evidence_fraction + config.irrelevant_fraction else "supporting"


def evidence_prompts(questions: Sequence[Any], config: EvidenceExportConfig) -> list[dict[str, Any]]:
    """The prompts `export_grpo_evidence` writes for `questions`, in the seed's order (each drawn from its own
    seeded stream, so a resumed export writes the very same ones)."""
    shares = {"irrelevant_fraction": config.irrelevant_fraction, "no_evidence_fraction": config.no_evidence_fraction}
    for name, share in shares.items():
        if not 0 <= share <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {share}")
    if sum(shares.values()) > 1:
        raise ValueError(f"irrelevant_fraction + no_evidence_fraction must be at most 1, got {sum(shares.values()):g}")
    if config.max_distractors < 0:
        raise ValueError(f"max_distractors must be 0 or more, got {config.max_distractors}")
    pool = [(q.id, gold_triplet(q)) for q in questions]
    order = list(questions)
    random.Random(config.seed).shuffle(order)
    rows = []
    for question in order[: config.limit]:
        rng = random.Random(f"{config.seed}:{question.id}")
        kind = prompt_kind(rng.random(), config)
        distractors: list[dict[str, str]] = []
        if kind != "no_evidence":
            least = int(kind == "irrelevant")  # a line at least (where another question can lend one)
            count = rng.randint(least, max(config.max_distractors, least))
            distractors = draw_distractors(pool, question.id, count, rng)
        supporting = [gold_triplet(question)] if kind == "supporting" else []
        key = question.answer if supporting else None
        rows.append(evidence_row(question, supporting, distractors, rng, kind, key))
    return rows


def export_grpo_evidence(config: EvidenceExportConfig, progress: bool = True) -> dict[str, int]:
    """Respondent GRPO prompts written from benchmark questions (`ermedrag export grpo --questions FILE...`):
    evidence that supports the gold answer among distractors, only distractors, or none. Resumable like the other
    exports; returns counts."""
    from ermedrag.tools.data.benchmarks import load_questions_file

    if not config.questions:
        raise ValueError("no questions files given")
    return export_evidence_prompts(
        [q for path in config.questions for q in load_questions_file(path)], config, progress
    )


def export_evidence_prompts(
    questions: Sequence[Any], config: EvidenceExportConfig, progress: bool = True
) -> dict[str, int]:
    """`export_grpo_evidence` for questions already loaded (`config.questions` unread)."""
    rows = evidence_prompts(questions, config)
    return export_resumable(
        Path(config.out),
        [{"question_id": row["run_id"], "row": row} for row in rows],
        "question_id",
        lambda item: item,
        row_key="row",
        limit=None,
        progress=progress,
        unit="question",
    )
