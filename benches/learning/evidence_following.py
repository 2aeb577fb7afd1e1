"""Does the respondent follow its evidence, and does GRPO teach it to? (issue 39, part 5: ER-MedRAG's claim)

Held-out: `--eval-questions` four-option questions (MedMCQA dev and MMLU-Med, short ones, none whose options name
other options), their golds balanced over positions (`evals.baselines.balanced_positions`). Each is asked
greedily, with the respondent's own prompt and stop string, in five ways:
- `d0`, `d2`, `d4` (counterfactual): one triplet names option X's text as the answer, X drawn uniformly over the
  options independently of the gold, among d distractor triplets of other questions. `follow_rate` = share of
  answers equal to X;
- `gold_evidence`: one triplet names the gold option, among 2 distractors (`accuracy_gold_evidence`);
- `no_evidence`: the ordinary question with no evidence (`accuracy_no_evidence`; and, read against X, the
  `no_evidence` baseline: how often the model names X without being told);
- `ordinary`: `--ordinary-questions` more questions of the same kind with no evidence, none of which any recorded
  seed's training asked or showed as a line (`accuracy_ordinary`): whether training cost the model what it knew,
  on enough questions to tell (each seed's change against the before, paired: `paired_change`).
Baselines beside the follow rate: `chance` (1 / options), `no_evidence`, `copy_example` (the worked example's
letter equals X). A seed `beats_baselines` when its d2 follow rate is above every baseline's Wilson 95% interval.

Training: each seed exports its own GRPO prompts from the other questions with `ermedrag export grpo --questions`'s
code (`training.evidence_export.export_evidence_prompts`, the seed drawing the sample, order, kinds and distractors:
evidence supporting the gold among 0-4 distractors, a quarter with only distractors, a tenth with none), trains the respondent with
the product's GRPO (LoRA, the respondent's default rewards: correctness, format, length, evidence use) from the
base model, merges (in float32, saved in the base checkpoint's dtype: `learning_signal.merged_model`) and measures
again on the same held-out prompts, decoded as the before is. Every reply is kept
(`<out dir>/evidence_following/replies/<phase>.jsonl.gz`: prompt id, set, reply, parsed answer, gold, X, the worked
example's letter, the option its reasoning quotes). `--sft-prompts N` warm-starts each seed first with the product's
SFT (`training.trainers.train_sft`) on the reference replies of its own export of N questions (GRPO's prompts are
the first of them), then GRPO goes on from the merged warm start (`--steps 0`: the warm start alone is measured).

    .venv/bin/python benches/learning/evidence_following.py --data ../shared/data          # ≈ 1.5 h on 2 cores
    .venv/bin/python benches/learning/evidence_following.py --smoke                          # tiny random model
    .venv/bin/python benches/learning/evidence_following.py --reuse --first-seed 2 --seeds 1  # add a seed
    .venv/bin/python benches/learning/evidence_following.py --sft-prompts 256 --temperature 1.0 \\
        --out benches/results/evidence_following_sft_grpo.json                             # SFT warm start, then GRPO
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learning_signal import generate, log, trained  # noqa: E402  (learning_signal goes offline at import)
from kept_replies import read_replies, write_replies  # noqa: E402
from seeds import LEARNING_WORK, hold_work_folder, model_stamp, spread  # noqa: E402

from ermedrag.agents import respondent  # noqa: E402
from ermedrag.evals.baselines import balanced_positions, beats_baselines, modal_share, paired_change, share  # noqa: E402
from ermedrag.evals.baselines import worked_example_answer  # noqa: E402
from ermedrag.tools.data.benchmarks import Question, load_questions_file  # noqa: E402
from ermedrag.tools.machine import describe_machine  # noqa: E402
from ermedrag.tools.records.jsonl import replace_text  # noqa: E402
from ermedrag.training.config import GRPOTrainingConfig, SFTTrainingConfig  # noqa: E402
from ermedrag.training.evidence_export import (  # noqa: E402
    EvidenceExportConfig,
    draw_distractors,
    evidence_prompts,
    evidence_row,
    export_evidence_prompts,
    gold_triplet,
    option_triplet,
)
from ermedrag.training.trainers import train_grpo, train_sft  # noqa: E402

BENCHMARKS = ("medmcqa_dev", "mmlu_med_test")
DISTRACTOR_COUNTS = (0, 2, 4)
GOLD_EVIDENCE_DISTRACTORS = 2
ORDINARY = "ordinary"
RESULT = REPO / "benches" / "results" / "evidence_following.json"
# An option that names other options ("All of the above", "Both A and B") changes meaning when options move.
NAMES_OTHER_OPTIONS = re.compile(r"\b(above|both|none of|all of)\b|\b[a-d]\s*(?:and|&|,)\s*[a-d]\b", re.IGNORECASE)
SMOKE = {
    "eval_questions": 4,
    "ordinary_questions": 4,
    "train_prompts": 4,
    "steps": 2,
    "tokens": 16,
    "generations": 2,
    "prompts_per_step": 1,
}


def pools(data: Path, max_chars: int, eval_questions: int) -> tuple[list[Question], list[Question]]:
    """(held-out, training pool): short four-option questions whose options stand alone, one seeded shuffle;
    the held-out ones balanced over gold positions."""
    questions = [
        q
        for name in BENCHMARKS
        for q in load_questions_file(data / "benchmarks" / f"{name}.jsonl")
        if len(q.options) == 4
        and len(q.question) <= max_chars
        and not any(NAMES_OTHER_OPTIONS.search(text) for text in q.options.values())
    ]
    random.Random(0).shuffle(questions)
    return balanced_positions(questions[:eval_questions]), questions[eval_questions:]


def heldout_rows(heldout: Sequence[Question], pool: Sequence[Question]) -> list[dict[str, Any]]:
    """Every held-out prompt, each with its `set` and `prompt_id`: the counterfactual sets, gold evidence and no
    evidence. X and the distractors are drawn per question from seeded streams (the same X at every d)."""
    distractor_pool = [(q.id, gold_triplet(q)) for q in pool]
    rows = []
    for q in heldout:
        x = random.Random(f"x:{q.id}").choice(list(q.options))
        for d in DISTRACTOR_COUNTS:
            rng = random.Random(f"d{d}:{q.id}")
            distractors = draw_distractors(distractor_pool, q.id, d, rng)
            rows.append(
                {**evidence_row(q, [option_triplet(q, x)], distractors, rng, "counterfactual", x), "set": f"d{d}"}
            )
        rng = random.Random(f"gold:{q.id}")
        distractors = draw_distractors(distractor_pool, q.id, GOLD_EVIDENCE_DISTRACTORS, rng)
        rows.append(
            {**evidence_row(q, [gold_triplet(q)], distractors, rng, "supporting", q.answer), "set": "gold_evidence"}
        )
        rows.append(without_evidence(q, "no_evidence", x))  # X: how often it is named untold
    return [{**row, "prompt_id": f"{row['run_id']}:{row['set']}"} for row in rows]


def export_config(seed: int, folder: Path | str, limit: int) -> EvidenceExportConfig:
    """A seed's export of `limit` pool questions (`ermedrag export grpo --questions`'s defaults)."""
    return EvidenceExportConfig(questions=[], out=str(folder), seed=seed, limit=limit)


def seen_in_training(args: argparse.Namespace, pool: Sequence[Question]) -> tuple[set[str], set[str]]:
    """(ids asked, conclusions shown as a line) by the exports of seeds 0 to the last one this run trains."""
    limits = [limit for limit in (args.sft_prompts, args.train_prompts if args.steps else 0) if limit]
    asked: set[str] = set()
    shown: set[str] = set()
    for seed in range(args.first_seed + args.seeds):
        for limit in limits:
            for row in evidence_prompts(pool, export_config(seed, "", limit)):
                asked.add(row["run_id"])
                shown.update(t["conclusion"] for t in row["triplets"])
    return asked, shown


def ordinary_questions(
    args: argparse.Namespace, pool: Sequence[Question], recorded: Sequence[str] | None = None
) -> list[Question]:
    """`--ordinary-questions` pool questions no training of this run's seeds has seen: none of their exports asks
    them or shows their gold as a line (a distractor's conclusion); in the pool's order, golds balanced over
    positions. `recorded`: the ids a record's set was built from, kept as they are (seeds added later are checked
    against them, so every seed of a record and its before answer the very same questions)."""
    asked, shown = seen_in_training(args, pool)

    def trained_on(question: Question) -> bool:
        return question.id in asked or gold_triplet(question)["conclusion"] in shown

    if recorded is None:
        chosen = [q for q in pool if not trained_on(q)]
        if len(chosen) < args.ordinary_questions:
            raise SystemExit(
                f"only {len(chosen)} pool questions are unseen by training; ask fewer --ordinary-questions"
            )
        return balanced_positions(chosen[: args.ordinary_questions])
    by_id = {q.id: q for q in pool}
    missing = [i for i in recorded if i not in by_id]
    if missing or len(recorded) != args.ordinary_questions:
        raise SystemExit(
            f"the record's {len(recorded)} ordinary questions ({len(missing)} not in the pool) are not the "
            f"--ordinary-questions {args.ordinary_questions} asked: pass its size, or write a new --out"
        )
    chosen = [by_id[i] for i in recorded]
    seen = [q.id for q in chosen if trained_on(q)]
    if seen:
        raise SystemExit(
            f"{len(seen)} of the record's ordinary questions are in these seeds' training: write a new --out"
        )
    return balanced_positions(chosen)


def without_evidence(question: Question, name: str, evidence_key: str | None) -> dict[str, Any]:
    """`question` asked as the respondent is asked it with no evidence at all, in set `name`."""
    row = evidence_row(question, [], [], random.Random(0), "none", None)
    return {**row, "evidence_key": evidence_key, "set": name}


def heldout_prompts(
    args: argparse.Namespace,
    heldout: Sequence[Question],
    pool: Sequence[Question],
    ordinary_ids: Sequence[str] | None = None,
) -> list[dict]:
    """`heldout_rows` and the ordinary questions' rows (`ordinary_questions`), without the worked example under
    `--no-example`."""
    ordinary = [without_evidence(q, ORDINARY, None) for q in ordinary_questions(args, pool, ordinary_ids)]
    rows = heldout_rows(heldout, pool) + [{**row, "prompt_id": f"{row['run_id']}:{ORDINARY}"} for row in ordinary]
    return [{**row, "prompt": without_example(row["prompt"])} for row in rows] if args.no_example else rows


def without_example(prompt: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The respondent's chat prompt without its worked example (system, question): the `--no-example` arm, whose
    policy has no example's reasoning and letter to copy."""
    roles = [m["role"] for m in prompt]
    if roles != ["system", "user", "assistant", "user"]:
        raise ValueError(f"not a respondent prompt with a worked example: roles {roles}")
    return [dict(prompt[0]), dict(prompt[3])]


