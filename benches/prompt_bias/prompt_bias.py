"""Does the respondent's format example lead the model? Three examples on the same questions, in one run.

Every arm runs the real CoT graph (`ermedrag.graphs.baselines.cot`: the respondent alone, no retrieval) with the
offline model on the same MedQA questions, greedy. They differ only in the respondent's prompt:

- `old_example_B`: the prompt as it was before issue 12, reproduced here exactly: its worked example answers
  a vitamin question with options A/B/C and `<answer>B</answer>`;
- `rotated_example` (the current prompt, `agents.respondent.example`): the example's options carry the real
  question's keys and its answer letter is drawn from a hash of the question (uniform across questions,
  independent of the gold answer); plus one sentence framing evidence as quoted material;
- `placeholder_example`: the current system prompt with an example whose options are labelled P/Q/R and whose
  answer is Q (`agents.markup.placeholder_options`): a letter no question uses.

The arms run one after the other in one process (the graph reads the respondent's prompt from module globals
at call time; they are swapped between arms, never while questions are in flight); within an arm, questions run
concurrently so the hf backend batches them. Per arm: share of answers equal to "B" (the old example's letter),
the answer-letter distribution against the gold-letter distribution (total variation distance, chi-square of
the answer counts against the gold proportions), accuracy, invalid rate, and how often the example's own answer
letter was copied. The result file is rewritten after each arm (`complete` says whether all arms ran).

    .venv/bin/python benches/prompt_bias/prompt_bias.py                # 100 questions, writes results/prompt_bias.json
    .venv/bin/python benches/prompt_bias/prompt_bias.py --limit 4 --out /tmp/prompt_bias_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ermedrag.offline import go_offline
from ermedrag.tools.machine import describe_machine

go_offline()

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "benches" / "results" / "prompt_bias.json"
MODEL = "offline:gemma3-270m"
OLD_LETTER = "B"

# The respondent's prompt before issue 12 (agents/respondent.py at commit 9bc7ac2), character for character.
OLD_SYSTEM_PROMPT = """You are a careful physician answering a medical question. Use the evidence triplets when they are relevant and ignore those that are not.
First reason briefly inside <think></think>, then give only the final answer inside <answer></answer>: the option letter for a multiple-choice question, otherwise a short answer."""
OLD_USER_TEMPLATE = """Evidence:
{evidence}

Question: {question}
{options}"""
OLD_EXAMPLE = (
    OLD_USER_TEMPLATE.format(
        evidence="1. [ex-1] vitamin D deficiency in children — causes — rickets",
        question="A toddler with bowed legs and poor bone mineralisation most likely lacks which vitamin?",
        options="Options:\nA. Vitamin C\nB. Vitamin D\nC. Vitamin B12",
    ),
    "<think>The evidence says vitamin D deficiency causes rickets, which fits bowed legs: option B.</think>"
    "<answer>B</answer>",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", default="medqa")
    parser.add_argument("--limit", type=int, default=100, help="questions (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8, help="questions in flight (the hf backend batches them)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument(
        "--data",
        default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")),
        help="the shared data folder (its benchmarks/ holds the question files)",
    )
    parser.add_argument("--out", default=str(RESULT))
    return parser.parse_args(argv)


Example = Callable[[str, "dict[str, str] | None"], tuple[str, str]]


def placeholder_example(question: str, options: dict[str, str] | None) -> tuple[str, str]:
    """The respondent's example with placeholder letters P/Q/R (answer Q) instead of the question's own keys."""
    from ermedrag.agents import respondent
    from ermedrag.agents.markup import PLACEHOLDER_ANSWER, placeholder_options

    shown = placeholder_options(["Vitamin C", respondent.EXAMPLE_ANSWER_TEXT, "Vitamin B12"])
    user = respondent.USER_TEMPLATE.format(
        evidence=respondent.EXAMPLE_EVIDENCE,
        question=respondent.EXAMPLE_QUESTION,
        options=respondent.format_options(shown),
    )
    return user, (
        f"<think>The evidence says vitamin D deficiency causes rickets, which fits bowed legs: option "
        f"{PLACEHOLDER_ANSWER}.</think><answer>{PLACEHOLDER_ANSWER}</answer>"
    )


def arms() -> dict[str, tuple[str, Example, Callable[[str, dict[str, str]], str]]]:
    """Arm → (system prompt, example builder, the example's answer letter for a question)."""
    from ermedrag.agents import respondent
    from ermedrag.agents.markup import PLACEHOLDER_ANSWER, rotated_example_key

    return {
        "old_example_B": (OLD_SYSTEM_PROMPT, lambda question, options: OLD_EXAMPLE, lambda q, o: OLD_LETTER),
        "rotated_example": (
            respondent.SYSTEM_PROMPT,
            respondent.example,
            lambda q, o: rotated_example_key(q, list(o)[: respondent.MAX_EXAMPLE_OPTIONS]),
        ),
        "placeholder_example": (respondent.SYSTEM_PROMPT, placeholder_example, lambda q, o: PLACEHOLDER_ANSWER),
    }


def check_old_prompt_is_reproduced(question: str, options: dict[str, str]) -> None:
    """The old arm's messages, built by the real build_messages with the old constants swapped in, must equal
    the old layout built by hand (system, example turn, user)."""
    from ermedrag.agents import respondent
    from ermedrag.graphs.baselines import NO_RETRIEVAL

    with swapped_prompt(OLD_SYSTEM_PROMPT, lambda q, o: OLD_EXAMPLE):
        built = [(m.type, m.text) for m in respondent.build_messages(question, options, NO_RETRIEVAL)]
    user = OLD_USER_TEMPLATE.format(
        evidence=NO_RETRIEVAL, question=question, options=respondent.format_options(options)
    ).rstrip()
    expected = [("system", OLD_SYSTEM_PROMPT), ("human", OLD_EXAMPLE[0]), ("ai", OLD_EXAMPLE[1]), ("human", user)]
    if built != expected:
        raise SystemExit(
            "the old arm does not reproduce the old prompt: "
            + json.dumps({"built": built, "expected": expected})[:2000]
        )


class swapped_prompt:
    """The respondent's system prompt and example builder replaced for the duration of an arm."""

    def __init__(self, system: str, example: Example):
        self.system, self.example = system, example

    def __enter__(self) -> None:
        from ermedrag.agents import respondent

        self.saved = respondent.SYSTEM_PROMPT, respondent.example
        respondent.SYSTEM_PROMPT, respondent.example = self.system, self.example

    def __exit__(self, *exc: object) -> None:
        from ermedrag.agents import respondent

        respondent.SYSTEM_PROMPT, respondent.example = self.saved


def run_arm(questions: list[Any], context: dict[str, Any], concurrency: int) -> list[dict[str, Any]]:
    from ermedrag.graphs.baselines import cot

    def answer(question: Any) -> dict[str, Any]:
        state = cot.invoke(
            {"question": question.question, "options": question.options, "gold": question.answer}, context=context
        )
        return {
            "id": question.id,
            "gold": question.answer,
            "answer": state["answer"]["answer"],
            "error": state["answer"]["error"],
            "well_formed": state["answer"]["well_formed"],
            "run_id": state["run_id"],
        }

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(answer, questions))


