"""Baselines beside the learning figures already recorded (issue 39, part 1), read off the held-out questions alone.

The learning benches now record their baselines as they run (`evals.baselines`); records made before that carry
none. Their held-out sets are fixed by the data and each bench's split (PubMedQA-train after one seeded shuffle for
`learning_signal.py` and `med_r3_learning.py`; `mmedagent_learning.py`'s labelled split from its recorded
settings), so chance, the held-out majority, always-first-option and copy-the-worked-example follow from the
questions, without a model. Each record (`learning.json`, `learning_grpo_levers.json`,
`med_r3_learning.json`, `mmedagent_learning.json`) gets a `baselines` block and, for every accuracy it holds (before, and
each seed after), whether it is above every baseline's Wilson 95% interval (`evals.baselines.beats_baselines`).
The modal-answer share needs the replies, which these records did not keep: their block says so.

    .venv/bin/python benches/learning/recorded_baselines.py --data ../shared/data
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benches" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ermedrag.agents import respondent  # noqa: E402
from ermedrag.evals.baselines import balanced_positions, beats_baselines, trivial_baselines  # noqa: E402
from ermedrag.tools.data.benchmarks import Question, load_questions_file  # noqa: E402
from ermedrag.tools.records.jsonl import replace_text  # noqa: E402

NOT_KEPT = "replies not kept for this record (rerun the bench): no modal-answer share"


def pubmedqa_heldout(data: Path, train: int, held_out: int) -> list[Question]:
    """The held-out questions of learning_signal.py and med_r3_learning.py: PubMedQA-train after one seeded shuffle."""
    pool = load_questions_file(data / "benchmarks" / "pubmedqa_train.jsonl")
    random.Random(0).shuffle(pool)
    return pool[train : train + held_out]


def question_baselines(questions: Sequence[Question], how: str) -> dict[str, Any]:
    """Trivial answers on these questions; the worked example's answer is the respondent's (the Med-R³ reasoner
    shows the same one: `respondent.example_options`)."""
    prompts = [_example_prompt(q) for q in questions]
    baselines = trivial_baselines([q.answer for q in questions], [list(q.options) for q in questions], prompts)
    return {**baselines, "held_out": how, "modal_answer_share": NOT_KEPT}


def _example_prompt(question: Question) -> list[dict[str, str]]:
    """The conversation's worked example as the respondent's prompt shows it before `question`."""
    user, assistant = respondent.example(question.question, question.options)
    return [
        {"role": "system", "content": respondent.SYSTEM_PROMPT},
        {"role": "user", "content": user},
        {"role": "assistant", "content": assistant},
        {"role": "user", "content": question.question},
    ]


def verdicts(accuracies: dict[str, float | None], baselines: dict[str, Any]) -> dict[str, bool]:
    """Whether each recorded accuracy is above every baseline's 95% interval."""
    bounds = {k: v for k, v in baselines.items() if k in ("chance", "majority", "first_option", "copy_example")}
    return {label: beats_baselines(value, bounds) for label, value in accuracies.items()}


def seed_accuracies(summary: dict[str, Any], metric: str = "accuracy") -> dict[str, float | None]:
    entry = summary.get(metric) or {}
    before = entry.get("before")
    befores = before["values"] if isinstance(before, dict) else [before]
    found = {f"before{'' if len(befores) == 1 else f' (seed {i})'}": v for i, v in enumerate(befores)}
    return found | {f"after seed {i}": v for i, v in enumerate((entry.get("after") or {}).get("values", []))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    args = parser.parse_args(argv)
    data = Path(args.data)

    learning = json.loads((RESULTS / "learning.json").read_text())
    grpo = learning["grpo_respondent"]
    held_out = pubmedqa_heldout(data, grpo["train_prompts"], grpo["eval_prompts"])
    block = question_baselines(held_out, f"learning_signal.py: PubMedQA-train[{grpo['train_prompts']}:+48], seed 0")
    block["verdicts"] = verdicts(seed_accuracies(learning["seeds"]["grpo_respondent"]), block)
    write(RESULTS / "learning.json", learning, block)

    levers = json.loads((RESULTS / "learning_grpo_levers.json").read_text())
    arms = {arm: summary for arm, summary in levers["seeds"].items() if isinstance(summary, dict)}
    lever_block = {
        **block,
        "verdicts": {arm: verdicts(seed_accuracies(summary), block) for arm, summary in arms.items()},
    }
    write(RESULTS / "learning_grpo_levers.json", levers, lever_block)  # the same held-out questions

    med_r3 = json.loads((RESULTS / "med_r3_learning.json").read_text())
    held_out = pubmedqa_heldout(data, med_r3["train_prompts"], med_r3["eval_prompts"])
    block = question_baselines(held_out, f"med_r3_learning.py: PubMedQA-train[{med_r3['train_prompts']}:+48], seed 0")
    block["verdicts"] = {
        stage: verdicts(seed_accuracies(med_r3["seeds"][stage]), block) for stage in ("stage1", "stage2", "stage3")
    }
    write(RESULTS / "med_r3_learning.json", med_r3, block)

    mmedagent = json.loads((RESULTS / "mmedagent_learning.json").read_text())
    if "baselines" not in mmedagent["attending"]:  # a run that recorded its own (`attending.baselines`) needs none
        block = attending_baselines(data, mmedagent["settings"])
        block["verdicts"] = verdicts(seed_accuracies(mmedagent["seeds"]["attending"]), block)
        write(RESULTS / "mmedagent_learning.json", mmedagent, {"attending": block}, key="baselines")
    return 0


def attending_baselines(data: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The attending's held-out rows rebuilt as mmedagent_learning.py builds them from its recorded settings."""
    from mmedagent_learning import BALANCED_POSITIONS, attending_rows, benchmarks_dir, labelled_questions
    from mmedagent_learning import split_questions

    by_specialty = labelled_questions(benchmarks_dir(str(data)), settings["max_question_chars"])
    train_q, eval_q = split_questions(
        by_specialty, settings["train_questions"], settings["eval_questions"], settings["seed"], settings["sampling"]
    )
    rng = random.Random(settings["seed"] + 1)
    attending_rows(train_q, rng, settings["reliabilities"])  # the held-out opinions come after the training ones
    balanced = settings.get("attending_gold_positions") == BALANCED_POSITIONS  # runs before it: as the data has them
    rows = attending_rows(balanced_positions(eval_q) if balanced else eval_q, rng, settings["reliabilities"])
    baselines = trivial_baselines(
        [r["gold"] for r in rows], [list(r["options"]) for r in rows], [r["prompt"] for r in rows]
    )
    return {
        **baselines,
        "held_out": "mmedagent_learning.py's held-out attending rows (recorded settings)",
        "modal_answer_share": NOT_KEPT,
    }


def write(path: Path, record: dict[str, Any], block: dict[str, Any], key: str = "baselines") -> None:
    second_line = path.read_text().splitlines()[1]
    record[key] = block
    replace_text(path, json.dumps(record, indent=len(second_line) - len(second_line.lstrip())) + "\n")  # as written
    print(f"{path.name}: {json.dumps(block)[:400]}")


if __name__ == "__main__":
    raise SystemExit(main())