def training_dataset(export: Path, no_example: bool) -> Path:
    """The exported GRPO dataset, or (`no_example`) a copy of it whose prompts have no worked example."""
    if not no_example:
        return export / "dataset"
    from datasets import load_from_disk

    stripped = load_from_disk(str(export / "dataset")).map(lambda row: {"prompt": without_example(row["prompt"])})
    stripped.save_to_disk(str(export / "dataset-no-example"))
    return export / "dataset-no-example"


def measure(
    model_dir: str, rows: Sequence[dict[str, Any]], tokens: int, replies_file: Path, reuse: bool = False
) -> list[dict[str, Any]]:
    """Greedy replies to every held-out prompt, kept in `replies_file` in the rows' order. `reuse`: a reply the file
    holds to the very same prompt, budget and model (`asked_as`) is kept, and only the others are asked (a set
    added later costs its own prompts only)."""
    stamp = model_stamp(model_dir)
    keys = {row["prompt_id"]: asked_as(row, tokens, stamp) for row in rows}
    earlier = {r["asked_as"]: r for r in read_replies(replies_file) or [] if "asked_as" in r} if reuse else {}
    asked = [row for row in rows if keys[row["prompt_id"]] not in earlier]
    replies = generate(f"hf:{model_dir}", [row["prompt"] for row in asked], tokens, respondent.STOP) if asked else []
    fresh = {row["prompt_id"]: kept_reply(row, reply, keys[row["prompt_id"]]) for row, reply in zip(asked, replies)}
    kept = [earlier.get(keys[row["prompt_id"]]) or fresh[row["prompt_id"]] for row in rows]
    write_replies(replies_file, kept)
    return kept