def completions(trace_db: str, rows: list[dict[str, Any]]) -> dict[str, str]:
    from ermedrag.tools.records.traces import TraceStore

    store = TraceStore(trace_db)
    return {row["id"]: next(store.events(run_id=row["run_id"], agent="respondent"))["completion"] for row in rows}


def distribution(letters: list[str | None], keys: list[str]) -> dict[str, int]:
    counts = Counter("invalid" if letter is None else letter for letter in letters)
    return {key: counts.get(key, 0) for key in keys + ["invalid"]}


def summarise(
    rows: list[dict[str, Any]], texts: dict[str, str], example_letters: dict[str, str], keys: list[str]
) -> dict[str, Any]:
    from scipy.stats import chisquare

    n = len(rows)
    answers = [row["answer"] for row in rows]
    valid = [a for a in answers if a is not None]
    gold_counts = Counter(row["gold"] for row in rows)
    answer_counts = Counter(valid)
    gold_share = {k: gold_counts.get(k, 0) / n for k in keys}
    answer_share = {k: answer_counts.get(k, 0) / len(valid) if valid else 0.0 for k in keys}
    expected = [gold_share[k] * len(valid) for k in keys if gold_share[k] > 0]
    observed = [answer_counts.get(k, 0) for k in keys if gold_share[k] > 0]
    chi2 = chisquare(observed, expected) if valid and len(observed) > 1 and sum(observed) == len(valid) else None
    # The model's answer tag holds exactly the letter the example answered with (for the question it was shown).
    copied = sum(f"<answer>{example_letters[row['id']]}</answer>" in texts[row["id"]].replace(" ", "") for row in rows)
    return {
        "n": n,
        "accuracy": round(sum(row["answer"] == row["gold"] for row in rows) / n, 4),
        "invalid_rate": round((n - len(valid)) / n, 4),
        "well_formed_rate": round(sum(bool(row["well_formed"]) for row in rows) / n, 4),
        "share_answer_B_of_all": round(answers.count(OLD_LETTER) / n, 4),
        "share_answer_B_of_valid": round(answers.count(OLD_LETTER) / len(valid), 4) if valid else None,
        "answer_letters": distribution(answers, keys),
        "gold_letters": {k: gold_counts.get(k, 0) for k in keys},
        "tvd_answers_vs_gold": (
            round(0.5 * sum(abs(answer_share[k] - gold_share[k]) for k in keys), 4) if valid else None
        ),  # over valid answers: undefined without any
        "chi2_answers_vs_gold": (
            {
                "statistic": round(float(chi2.statistic), 3),
                "p_value": float(f"{chi2.pvalue:.3g}"),
                "df": len(observed) - 1,
            }
            if chi2
            else None
        ),
        "copied_example_letter": {
            "count": copied,
            "share": round(copied / n, 4),
            "example_letters": dict(sorted(Counter(example_letters.values()).items())),
        },
        "top_errors": Counter(row["error"] for row in rows if row["error"]).most_common(5),
    }