def asked_as(row: dict[str, Any], tokens: int, stamp: str) -> str:
    """What a reply answers: its prompt (options and distractors included), the budget and the model's stamp."""
    asked = json.dumps([row["prompt"], row["gold"], row["evidence_key"], tokens, stamp], sort_keys=True)
    return hashlib.sha256(asked.encode()).hexdigest()[:24]


def kept_reply(row: dict[str, Any], reply: str, asked: str) -> dict[str, Any]:
    """What is kept of one reply: the prompt's id and set, the reply, what it answers and what it is read against."""
    parsed = respondent.parse_answer(reply, row["options"])
    return {
        "prompt_id": row["prompt_id"],
        "asked_as": asked,
        "set": row["set"],
        "reply": reply,
        "answer": parsed["answer"],
        "well_formed": parsed["well_formed"],
        "gold": row["gold"],
        "evidence_key": row["evidence_key"],
        "example_key": worked_example_answer(row["prompt"]),
        "quoted_key": quoted_option(reply, row["options"]),
    }


def quoted_option(reply: str, options: dict[str, str]) -> str | None:
    """The option whose text the reply's reasoning quotes (the longest where several do), else None: whether it
    read the evidence's line, apart from whether it then wrote that option as its answer."""
    reasoning = " ".join(reply.split("</think>")[0].split()).casefold()
    quoted = [k for k, text in options.items() if text.strip() and " ".join(text.split()).casefold() in reasoning]
    return max(quoted, key=lambda k: len(options[k])) if quoted else None