WHAT_IT_CANNOT_SHOW = (
    "One small base model (270M, near chance on MedQA), one benchmark, greedy decoding, no retrieval: it measures "
    "whether the example's letter pulls this model's answers, not whether a larger or instruction-tuned model is "
    "pulled, nor the effect on ER-MedRAG or vanilla RAG (their evidence changes the prompt too). With 100 questions "
    "a few points of accuracy or of any letter's share are within noise (binomial SE ~ 4-5 points). The new arms "
    "also differ from the old one by one sentence framing evidence as quoted data."
)


def what_it_shows(arms: dict[str, Any]) -> str:
    parts = []
    for arm, figures in arms.items():
        tvd = figures["tvd_answers_vs_gold"]
        parts.append(
            f"{arm}: B {figures['share_answer_B_of_all']:.0%} of answers, accuracy {figures['accuracy']:.0%}, "
            f"invalid {figures['invalid_rate']:.0%}, example letter copied "
            f"{figures['copied_example_letter']['share']:.0%}, TVD vs gold "
            f"{'n/a' if tvd is None else f'{tvd:.2f}'}"
        )
    first = next(iter(arms.values()))
    gold_b = first["gold_letters"].get(OLD_LETTER, 0) / first["n"]
    return (
        "; ".join(parts) + f" (gold B share {gold_b:.0%}). The model copies the example's answer letter: "
        "a fixed real letter becomes a position bias, a placeholder letter an invalid answer, a letter drawn "
        "per question a uniform guess."
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from ermedrag.tools.data.benchmarks import load_benchmark

    questions = load_benchmark(args.benchmark, Path(args.data) / "benchmarks", limit=args.limit, seed=args.seed)
    keys = sorted({k for q in questions for k in q.options})
    check_old_prompt_is_reproduced(questions[0].question, questions[0].options)
    trace_db = str(Path(tempfile.mkdtemp(prefix="prompt_bias_")) / "traces.sqlite")
    context = {"respondent_model": args.model, "temperature": 0.0, "trace_db": trace_db}
    figures: dict[str, Any] = {}
    rows_by_arm: dict[str, list[dict[str, Any]]] = {}
    for arm, (system, example, example_letter) in arms().items():
        started = time.perf_counter()
        with swapped_prompt(system, example):
            rows = run_arm(questions, context, args.concurrency)
        seconds = time.perf_counter() - started
        texts = completions(trace_db, rows)
        # The graph strips the question before the respondent sees it (graphs.state.validate_question).
        letters = {q.id: example_letter(q.question.strip(), q.options) for q in questions}
        figures[arm] = summarise(rows, texts, letters, keys) | {"seconds": round(seconds, 1)}
        rows_by_arm[arm] = [
            row | {"example_letter": letters[row["id"]], "completion": texts[row["id"]][:400]} for row in rows
        ]
        print(f"{arm}: {json.dumps(figures[arm])}", flush=True)
        write_result(args, argv, questions, figures, rows_by_arm, complete=len(figures) == len(arms()))


def write_result(
    args: argparse.Namespace,
    argv: list[str] | None,
    questions: list[Any],
    figures: dict[str, Any],
    rows_by_arm: dict[str, list[dict[str, Any]]],
    complete: bool,
) -> None:
    first_arm = next(iter(rows_by_arm.values()))
    agreement = {
        f"{a}_vs_{b}": round(
            sum(x["answer"] == y["answer"] for x, y in zip(rows_by_arm[a], rows_by_arm[b])) / len(first_arm), 4
        )
        for i, a in enumerate(rows_by_arm)
        for b in list(rows_by_arm)[i + 1 :]
    }
    result = {
        "bench": "prompt_bias",
        "complete": complete,
        "command": " ".join(
            [
                "ERMEDRAG_TORCH_THREADS=" + os.environ.get("ERMEDRAG_TORCH_THREADS", ""),
                ".venv/bin/python",
                "benches/prompt_bias/prompt_bias.py",
                *(argv or sys.argv[1:]),
            ]
        ),
        "model": args.model,
        "graph": "cot (respondent only, no retrieval)",
        "settings": {
            "benchmark": args.benchmark,
            "limit": args.limit,
            "seed": args.seed,
            "temperature": 0.0,
            "respondent_max_new_tokens": 192,
            "concurrency": args.concurrency,
            "ERMEDRAG_TORCH_THREADS": os.environ.get("ERMEDRAG_TORCH_THREADS"),
            "machine": describe_machine(),
        },
        "n": len(questions),
        "arms": figures,
        "same_answer": agreement,
        "what_it_shows": what_it_shows(figures),
        "what_it_cannot_show": WHAT_IT_CANNOT_SHOW,
        "questions": rows_by_arm,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