def refigure(out: Path, rows: Sequence[dict[str, Any]]) -> None:
    """`--refigure`: a record's figures computed again from its kept replies, with the quoted option added to the
    replies kept before it was measured (`quoted_option`, read off the rebuilt prompts' options)."""
    record = json.loads(out.read_text())
    replies = out.parent / out.stem / "replies"
    options = {row["prompt_id"]: row["options"] for row in rows}

    def again(name: str) -> list[dict[str, Any]]:
        kept = kept_replies(replies / name, rows)
        if kept is None:
            raise SystemExit(f"{replies / name}: no replies kept for these prompts (its --ordinary-questions?)")
        kept = [{**k, "quoted_key": quoted_option(k["reply"], options[k["prompt_id"]])} for k in kept]
        write_replies(replies / name, kept)
        return kept

    before = again("before.jsonl.gz")
    record["before"] = figures(before)
    record["settings"]["ordinary_ids"] = [row["run_id"] for row in rows if row["set"] == ORDINARY]
    for run in record["runs"]:
        after = again(f"seed{run['seed']}_after.jsonl.gz")
        run["after"] = figures(after)
        run["ordinary_change"] = ordinary_change(before, after)
    record["seeds"] = summary(record["before"], [r["after"] for r in record["runs"]], record["baselines"])
    replace_text(out, json.dumps(record, indent=1) + "\n")


def kept_replies(path: Path, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The replies an earlier run kept at `path` to these very prompts, in their order, else None."""
    replies = read_replies(path)
    if replies is None or [r["prompt_id"] for r in replies] != [r["prompt_id"] for r in rows]:
        return None
    return replies


def figures(kept: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per set: follow rate (answer = X), accuracy, well formed, modal answer share, and the share of answers that
    are the worked example's letter (where the replies kept it: the pull a policy can learn to follow instead)."""
    result: dict[str, Any] = {}
    for name in [f"d{d}" for d in DISTRACTOR_COUNTS] + ["gold_evidence", "no_evidence", ORDINARY]:
        replies = [k for k in kept if k["set"] == name]
        n = len(replies)
        if name == ORDINARY and not replies:
            continue  # a record made before the ordinary set existed
        result[name] = {
            "accuracy": share(sum(k["answer"] == k["gold"] for k in replies), n),
            "well_formed": share(sum(k["well_formed"] for k in replies), n),
            "modal_answer_share": modal_share([k["answer"] for k in replies]),
        }
        if replies and all("example_key" in k for k in replies):
            copied = sum(k["answer"] is not None and k["answer"] == k["example_key"] for k in replies)
            result[name]["example_letter"] = share(copied, n)
        if name == ORDINARY:
            continue  # no X: nothing to follow or to quote
        result[name]["follow_rate"] = share(sum(k["answer"] == k["evidence_key"] for k in replies), n)
        if replies and all("quoted_key" in k for k in replies):
            # reading the line (its reasoning quotes X's text) apart from answering it
            result[name]["quotes_evidence"] = share(sum(k["quoted_key"] == k["evidence_key"] for k in replies), n)
            answered = sum(k["answer"] is not None and k["answer"] == k["quoted_key"] for k in replies)
            result[name]["answers_what_it_quoted"] = share(answered, n)
    return result


def ordinary_change(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The after's accuracy on the ordinary questions against the before's, question by question (None where
    they were not asked)."""
    right_after = {a["prompt_id"]: a["answer"] == a["gold"] for a in after if a["set"] == ORDINARY}
    right_before = {b["prompt_id"]: b["answer"] == b["gold"] for b in before if b["set"] == ORDINARY}
    if right_after.keys() != right_before.keys():
        raise ValueError("the before and the after answered different ordinary questions")
    pairs = [(right_before[i], right_after[i]) for i in right_before]
    return paired_change(*zip(*pairs)) if pairs else None


def follow_baselines(rows: Sequence[dict[str, Any]], before: dict[str, Any]) -> dict[str, Any]:
    """What trivial answers score on the counterfactual question: chance, the base model without evidence naming
    X, and copying the worked example's letter."""
    counterfactual = [r for r in rows if r["set"] == "d2"]
    n = len(counterfactual)
    copies = sum(worked_example_answer(r["prompt"]) == r["evidence_key"] for r in counterfactual)
    return {
        "chance": round(sum(1 / len(r["options"]) for r in counterfactual) / max(n, 1), 4),
        "no_evidence": before["no_evidence"]["follow_rate"],
        "copy_example": share(copies, n),
    }


def seed_export(
    args: argparse.Namespace, pool: Sequence[Question], seed: int, folder: Path, limit: int
) -> tuple[str, dict[str, int]]:
    """This seed's own export of `limit` questions (the product's `export grpo --questions` code) into `folder`:
    the dataset to train on and the export's counts, with its prompts per kind."""
    from collections import Counter

    from datasets import load_from_disk

    # Written afresh: an export resumes by question id, so an older one left in --work (other kinds, other
    # size) would be trained on again; writing it takes seconds. `--reuse` keeps trained models, not exports.
    shutil.rmtree(folder, ignore_errors=True)
    counts = export_evidence_prompts(pool, export_config(seed, folder, limit), progress=False)
    kinds = Counter(load_from_disk(str(folder / "dataset"))["kind"])
    return str(training_dataset(folder, args.no_example)), {**counts, "kinds": dict(sorted(kinds.items()))}


def resumable_settings(seed: int) -> dict[str, Any]:
    """A seed's training: its own seed, checkpoints every 10 steps, and a killed run going on from the last."""
    return {"seed": seed, "save_steps": 10, "resume": True}


def warm_start(args: argparse.Namespace, model_path: str, pool: Sequence[Question], seed: int, work: Path) -> dict:
    """`--sft-prompts`: this seed's own export of that many questions (the GRPO prompts are its first ones), the
    product's SFT on their reference replies from the base model, merged; returns the run's record."""
    dataset, counts = seed_export(args, pool, seed, work / f"sft-export-s{seed}", args.sft_prompts)
    training = SFTTrainingConfig(
        model=model_path,
        dataset=dataset,
        output_dir=str(work / f"sft-out-s{seed}"),
        num_train_epochs=args.sft_epochs,
        per_device_train_batch_size=4,
        **resumable_settings(seed),
    )
    run = trained(SimpleNamespace(reuse_trained=args.reuse), training, work / f"sft-merged-s{seed}", train_sft)
    return {**run, "export": counts, "epochs": args.sft_epochs}


def train_seed(args: argparse.Namespace, model_path: str, pool: Sequence[Question], seed: int, work: Path) -> dict:
    """Export this seed's own prompts, train GRPO from the base model (or from its warm start, `--sft-prompts`),
    merge; returns the run's record. With `--steps 0` the warm-started model is the one measured."""
    sft = warm_start(args, model_path, pool, seed, work) if args.sft_prompts else None
    changes = "training sample, order, kinds and distractors; LoRA init, data order and sampled rollouts"
    if sft:
        log(f"seed {seed}: SFT warm start on {sft['export']['rows']} prompts, {sft['minutes']} min")
        model_path = sft.pop("merged")
        sft.pop("plot_path")
        if not args.steps:
            return {
                "steps": 0,
                "minutes": sft["minutes"],
                "merged": model_path,
                "reused": sft["reused"],
                "sft": sft,
                "seed_changes": changes,
            }
    dataset, counts = seed_export(args, pool, seed, work / f"export-s{seed}", args.train_prompts)
    training = GRPOTrainingConfig(
        model=model_path,
        dataset=dataset,
        output_dir=str(work / f"grpo-out-s{seed}"),
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        num_generations=args.generations,
        per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=args.prompts_per_step,
        max_completion_length=args.tokens,
        temperature=args.temperature,
        **resumable_settings(seed),
    )
    reuse = SimpleNamespace(reuse_trained=args.reuse)
    starts_from = {"warm_start": model_stamp(model_path)} if sft else None  # a warm start trained again: GRPO too
    run = trained(reuse, training, work / f"grpo-merged-s{seed}", train_grpo, starts_from)
    return {
        **run,
        "export": counts,
        "sft": sft,
        "seed_changes": changes,
    }


def summary(before: dict[str, Any], afters: Sequence[dict[str, Any]], baselines: dict[str, Any]) -> dict[str, Any]:
    def over(set_name: str, metric: str) -> dict[str, Any]:
        return {
            "before": before[set_name][metric]["rate"],
            "after": spread([a[set_name][metric]["rate"] for a in afters]),
        }

    return {
        "n": len(afters),
        "follow_rate": {f"d{d}": over(f"d{d}", "follow_rate") for d in DISTRACTOR_COUNTS},
        "accuracy_gold_evidence": over("gold_evidence", "accuracy"),
        "accuracy_no_evidence": over("no_evidence", "accuracy"),
        "well_formed_d2": over("d2", "well_formed"),
        # against the baselines and the same trained model without evidence (one answer whatever the evidence
        # says would otherwise "follow" as often as its letters happen to be X)
        "seeds_beating_baselines_d2": sum(
            beats_baselines(
                a["d2"]["follow_rate"]["rate"], {**baselines, "own_no_evidence": a["no_evidence"]["follow_rate"]}
            )
            for a in afters
        ),
        "own_no_evidence_follow_rate": [a["no_evidence"]["follow_rate"]["rate"] for a in afters],
        "no_evidence_accuracy_not_below_before": [
            a["no_evidence"]["accuracy"]["rate"] >= before["no_evidence"]["accuracy"]["rate"] for a in afters
        ],
        **(
            {
                "accuracy_ordinary": over(ORDINARY, "accuracy"),
                "ordinary_accuracy_not_below_before": [
                    a[ORDINARY]["accuracy"]["rate"] >= before[ORDINARY]["accuracy"]["rate"] for a in afters
                ],
            }
            if ORDINARY in before and all(ORDINARY in a for a in afters)
            else {}
        ),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--work", default=str(LEARNING_WORK / "evidence_following"))
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="with --reuse: add seeds K.. to the recorded ones")
    parser.add_argument("--reuse", action="store_true", help="reuse the before and the seeds a run finished")
    parser.add_argument("--eval-questions", type=int, default=48)
    parser.add_argument(
        "--ordinary-questions",
        type=int,
        default=240,
        help="more held-out questions without evidence, unseen by every seed's training: whether training cost "
        "the model what it knew (0: none, as records before them)",
    )
    parser.add_argument("--train-prompts", type=int, default=96, help="GRPO prompts each seed draws")
    parser.add_argument("--max-question-chars", type=int, default=300)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=96, help="respondent budget in training and measurement")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument(
        "--no-example",
        action="store_true",
        help="a lever: the respondent's prompts without the worked example, in training and measurement (the "
        "base model answers the example's letter in about half its replies, and GRPO learned to copy it whole)",
    )
    parser.add_argument(
        "--sft-prompts",
        type=int,
        default=0,
        help="a lever: warm-start each seed with the product's SFT (`train_sft`) on the reference replies of this "
        "many exported prompts before GRPO (0: none; the base model cannot map a quoted option's text to its "
        "letter, results/evidence_letter_probe.json)",
    )
    parser.add_argument("--sft-epochs", type=float, default=1.0, help="epochs of the warm start")
    parser.add_argument(
        "--refigure", action="store_true", help="compute --out's figures again from its kept replies, and stop"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and tiny sizes: the pipeline")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
        args.work = str(Path(args.work) / "smoke")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    data = Path(args.data)
    if not (data / "benchmarks").is_dir():
        raise SystemExit(f"no benchmarks under {data} (pass --data or set ERMEDRAG_SHARED_DATA)")
    if args.refigure:  # kept replies only: no model, and the work folder left to a run in progress
        recorded = json.loads(Path(args.out).read_text())["settings"].get("ordinary_ids")
        heldout, pool = pools(data, args.max_question_chars, args.eval_questions)
        refigure(Path(args.out), heldout_prompts(args, heldout, pool, recorded))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    hold_work_folder(work)
    if args.smoke:
        from ermedrag.testing.tiny_model import build_tiny_causal_lm

        model_path = build_tiny_causal_lm(work / "tiny")
    else:
        from ermedrag.tools.models.offline import offline_model_dir

        model_path = str(offline_model_dir())
    out = Path(args.out) if not args.smoke else work / "evidence_following.json"
    replies = out.parent / out.stem / "replies"
    heldout, pool = pools(data, args.max_question_chars, args.eval_questions)
    earlier = json.loads(out.read_text()) if args.reuse and out.exists() else {}
    rows = heldout_prompts(args, heldout, pool, earlier.get("settings", {}).get("ordinary_ids"))
    started = time.time()
    before_replies = measure(model_path, rows, args.tokens, replies / "before.jsonl.gz", args.reuse)
    before = figures(before_replies)
    log(f"before: d2 follow {before['d2']['follow_rate']}, no-evidence accuracy {before['no_evidence']['accuracy']}")
    baselines = follow_baselines(rows, before)
    runs = [r for r in earlier.get("runs", []) if r["seed"] < args.first_seed]
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run = train_seed(args, model_path, pool, seed, work)
        after_file = replies / f"seed{seed}_after.jsonl.gz"
        after_replies = measure(run["merged"], rows, args.tokens, after_file, args.reuse)
        after = figures(after_replies)
        log(f"seed {seed}: d2 follow {after['d2']['follow_rate']} ({run['minutes']} min)")
        runs.append(
            {
                "seed": seed,
                **{k: v for k, v in run.items() if k not in ("merged", "plot_path")},
                "after": after,
                "ordinary_change": ordinary_change(before_replies, after_replies),
            }
        )
        write(out, args, rows, before, baselines, runs, started)
    write(out, args, rows, before, baselines, runs, started)
    return 0


def write(out: Path, args: argparse.Namespace, rows: list, before: dict, baselines: dict, runs: list, started):
    result = {
        "seeds": summary(before, [r["after"] for r in runs], baselines) if runs else {"n": 0},
        "baselines": baselines,
        "before": before,
        "runs": runs,
        "settings": {
            "model": "tiny random model" if args.smoke else "gemma3-270m (hf, offline)",
            "benchmarks": list(BENCHMARKS),
            "eval_questions": args.eval_questions,
            "ordinary_questions": args.ordinary_questions,
            "ordinary_unseen_by_seeds": args.first_seed + args.seeds,
            "ordinary_ids": [row["run_id"] for row in rows if row["set"] == ORDINARY],
            "train_prompts_per_seed": args.train_prompts,
            "steps": args.steps,
            "generations": args.generations,
            "prompts_per_step": args.prompts_per_step,
            "tokens": args.tokens,
            "temperature": args.temperature,
            "learning_rate": args.learning_rate,
            "rewards": "the respondent's defaults (training.rewards.RESPONDENT_REWARDS)",
            "worked_example": not args.no_example,
            "sft_warm_start": {"prompts": args.sft_prompts, "epochs": args.sft_epochs} if args.sft_prompts else None,
        },
    }
    write_with_provenance(out, result, started)


def write_with_provenance(out: Path, result: dict[str, Any], started: float) -> None:
    """The result with where and how it was made (machine, load average, minutes, command), written whole."""
    made = {
        "machine": describe_machine(),
        "load_average": list(os.getloadavg()),
        "minutes": round((time.time() - started) / 60, 1),
        "command": " ".join(["python", *sys.argv]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_text(out, json.dumps({**result, **made}, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
