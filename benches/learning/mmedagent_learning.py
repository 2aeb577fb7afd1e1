"""MMedAgent-RL on CPU: does each stage move what it rewards, and does the entropy bonus raise the entropy?

The staged trainer of `training.mmedagent` (triage, then the attending's curriculum easy → medium → hard), with
LoRA on the offline model, on questions of the shared data whose benchmark metadata names a specialty
(`tools.specialties`: MedMCQA dev Pathology/Radiology/Surgery/Orthopaedics/Ophthalmology/Skin, MedXpertQA
Endocrine/Integumentary). The questions are split into train and held-out with a fixed seed (by default the
same number per specialty, so the majority class is no shortcut).

(a) Triage: the triage doctor's prompts (`agents.triage.triage_messages`, the paper's seven specialties).
    Held-out accuracy (the specialty `parse_triage` reads == the gold one) before and after the triage stage,
    against chance (1/7) and the held-out majority-class rate.
(b) Attending: three *scripted* specialists of known reliability answer every question (no model): specialist 1
    is right 80% of the time, 2 50%, 3 20%; a wrong one names a uniformly random other option (seeded). Their
    opinions are frozen in the attending's prompt (`agents.attending.attending_messages`), the prompts are
    bucketed by agreement (`specialist_agreement`, `bucket`) and the attending trains easy → medium → hard.
    Held-out accuracy before and after each stage, against what the opinions allow on the same prompts: the
    specialists' majority vote, always trusting specialist 1, the best single specialist in hindsight, and
    "some specialist is right".
(c) Entropy: the `--entropy-stage` (default hard) is trained a second time from the same start model with
    `entropy_bonus: false`; TRL's logged mean token entropy per step, with and without the bonus.

Held-out prompts are rolled out greedily with the training rollouts' own stop (`</answer>`) and scored with the
stage's reward functions. Writes benches/results/mmedagent_learning.json and curve PNGs next to it (`--smoke`:
in the work folder).

    .venv/bin/python benches/learning/mmedagent_learning.py              # one run; prints its estimated minutes
    .venv/bin/python benches/learning/mmedagent_learning.py --seeds 3    # the stages trained 3 times
    .venv/bin/python benches/learning/mmedagent_learning.py --seeds 3 --reuse   # go on: finished seeds are kept
    .venv/bin/python benches/learning/mmedagent_learning.py --smoke      # tiny random model, < 1 min: the pipeline
    .venv/bin/python benches/learning/mmedagent_learning.py --parts triage --seeds 3 --sft-epochs 1 \\
        --sft-questions 240 --triage-steps 0     # the triage's SFT warm start alone (add GRPO: --triage-steps 16)
    .venv/bin/python benches/learning/mmedagent_learning.py --parts attending --seeds 3 --sft-epochs 1 \\
        --sft-questions 96 --easy-steps 0 --medium-steps 0 --hard-steps 0   # the attending's warm start alone

`--sft-epochs E` warm-starts each seed's triage and attending first with the product's SFT (`train_sft`, the
`sft_triage` and `sft_attending` presets) on the reference replies (`agents.triage.reference_reply`,
`agents.attending.reference_reply`: the gold answer, naming the specialists who gave it) of its training questions,
plus more drawn from those not held out up to `--sft-questions` (the attending's with their gold answers balanced
over the positions and opinions of their own); the triage's GRPO stage and the attending's curriculum go on from
the merged models. A seed's warm starts live beside its training folder (`train-sft`, `train-sft-attending`,
`train-s1-sft`), so `--reuse` takes them into a run that changes only the GRPO after them (`--triage-steps 0`, then
`--triage-steps 16 --reuse`: the warm starts are not trained again). A stage of 0 steps passes its start model on.

With `--seeds N` triage and the attending's curriculum are trained N times from the base model (training seeds
42, 43, …: LoRA initialisation, data order, sampled rollouts; from the second seed on, also a training sample of
the seed's own, drawn from the questions not held out, with opinions of its own; the held-out questions and their
opinions stay those of `--seed`); the base model's befores are measured once. `seeds` in the JSON reports per part and metric before and
after as mean ± sd, the gain, and how many seeds improved it. The entropy ablation (c) runs for the first seed.

Without the shared data (`--data`, ERMEDRAG_SHARED_DATA, else ../shared/data) it says so and exits 0.

What it cannot show: the budget is a few dozen GRPO steps with 4 samples each, so held-out accuracies on 24
prompts move by single prompts (±0.04 each); the bucket sizes follow the reliabilities (P(easy) = P(hard) = 0.08),
so easy and hard train on a handful of prompts; and the triage labels come from two benchmarks whose formats
differ (MedXpertQA's long 10-option vignettes are every Endocrinologist case and most Dermatologist ones), so a
triage gain may be format, not medicine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ermedrag.offline import go_offline
from ermedrag.tools.machine import describe_machine

REPO = Path(__file__).resolve().parents[2]
go_offline()
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, imported by file name
from kept_replies import replies_path, write_replies  # noqa: E402

BENCHMARK_FILES = ("medmcqa_dev.jsonl", "medxpertqa_text_test.jsonl")
TRAINING_SEED = 42  # the first seed's; --first-seed K --seeds N trains with 42 + K .. 42 + K + N - 1
SEED_CHANGES = (
    "its own training questions (drawn from those not held out) and specialists' opinions, LoRA initialisation, "
    "data order, sampled rollouts"
)
ATTENDING_STAGES = ("easy", "medium", "hard")
SFT_TRIAGE_DIR = "sft-triage"  # the warm starts' rows in a seed's export folder (`--sft-epochs`)
SFT_ATTENDING_DIR = "sft-attending"
# Per role: the product's SFT preset, the warm start's rows in the export folder, its folder beside the seed's training one
WARM_STARTS = {
    "triage": ("sft_triage", SFT_TRIAGE_DIR, "-sft"),
    "attending": ("sft_attending", SFT_ATTENDING_DIR, "-sft-attending"),
}
PARTS = ("triage", "attending")
RELIABILITIES = (0.8, 0.5, 0.2)  # specialist 1, 2, 3: probability of naming the gold option
# How the held-out attending rows place their gold answers (recorded in settings; absent: as the benchmark has them)
BALANCED_POSITIONS = "balanced (evals.baselines.balanced_positions)"
# The smoke keeps the full run's training split (same questions, same opinions, so the same buckets: every stage
# trains) with a tiny model, a few steps and short budgets.
SMOKE_SIZES = dict(
    train_questions=48,
    eval_questions=12,
    triage_steps=2,
    easy_steps=1,
    medium_steps=2,
    hard_steps=2,
    generations=2,
    triage_tokens=16,
    attending_tokens=16,
    eval_batch=6,
)
# Seconds per GRPO step of the 270M model on 2 cores, 4 generations (benches/README.md: the respondent's GRPO,
# 96 tokens, 42 s/step; Med-R³ stage 1, up to 192 tokens, ~60 s/step), scaled by the token budget; the attending's
# prompts here are ~500 tokens, the triage's ~280. Used only for the estimate printed in the settings.
SECONDS_PER_STEP_PER_TOKEN = 42 / 96 * 1.1  # +10%: the KL reference pass (β > 0), which that run had not
# Greedy held-out rollouts, per prompt and token of budget: measured with this script's evaluation on 4 held-out
# prompts of each kind (triage 64 tokens 16 s, attending 96 tokens 27 s, model load included) on one thread of a
# busy 2-core machine, times 0.7 for two threads.
EVAL_SECONDS_PER_PROMPT_PER_TOKEN = 0.045
# The triage's SFT warm start, per row and epoch: 240 rows, one epoch, batch 4 in 38.1 min (2026-12-07, load 1.6-1.8);
# the attending's, scaled by its longer prompts (~500 tokens to ~280).
SFT_SECONDS_PER_ROW = {"triage": 9.5, "attending": 17.0}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------ data


def benchmarks_dir(data: str) -> Path | None:
    """The folder holding both benchmark files (`data` is the shared root or its benchmarks/), else None."""
    root = Path(data).expanduser()
    for folder in (root / "benchmarks", root):
        if all((folder / name).is_file() for name in BENCHMARK_FILES):
            return folder
    return None


def labelled_questions(folder: Path, max_chars: int) -> dict[str, list[Any]]:
    """Questions with a gold specialty, by specialty, each list sorted by id; a question whose text and
    options exceed `max_chars` is left out (it bounds the prompt length, so the CPU time of a step)."""
    from ermedrag.tools.data.benchmarks import load_benchmark
    from ermedrag.tools.data.specialties import gold_specialty_for

    by_specialty: dict[str, list[Any]] = {}
    for name in ("medmcqa", "medxpertqa"):
        for question in load_benchmark(name, folder):
            specialty = gold_specialty_for(question)
            size = len(question.question) + sum(len(text) for text in question.options.values())
            if specialty and question.options and question.answer in question.options and size <= max_chars:
                by_specialty.setdefault(specialty, []).append(question)
    return {s: sorted(qs, key=lambda q: q.id) for s, qs in sorted(by_specialty.items())}


def split_questions(
    by_specialty: dict[str, list[Any]], n_train: int, n_eval: int, seed: int, sampling: str, train_draw: int = 0
) -> tuple[list[Any], list[Any]]:
    """Train and held-out questions, disjoint, drawn with `seed`. `balanced`: the same number per specialty in
    each (round robin; a specialty that runs out leaves its turn to the others); `natural`: as the data has them.
    The held-out ones depend on `seed` alone; `train_draw` 0 takes the training questions drawn with them, another
    value draws a training sample of its own from every question not held out (a training seed's own sample)."""
    rng = random.Random(seed)
    pools = {s: rng.sample(qs, len(qs)) for s, qs in by_specialty.items()}
    if sampling == "natural":
        everything = rng.sample([q for qs in pools.values() for q in qs], sum(map(len, pools.values())))
        train, held_out = everything[:n_train], everything[n_train : n_train + n_eval]
    else:
        train, held_out = round_robin(pools, n_train), round_robin(pools, n_eval)
    if train_draw == 0:
        return train, held_out
    own = random.Random(f"train:{seed}:{train_draw}")
    rest = shuffled_rest(by_specialty, {q.id for q in held_out}, own)
    if sampling == "natural":
        return own.sample([q for qs in rest.values() for q in qs], min(n_train, sum(map(len, rest.values())))), held_out
    return round_robin(rest, n_train), held_out


def shuffled_rest(by_specialty: dict[str, list[Any]], used: set[str], rng: random.Random) -> dict[str, list[Any]]:
    """Each specialty's questions whose ids are not in `used`, shuffled with `rng` (a draw of its own)."""
    rest = {s: [q for q in qs if q.id not in used] for s, qs in by_specialty.items()}
    return {s: rng.sample(qs, len(qs)) for s, qs in rest.items()}


def round_robin(pools: dict[str, list[Any]], n: int) -> list[Any]:
    """Up to `n` items taken from the pools in turn (each pool shrinks: later draws get other items)."""
    drawn: list[Any] = []
    while len(drawn) < n and any(pools.values()):
        for pool in pools.values():
            if pool and len(drawn) < n:
                drawn.append(pool.pop())
    return drawn


def warm_start_questions(
    by_specialty: dict[str, list[Any]], train: Sequence[Any], held_out: Sequence[Any], n: int, draw: str
) -> list[Any]:
    """The SFT warm start's questions: the GRPO training ones, then more taken in turn per specialty (`round_robin`)
    from those neither held out nor trained on, drawn with `draw`, up to `n` in all: the held-out set stays the
    split's whatever `n` is."""
    rest = shuffled_rest(by_specialty, {q.id for q in (*train, *held_out)}, random.Random(f"sft:{draw}"))
    return [*train, *round_robin(rest, max(0, n - len(train)))]


def triage_rows(questions: Sequence[Any]) -> list[dict[str, Any]]:
    """The triage stage's rows, as `ermedrag export mmedagent` writes them."""
    from ermedrag.agents import triage
    from ermedrag.agents.base import to_chat
    from ermedrag.tools.data.specialties import gold_specialty_for

    specialties = list(triage.SPECIALTIES)
    return [
        {
            "prompt": to_chat(triage.triage_messages(q.question, q.options, specialties)),
            "gold_specialty": gold,
            "reference_reply": triage.reference_reply(gold),
            "specialties": specialties,
            "question": q.question,
            "id": q.id,
        }
        for q, gold in ((q, gold_specialty_for(q)) for q in questions)
    ]


def scripted_opinions(
    question: Any, specialty: str, rng: random.Random, reliabilities: Sequence[float]
) -> list[dict[str, Any]]:
    """One opinion per specialist: the gold option with the specialist's reliability, else a uniformly random
    other option. The reasoning has the same shape either way, so only the answer carries the signal."""
    from ermedrag.agents import specialist

    keys = sorted(question.options)
    opinions = []
    for index, reliability in enumerate(reliabilities, 1):
        wrong = [k for k in keys if k != question.answer]
        answer = question.answer if rng.random() < reliability or not wrong else rng.choice(wrong)
        text = " ".join(str(question.options[answer]).split())[:80]
        opinions.append(
            specialist.Opinion(
                specialist=index,
                specialty=specialty,
                model=f"scripted p={reliability}",
                answer=answer,
                reasoning=f"The findings fit option {answer} ({text}) best.",
                ok=True,
                well_formed=True,
            )
        )
    return opinions


def attending_rows(
    questions: Sequence[Any], rng: random.Random, reliabilities: Sequence[float]
) -> list[dict[str, Any]]:
    """The attending's rows with their frozen opinions, bucketed by agreement as the export buckets them."""
    from ermedrag.agents import attending
    from ermedrag.agents.base import to_chat
    from ermedrag.tools.data.specialties import gold_specialty_for

    rows = []
    for q in questions:
        specialty = gold_specialty_for(q)
        opinions = scripted_opinions(q, specialty, rng, reliabilities)
        answers = [o["answer"] for o in opinions]
        agreement = attending.specialist_agreement(answers, q.answer)
        rows.append(
            {
                "prompt": to_chat(attending.attending_messages(q.question, q.options, opinions)),
                "gold": q.answer,
                "options": q.options,
                "agreement": agreement,
                "bucket": attending.bucket(agreement),
                "majority": attending.majority(answers),
                "specialty": specialty,
                "specialist_answers": answers,
                "reference_reply": attending.reference_reply(q.answer, answers, q.options),
                "question": q.question,
                "id": q.id,
            }
        )
    return rows


def ceilings(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the opinions allow on these prompts: the majority vote (a tie is no answer, so wrong), always
    trusting specialist 1 (the most reliable by construction), the best single specialist in hindsight, and the
    share of prompts where some specialist is right (an attending that only picks among them can do no better)."""
    n = len(rows)
    n_specialists = len(rows[0]["specialist_answers"]) if rows else 0
    per_specialist = [sum(r["specialist_answers"][i] == r["gold"] for r in rows) / n for i in range(n_specialists)]
    return {
        "majority_vote": round(sum(r["majority"] == r["gold"] for r in rows) / n, 4),
        "trust_best": round(per_specialist[0], 4),
        "best_single": round(max(per_specialist), 4),
        "per_specialist": [round(a, 4) for a in per_specialist],
        "any_specialist_right": round(sum(r["bucket"] != "hard" for r in rows) / n, 4),
    }


def save_dataset(rows: Sequence[dict[str, Any]], folder: Path) -> None:
    """`folder/dataset` (datasets.save_to_disk) and `folder/data.jsonl`: the layout of an export folder."""
    from datasets import Dataset

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    with (folder / "data.jsonl").open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    Dataset.from_list(list(rows)).save_to_disk(str(folder / "dataset"))


# Words a case of each specialty tends to use (stems matched at the start of a word, any case): the keyword baseline.
KEYWORDS: dict[str, tuple[str, ...]] = {
    "Pathologist": ("biops", "histolog", "microscop", "stain", "specimen", "necros", "granulom", "autops", "cytolog"),
    "Radiologist": ("x-ray", "radiograph", "ct ", "mri", "ultrasound", "sonograph", "imaging", "scan", "radiat"),
    "Surgeon": ("surg", "operat", "incision", "fractur", "laparot", "resect", "hernia", "appendic", "wound", "bone"),
    "Oncologist": ("cancer", "carcinom", "chemotherap", "metasta", "lymphom", "leukem", "malignan", "tumou", "tumor"),
    "Endocrinologist": ("thyroid", "insulin", "diabet", "cortisol", "adrenal", "pituitar", "hormon", "glucose", "tsh"),
    "Ophthalmologist": ("eye", "retin", "vision", "visual", "cornea", "glaucom", "catarac", "optic", "pupil", "lens"),
    "Dermatologist": ("skin", "rash", "lesion", "plaque", "papul", "macul", "prurit", "derm", "nail", "scal"),
}


def keyword_specialty(text: str, specialties: Sequence[str]) -> str:
    """The listed specialty whose KEYWORDS the text uses most (ties and no hit: the first listed)."""
    folded = text.lower()
    hits = {
        s: sum(len(re.findall(r"\b" + re.escape(word), folded)) for word in KEYWORDS.get(s, ())) for s in specialties
    }
    return max(specialties, key=lambda s: (hits[s], -list(specialties).index(s)))


def case_keyword(question: Any, specialties: Sequence[str]) -> str:
    """The keyword rule's specialty for a benchmark question (its text and options)."""
    return keyword_specialty(question.question + " " + " ".join((question.options or {}).values()), specialties)


def copied_example(parsed: Any, example: str | None) -> bool:
    """A parsed triage reply names the worked example's specialty."""
    from ermedrag.agents import triage

    return example is not None and triage.find_specialty(parsed["answer"] or "", [example]) is not None


def reply_key(parsed: Any) -> str:
    """What a triage reply said, for counting replies alike: the specialty it named, else its answer (any case)."""
    from ermedrag.agents.base import fold_case

    return parsed["specialty"] if parsed["ok"] else fold_case(parsed["answer"] or "")


def triage_baselines(questions: Sequence[Any], prompts: Sequence[Sequence[Any]], specialties: Sequence[str]) -> dict:
    """What trivial triage scores on these held-out questions (`evals.baselines`: chance, the majority class,
    always the first listed specialty, copying the worked example) and the keyword rule."""
    from ermedrag.evals.baselines import share, trivial_baselines
    from ermedrag.tools.data.specialties import gold_specialty_for

    golds = [gold_specialty_for(q) for q in questions]
    keyword = [case_keyword(q, specialties) for q in questions]
    return {
        **trivial_baselines(golds, [list(specialties)] * len(golds), prompts),
        "keyword": share(sum(k == g for k, g in zip(keyword, golds)), len(golds)),
    }


# ---------------------------------------------------------------------------------------------- evaluation


def greedy_rollouts(
    model_dir: str, prompts: Sequence[list[dict[str, str]]], max_new_tokens: int, stops: Sequence[str], batch: int
) -> tuple[list[str], list[int]]:
    """Greedy completions of chat prompts with the training rollouts' own loop (`training.rollouts`: it ends at
    a stop string, kept, EOS or the budget), batched by prompt length; the model is freed afterwards."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from ermedrag.training.grpo.rollouts import run_search_rollouts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for p in prompts
    ]
    generation = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # less padding per batch
    texts: list[str] = [""] * len(prompt_ids)
    tokens: list[int] = [0] * len(prompt_ids)
    with torch.no_grad():
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            rollouts = run_search_rollouts(
                model,
                tokenizer,
                [prompt_ids[i] for i in chunk],
                generation_config=generation,
                search=None,
                step_max_new_tokens=max_new_tokens,
                max_total_tokens=max_new_tokens,
                end_stops=tuple(stops),
                force_answer=False,
            )
            for i, rollout in zip(chunk, rollouts):
                texts[i], tokens[i] = rollout.model_text, rollout.generated_tokens
    del model
    gc.collect()
    return texts, tokens


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


def _weighted_total(rewards, completions, columns) -> tuple[dict[str, float], float]:
    scores = {r.func.__name__: r.func(completions, **columns) for r in rewards}  # curve names, as TRL logs them
    total = [sum(r.weight * (scores[r.func.__name__][i] or 0.0) for r in rewards) for i in range(len(completions))]
    return {name: _mean([v or 0.0 for v in values]) for name, values in scores.items()}, _mean(total)


def evaluate_triage(
    model_dir: str, rows: Sequence[dict[str, Any]], staged, args: argparse.Namespace, label: str
) -> dict:
    """Held-out triage: accuracy, format, rewards, what it predicted, how often it copied the worked example and
    the share of its most common reply (a collapse detector); the replies kept in `args.replies_dir/triage_LABEL`."""
    from ermedrag.agents import triage
    from ermedrag.evals.baselines import modal_share, share, worked_example_answer
    from ermedrag.training.rewards.answers import format_reward
    from ermedrag.training.mmedagent.train import stage_rewards
    from ermedrag.training.rewards.triage import triage_correctness_reward

    texts, tokens = greedy_rollouts(
        model_dir, [r["prompt"] for r in rows], staged.max_completion_length, staged.stop_strings, args.eval_batch
    )
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {
        "gold_specialty": [r["gold_specialty"] for r in rows],
        "specialties": [r["specialties"] for r in rows],
        "model_text": texts,
    }
    parsed = [triage.parse_triage(t, r["specialties"], fallback=r["specialties"][0]) for t, r in zip(texts, rows)]
    rewards, mean_reward = _weighted_total(stage_rewards(staged, "triage"), completions, columns)
    examples = [worked_example_answer(r["prompt"]) for r in rows]
    copied = [copied_example(p, e) for p, e in zip(parsed, examples)]
    correct = triage_correctness_reward(completions, **columns)
    write_replies(
        replies_path(Path(args.replies_dir), "triage", label),
        [
            {
                "id": r["id"],
                "gold": r["gold_specialty"],
                "example": e,
                "reply": t,
                "answer": p["answer"],
                "named": p["specialty"] if p["ok"] else None,
                "correct": c,
                "copied": k,
            }
            for r, e, t, p, c, k in zip(rows, examples, texts, parsed, correct, copied)
        ],
    )
    return {
        "accuracy": _mean(correct),
        "accuracy_ci95": share(int(sum(correct)), len(rows))["ci95"],
        "n": len(rows),
        "named_a_specialty": _mean([p["ok"] for p in parsed]),
        "copy_rate": _mean(copied),
        "modal_share": modal_share([reply_key(p) for p in parsed]),
        "well_formed_rate": _mean(format_reward(completions, **columns)),
        "mean_reward": mean_reward,
        "rewards": rewards,
        "predicted": dict(Counter(p["specialty"] if p["ok"] else "(none)" for p in parsed).most_common()),
        "mean_tokens": round(sum(tokens) / len(tokens), 1),
    }


def evaluate_attending(
    model_dir: str, rows: Sequence[dict[str, Any]], staged, args: argparse.Namespace, label: str
) -> dict:
    """Held-out attending: accuracy with its interval, format, rewards, whom it followed, what it answered and the
    share of its most common answer (a collapse detector); the replies kept in `args.replies_dir/attending_LABEL`."""
    from ermedrag.agents import attending
    from ermedrag.agents.respondent import parse_answer
    from ermedrag.evals.baselines import modal_share, share
    from ermedrag.training.rewards.answers import correctness_reward, format_reward
    from ermedrag.training.mmedagent.train import stage_rewards

    texts, tokens = greedy_rollouts(
        model_dir, [r["prompt"] for r in rows], staged.max_completion_length, staged.stop_strings, args.eval_batch
    )
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {"gold": [r["gold"] for r in rows], "options": [r["options"] for r in rows], "model_text": texts}
    correct = correctness_reward(completions, **columns)  # what an eval counts: any answer the parser reads
    answers = [parse_answer(t, r["options"])["answer"] for t, r in zip(texts, rows)]
    rewards, mean_reward = _weighted_total(stage_rewards(staged, "easy"), completions, columns)
    followed = [attending.followed_majority(a, r["majority"]) for a, r in zip(answers, rows)]
    by_bucket = {b: [c for c, r in zip(correct, rows) if r["bucket"] == b] for b in ATTENDING_STAGES}
    write_replies(
        replies_path(Path(args.replies_dir), "attending", label),
        [
            {
                "id": r["id"],
                "gold": r["gold"],
                "specialist_answers": r["specialist_answers"],
                "reply": t,
                "answer": a,
                "correct": c,
            }
            for r, t, a, c in zip(rows, texts, answers, correct)
        ],
    )
    return {
        "accuracy": _mean(correct),
        "accuracy_ci95": share(int(sum(correct)), len(rows))["ci95"],
        "n": len(rows),
        "modal_share": modal_share(answers),
        "answer_parsed_rate": _mean([a is not None for a in answers]),
        "well_formed_rate": _mean(format_reward(completions, **columns)),
        "followed_specialist_1": _mean(
            [a is not None and a == r["specialist_answers"][0] for a, r in zip(answers, rows)]
        ),
        "followed_majority": _mean([f for f in followed if f is not None]),
        "accuracy_by_bucket": {b: {"accuracy": _mean(v), "n": len(v)} for b, v in by_bucket.items()},
        "answered": dict(Counter(a if a is not None else "(none)" for a in answers).most_common()),
        "mean_reward": mean_reward,
        "rewards": rewards,
        "mean_tokens": round(sum(tokens) / len(tokens), 1),
    }


# -------------------------------------------------------------------------------------------- training


def pass_through(config, name: str, start_model: str) -> None:
    """A stage with no training rows: record the start model as the stage's model, so the next stage of the
    chain starts from it (`training.mmedagent.stage_start_model` reads only `model_dir`)."""
    from ermedrag.training.mmedagent.train import STAGE_RECORD

    folder = Path(config.output_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STAGE_RECORD).write_text(
        json.dumps({"stage": name, "model_dir": start_model, "skipped": "no training rows in this bucket"}),
        encoding="utf-8",
    )


def run_stage(config, name: str, rows: int) -> dict[str, Any]:
    """Train one stage (or pass it through when its bucket is empty or it has 0 steps); its summary with minutes
    and rows."""
    from ermedrag.training.mmedagent.train import stage_config, stage_start_model, train_mmedagent

    started = time.time()
    if rows == 0 or stage_config(config, name).max_steps == 0:
        start = stage_start_model(config, name)
        pass_through(config, name, start)
        log(f"stage {name}: no training rows or steps, skipped (its model is its start model)")
        return {
            "model_dir": start,
            "steps": 0,
            "rows": 0,
            "skipped": True,
            "minutes": 0.0,
            "plot_path": None,
            "metrics_path": None,
        }
    summary = train_mmedagent(config, stages=[name])["stages"][name]
    summary.update(rows=rows, skipped=False, minutes=round((time.time() - started) / 60, 2))
    log(
        f"stage {name}: {summary['steps']} steps on {rows} rows in {summary['minutes']:.1f} min "
        f"(γ {summary['entropy_coef']}, β {summary['beta']})"
    )
    return summary


def logged_series(metrics_path: str | None, name: str = "entropy") -> list[float]:
    """One logged metric of each step (`metrics.jsonl`), in step order: by default TRL's mean token entropy."""
    if not metrics_path or not Path(metrics_path).is_file():
        return []
    series = []
    for line in Path(metrics_path).read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        value = record.get(name)
        if isinstance(value, (int, float)) and math.isfinite(value):
            series.append(round(float(value), 5))
    return series


def plot_entropy(with_bonus: list[float], without_bonus: list[float], gamma: float, stage: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(range(1, len(with_bonus) + 1), with_bonus, marker="o", label=f"entropy bonus γ = {gamma:g}")
    axis.plot(range(1, len(without_bonus) + 1), without_bonus, marker="s", label="entropy_bonus: false (γ = 0)")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set(
        xlabel="GRPO step",
        ylabel="mean token entropy (nats)",
        title=f"MMedAgent stage {stage}: same start model, data and seed",
    )
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -------------------------------------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data",
        default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")),
        help="shared data root (or its benchmarks/ folder)",
    )
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "ermedrag" / "bench" / "mmedagent"))
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "mmedagent_learning.json"))
    parser.add_argument("--model", default="offline:gemma3-270m", help="policy model (path, hub id, offline:NAME)")
    parser.add_argument("--seed", type=int, default=0, help="question split and scripted opinions")
    parser.add_argument("--train-questions", type=int, default=48)
    parser.add_argument("--eval-questions", type=int, default=48)
    parser.add_argument(
        "--sampling",
        choices=("balanced", "natural"),
        default="balanced",
        help="balanced: the same number of questions per specialty; natural: as the data has them",
    )
    parser.add_argument(
        "--max-question-chars",
        type=int,
        default=1500,
        help="leave out questions whose text and options are longer (bounds the CPU time per step)",
    )
    parser.add_argument(
        "--triage-steps", type=int, default=16, help="0: no GRPO (with --sft-epochs: the warm start alone)"
    )
    parser.add_argument(
        "--sft-epochs",
        type=float,
        default=0.0,
        help="a lever: each seed first warm-starts the triage and the attending with the product's SFT (`train_sft`, "
        "the sft_triage and sft_attending presets' settings) on its training questions' reference replies for this "
        "many epochs, and the triage's GRPO stage and the attending's curriculum start from the merged models "
        "(default 0: no warm start)",
    )
    parser.add_argument("--easy-steps", type=int, default=6)
    parser.add_argument("--medium-steps", type=int, default=12)
    parser.add_argument("--hard-steps", type=int, default=8)
    parser.add_argument(
        "--entropy-stage",
        choices=ATTENDING_STAGES,
        default="hard",
        help="the stage trained again with entropy_bonus: false",
    )
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO group)")
    parser.add_argument(
        "--prompts-per-step",
        type=int,
        default=1,
        help="prompts (each with its group) per optimizer step, by gradient accumulation; the product's "
        "training/configs/mmedagent.yaml has 2 (per_device_train_batch_size 8 = num_generations, accumulation 2)",
    )
    parser.add_argument(
        "--sft-questions",
        type=int,
        default=None,
        help="questions the warm start trains on: the training questions, then more drawn from those not held out "
        "(balanced like the split; default: the training questions alone)",
    )
    parser.add_argument("--triage-tokens", type=int, default=64, help="triage completion budget (training and eval)")
    parser.add_argument("--attending-tokens", type=int, default=96, help="attending completion budget")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature of training rollouts (the other CPU benches: at 1.0 the base 270M "
        "model leaves the format in nearly every sample and GRPO gets no signal)",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--reward", choices=("paper", "gated"), default="paper")
    parser.add_argument(
        "--reliabilities",
        default=",".join(map(str, RELIABILITIES)),
        help="the scripted specialists' probabilities of naming the gold option, comma-separated",
    )
    parser.add_argument(
        "--triage-beta",
        type=float,
        default=None,
        help="the triage stage's KL coefficient β (default: the schedule's, training.mmedagent.train.STAGES)",
    )
    parser.add_argument(
        "--triage-format-weight",
        type=float,
        default=None,
        help="the triage's triage_format reward weight (default: the reward mode's, 0.5; 0 drops it, so only a "
        "right specialty pays)",
    )
    parser.add_argument("--eval-batch", type=int, default=8)
    parser.add_argument(
        "--seeds", type=int, default=1, help="train the stages this many times (training seeds 42, 43, …)"
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="start at training seed 42 + K, with its own training draw K (with --parts triage or attending)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take each training seed (its warm start, the entropy ablation) that an earlier run finished "
        "with the same settings from its record (to add seeds, or go on after a stop); only while the "
        "training code is unchanged",
    )
    parser.add_argument(
        "--parts",
        choices=("all", *PARTS),
        default="all",
        help="triage (attending): train and measure the triage stage (the attending's curriculum) only, and write its "
        "figures (triage or attending, seeds.PART, PART_run) into the results file beside the other part's",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny random model, and tiny sizes for those left at their defaults: checks the pipeline",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE_SIZES.items():
            if getattr(args, key) == parser.get_default(key):  # a size set to another value stays
                setattr(args, key, value)
    args.reliabilities = tuple(float(p) for p in str(args.reliabilities).split(",") if p.strip())
    if not args.reliabilities or not all(0 <= p <= 1 for p in args.reliabilities):
        parser.error(f"--reliabilities must be probabilities, got {args.reliabilities}")
    if args.first_seed < 0 or (args.first_seed and args.parts == "all"):
        parser.error(
            "--first-seed must be at least 0, and above 0 only with --parts triage or attending (the entropy "
            "ablation follows the first seed's chain)"
        )
    if args.triage_beta is not None and args.triage_beta < 0:
        parser.error(f"--triage-beta must be at least 0, got {args.triage_beta}")
    attending_steps = (args.easy_steps, args.medium_steps, args.hard_steps)
    if not 0 <= args.sft_epochs < float("inf") or min(args.triage_steps, *attending_steps) < 0:
        parser.error("--sft-epochs must be a finite number at least 0, and the steps of every stage at least 0")
    if args.sft_questions is not None and (args.sft_questions < 1 or not args.sft_epochs):
        parser.error("--sft-questions must be at least 1, and goes with --sft-epochs")
    if args.triage_steps == 0 and not (args.sft_epochs and args.parts == "triage"):
        parser.error("--triage-steps 0 measures a warm start alone: it needs --sft-epochs and --parts triage")
    if not any(attending_steps) and not (args.sft_epochs and args.parts == "attending"):
        parser.error("no attending steps measures a warm start alone: it needs --sft-epochs and --parts attending")
    if args.triage_format_weight is not None and not 0 <= args.triage_format_weight < float("inf"):
        parser.error(f"--triage-format-weight must be a finite number at least 0, got {args.triage_format_weight}")
    if (
        min(
            args.train_questions,
            args.eval_questions,
            args.generations,
            args.prompts_per_step,
            args.eval_batch,
            args.seeds,
        )
        < 1
    ):
        parser.error(
            "--train-questions, --eval-questions, --generations, --prompts-per-step, --eval-batch and --seeds "
            "must be at least 1"
        )
    return args


def estimate_minutes(args: argparse.Namespace, stage_rows: dict[str, int], sft_rows: dict[str, int]) -> float:
    """A rough wall time for the offline model on 2 cores (constants above), printed before the run; `sft_rows`:
    each warm start's rows."""
    scale = args.generations * args.prompts_per_step / 4
    run = {part: args.parts in ("all", part) for part in PARTS}
    steps = {
        "triage": args.triage_steps if run["triage"] else 0,
        **{name: getattr(args, f"{name}_steps") if run["attending"] else 0 for name in ATTENDING_STAGES},
    }
    train = sum(
        steps[name]
        * SECONDS_PER_STEP_PER_TOKEN
        * scale
        * (args.triage_tokens if name == "triage" else args.attending_tokens)
        for name in steps
        if stage_rows.get(name)
    )
    if stage_rows.get(args.entropy_stage) and args.parts == "all":
        train += steps[args.entropy_stage] * SECONDS_PER_STEP_PER_TOKEN * scale * args.attending_tokens
    # triage: before and after (and after its warm start); attending: before, after each stage (and the warm start)
    warm = 1 if args.sft_epochs else 0
    evaluated_tokens = (
        run["triage"] * (2 + warm) * args.triage_tokens
        + run["attending"] * (1 + warm + sum(1 for name in ATTENDING_STAGES if steps[name])) * args.attending_tokens
    )
    evals = args.eval_questions * EVAL_SECONDS_PER_PROMPT_PER_TOKEN * evaluated_tokens
    merges = 5 * 20
    warm_start = sum(rows * args.sft_epochs * SFT_SECONDS_PER_ROW[part] for part, rows in sft_rows.items() if run[part])
    return (train + warm_start + evals + merges + 60) / 60


@dataclasses.dataclass
class BenchData:
    """The split and every row the stages train on or are measured on."""

    train_questions: list[Any]
    eval_questions: list[Any]
    train_triage: list[dict[str, Any]]
    sft_triage: list[dict[str, Any]]  # the triage's warm start's rows (`--sft-epochs`; else empty)
    eval_triage: list[dict[str, Any]]
    train_attending: list[dict[str, Any]]
    sft_attending: list[dict[str, Any]]  # the attending's warm start's rows (`--sft-epochs`; else empty)
    eval_attending: list[dict[str, Any]]
    stage_rows: dict[str, int]  # training rows per stage (0: the bucket is empty and the stage is skipped)

    def sft_rows(self, part: str) -> list[dict[str, Any]]:
        return self.sft_triage if part == "triage" else self.sft_attending


def prepare_data(args: argparse.Namespace, folder: Path, export: Path, train_draw: int = 0) -> BenchData:
    """Split the labelled questions, build the triage and attending rows, write the export folders the trainer
    reads (`export/triage`, `export/easy`, ...; an empty bucket gets no folder). `train_draw` other than 0: a
    training sample of its own (`split_questions`), with opinions of its own; the held-out rows stay the same."""
    from ermedrag.evals.baselines import balanced_positions

    by_specialty = labelled_questions(folder, args.max_question_chars)
    split = (by_specialty, args.train_questions, args.eval_questions, args.seed, args.sampling)
    first_train, eval_q = split_questions(*split)
    train_q = first_train if train_draw == 0 else split_questions(*split, train_draw=train_draw)[0]
    log(
        f"labelled questions by specialty (≤ {args.max_question_chars} chars): "
        f"{ {s: len(qs) for s, qs in by_specialty.items()} }; train {len(train_q)} (draw {train_draw}), "
        f"held out {len(eval_q)}"
    )
    opinions_rng = random.Random(args.seed + 1)  # train first, then held out: the train rows do not depend on n_eval
    first_train_attending = attending_rows(first_train, opinions_rng, args.reliabilities)
    # Gold positions balanced (options rotated): always one letter, or an attending collapsed onto one, scores chance
    eval_attending = attending_rows(balanced_positions(eval_q), opinions_rng, args.reliabilities)
    own_opinions = random.Random(f"opinions:{args.seed}:{train_draw}")
    sft_q = (
        warm_start_questions(by_specialty, train_q, eval_q, args.sft_questions or 0, f"{args.seed}:{train_draw}")
        if args.sft_epochs
        else []
    )
    # The attending's warm start: gold answers at every position in turn (no letter to learn as a prior), with
    # opinions of their own
    sft_opinions = random.Random(f"sft-opinions:{args.seed}:{train_draw}")
    data = BenchData(
        train_q,
        eval_q,
        triage_rows(train_q),
        triage_rows(sft_q),
        triage_rows(eval_q),
        first_train_attending if train_draw == 0 else attending_rows(train_q, own_opinions, args.reliabilities),
        attending_rows(balanced_positions(sft_q), sft_opinions, args.reliabilities),
        eval_attending,
        {},
    )
    if export.exists():
        shutil.rmtree(export)
    save_dataset(data.train_triage, export / "triage")
    for part in PARTS if args.sft_epochs else ():
        save_dataset(data.sft_rows(part), export / WARM_STARTS[part][1])
    data.stage_rows["triage"] = len(data.train_triage)
    for bucket in ATTENDING_STAGES:
        rows = [r for r in data.train_attending if r["bucket"] == bucket]
        data.stage_rows[bucket] = len(rows)
        if rows:
            save_dataset(rows, export / bucket)
    return data


def question_ids(data: BenchData) -> list[list[str]]:
    """The ids a seed's record depends on: training, held out, and the warm start's when it has one."""
    ids = [[q.id for q in data.train_questions], [q.id for q in data.eval_questions]]
    return ids + [[r["id"] for r in data.sft_triage]] if data.sft_triage else ids


def policy_model(smoke: bool, model: str, work: Path) -> str:
    """The model the stages start from: `model` resolved (`offline:NAME`, a path, a hub id), or for a smoke run a
    tiny random one built in `work`."""
    if smoke:
        from ermedrag.testing.tiny_model import build_tiny_causal_lm

        return str(build_tiny_causal_lm(work / "tiny"))
    from ermedrag.training.config import resolve_model

    return resolve_model(model)


def bench_config(args: argparse.Namespace, model_path: str, export: Path, output_dir: Path):
    """The trainer's config: the schedule's γ and β per stage, the bench's sizes and step counts."""
    from ermedrag.training.mmedagent.config import MMedAgentTrainingConfig

    return MMedAgentTrainingConfig(
        model=model_path,
        dataset=str(export),
        output_dir=str(output_dir),
        reward=args.reward,
        learning_rate=args.learning_rate,
        num_generations=args.generations,
        per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=args.prompts_per_step,
        max_completion_length=args.attending_tokens,
        temperature=args.temperature,
        save_steps=10_000,
        logging_steps=1,
        seed=TRAINING_SEED,
        stage_overrides={
            "triage": {
                "max_steps": args.triage_steps,
                "max_completion_length": args.triage_tokens,
                **({} if args.triage_beta is None else {"beta": args.triage_beta}),
                **(
                    {}
                    if args.triage_format_weight is None
                    else {"rewards": {"triage_format": args.triage_format_weight}}
                ),
            },
            "easy": {"max_steps": args.easy_steps},
            "medium": {"max_steps": args.medium_steps},
            "hard": {"max_steps": args.hard_steps},
        },
    )


def bench_settings(args: argparse.Namespace, config, data: BenchData) -> dict[str, Any]:
    from ermedrag.training.mmedagent.train import STAGES, stage_config, stage_rewards
    from ermedrag.training.rewards import named_weights

    return {
        "model": "tiny random (smoke)"
        if args.smoke
        else f"{args.model} (base, LoRA r={config.lora_r} per stage, merged between stages)",
        "seed": args.seed,
        "sampling": args.sampling,
        "max_question_chars": args.max_question_chars,
        "train_questions": len(data.train_questions),
        "eval_questions": len(data.eval_questions),
        "train_by_specialty": dict(Counter(r["gold_specialty"] for r in data.train_triage).most_common()),
        "sft_by_specialty": dict(Counter(r["gold_specialty"] for r in data.sft_triage).most_common()),
        "eval_by_specialty": dict(Counter(r["gold_specialty"] for r in data.eval_triage).most_common()),
        "reliabilities": list(args.reliabilities),
        "train_rows_by_stage": data.stage_rows,
        "eval_rows_by_bucket": {b: sum(r["bucket"] == b for r in data.eval_attending) for b in ATTENDING_STAGES},
        "attending_gold_positions": BALANCED_POSITIONS,
        "steps": {
            "triage": args.triage_steps,
            "easy": args.easy_steps,
            "medium": args.medium_steps,
            "hard": args.hard_steps,
        },
        "gamma_beta": {
            n: [stage_config(config, n).entropy_coef, stage_config(config, n).beta] for n in STAGES if n != "attending"
        },
        "num_generations": args.generations,
        "prompts_per_step": args.prompts_per_step,
        "temperature": args.temperature,
        "learning_rate": args.learning_rate,
        "reward": args.reward,
        "triage_rewards": named_weights(stage_rewards(stage_config(config, "triage"), "triage")),
        "parts": args.parts,
        "triage_sft_warm_start": {"epochs": args.sft_epochs, "preset": "sft_triage"} if args.sft_epochs else None,
        "attending_sft_warm_start": {
            "epochs": args.sft_epochs,
            "preset": "sft_attending",
            "rows": len(data.sft_attending),
            "gold_positions": BALANCED_POSITIONS,
            "opinions": "scripted, of their own (the same reliabilities)",
        }
        if args.sft_epochs
        else None,
        "triage_tokens": args.triage_tokens,
        "attending_tokens": args.attending_tokens,
        "entropy_stage": args.entropy_stage,
        "entropy_bonus_on_silent_steps": config.entropy_bonus_on_silent_steps,
        "decoding": "greedy, the training rollouts' loop (ends at </answer>), same held-out prompts before and after",
        "estimated_minutes_2_cores": None
        if args.smoke
        else round(estimate_minutes(args, data.stage_rows, {part: len(data.sft_rows(part)) for part in PARTS}), 1),
    }


def measured_once(measured: dict[tuple[str, str], dict], model_dir: str, part: str, evaluate) -> dict:
    """One evaluation per (model, part): every seed starts from the same base model, measured once."""
    if (model_dir, part) not in measured:
        measured[model_dir, part] = evaluate()
    return measured[model_dir, part]


def warm_start_training(config, args: argparse.Namespace, part: str):
    """The product's SFT with the `part`'s preset's settings (`WARM_STARTS`), from the base model, on the reference
    replies of this seed's warm-start rows (in its export folder), into a folder beside the seed's training one
    (`train-sft`, `train-sft-attending`, `train-s1-sft`): a run that changes only what follows reuses it."""
    from ermedrag.training.config import SFTTrainingConfig, load_config

    preset_name, rows_dir, suffix = WARM_STARTS[part]
    return dataclasses.replace(
        load_config(preset_name, SFTTrainingConfig),
        model=config.model,
        dataset=str(Path(config.dataset) / rows_dir / "dataset"),
        output_dir=f"{config.output_dir}{suffix}",
        num_train_epochs=args.sft_epochs,
        seed=config.seed,
        save_steps=10_000,
    )


def warm_start(config, data: BenchData, args: argparse.Namespace, part: str) -> dict[str, Any]:
    """`--sft-epochs`: this seed's warm start of `part` (`warm_start_training`), or with `--reuse` the one an
    earlier run finished with the same settings and questions; the merged model and the run."""
    from seeds import inputs_key, warm_started

    questions = inputs_key(args.data, [r["id"] for r in data.sft_rows(part)])
    run = warm_started(warm_start_training(config, args, part), questions, args.reuse)
    log(f"{part} warm start{' (reused: an earlier run trained it)' if run['reused'] else ''}: {json.dumps(run)}")
    return run


def triage_part(
    config, model_path: str, data: BenchData, args: argparse.Namespace, measured: dict[tuple[str, str], dict]
) -> tuple[dict, dict]:
    """(a): held-out triage accuracy before and after the triage stage (from the seed's SFT warm start with
    `--sft-epochs`; with `--triage-steps 0` the warm start is the after); the result and the stage's summary."""
    from ermedrag.agents.triage import SPECIALTIES
    from ermedrag.evals.baselines import beats_baselines
    from ermedrag.training.mmedagent.train import stage_config

    staged = stage_config(config, "triage")
    before = measured_once(
        measured, model_path, "triage", lambda: evaluate_triage(model_path, data.eval_triage, staged, args, "before")
    )
    log(f"triage before: {json.dumps(before)}")
    sft = warm_start(config, data, args, "triage") if args.sft_epochs else None
    if sft and not args.triage_steps:
        summary = {"model_dir": sft["model_dir"], "steps": 0, "minutes": 0.0}
    elif sft:  # the warm start measured too, so one run tells what SFT did and what GRPO added
        sft["after"] = evaluate_triage(sft["model_dir"], data.eval_triage, staged, args, f"seed{config.seed}_after_sft")
        log(f"triage after the warm start: {json.dumps(sft['after'])}")
        summary = run_stage(dataclasses.replace(config, model=sft["model_dir"]), "triage", data.stage_rows["triage"])
    else:
        summary = run_stage(config, "triage", data.stage_rows["triage"])
    after = evaluate_triage(summary["model_dir"], data.eval_triage, staged, args, f"seed{config.seed}_after")
    log(f"triage after: {json.dumps(after)}")
    gold_counts = Counter(r["gold_specialty"] for r in data.eval_triage)
    baselines = triage_baselines(data.eval_questions, [r["prompt"] for r in data.eval_triage], SPECIALTIES)
    return {
        "before": before,
        "after": after,
        "baselines": baselines,
        "after_beats_baselines": beats_baselines(after["accuracy"], baselines),
        "chance": round(1 / len(SPECIALTIES), 4),
        "majority_class": round(max(gold_counts.values()) / len(data.eval_triage), 4),
        "steps": summary["steps"],
        "minutes": summary["minutes"],
        "sft": sft,
    }, summary


def attending_baselines(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The trivial answers' scores on the held-out attending prompts (`evals.baselines.trivial_baselines`)."""
    from ermedrag.evals.baselines import trivial_baselines

    return trivial_baselines([r["gold"] for r in rows], [list(r["options"]) for r in rows], [r["prompt"] for r in rows])


def attending_part(
    config, data: BenchData, args: argparse.Namespace, measured: dict[tuple[str, str], dict]
) -> tuple[dict, dict[str, dict]]:
    """(b): held-out attending accuracy before the curriculum (and after its warm start, `--sft-epochs`) and after
    each of its stages, with the trivial baselines and the ceilings the opinions allow; the result and the stages'
    summaries."""
    from ermedrag.evals.baselines import beats_baselines
    from ermedrag.training.mmedagent.train import stage_config, stage_start_model

    staged = stage_config(config, "easy")  # the attending's rewards and budget are the same in every stage
    start = stage_start_model(config, "easy")
    before = measured_once(
        measured, start, "attending", lambda: evaluate_attending(start, data.eval_attending, staged, args, "before")
    )
    log(f"attending before: {json.dumps(before)}")
    label = f"seed{config.seed}_after"
    sft = warm_start(config, data, args, "attending") if args.sft_epochs else None
    if sft:  # the curriculum goes on from the warm start, measured on its own first
        sft["after"] = evaluate_attending(sft["model_dir"], data.eval_attending, staged, args, f"{label}_sft")
        log(f"attending after the warm start: {json.dumps(sft['after'])}")
        config = dataclasses.replace(config, attending_start=sft["model_dir"])
    after_each: dict[str, Any] = {}
    summaries: dict[str, dict[str, Any]] = {}
    current = sft["after"] if sft else before
    for name in ATTENDING_STAGES:
        summaries[name] = run_stage(config, name, data.stage_rows[name])
        if not summaries[name]["skipped"]:
            current = evaluate_attending(
                summaries[name]["model_dir"], data.eval_attending, staged, args, f"{label}_{name}"
            )
            log(f"attending after {name}: {json.dumps(current)}")
        after_each[name] = {
            **current,
            "steps": summaries[name]["steps"],
            "minutes": summaries[name]["minutes"],
            "train_rows": data.stage_rows[name],
        }
    baselines = attending_baselines(data.eval_attending)
    return {
        "before": before,
        "after": current,
        "baselines": baselines,
        "after_beats_baselines": beats_baselines(current["accuracy"], baselines),
        "ceiling": ceilings(data.eval_attending),
        "after_each_stage": after_each,
        "sft": sft,
    }, summaries


def seed_part(
    config, model_path: str, data: BenchData, args: argparse.Namespace, measured: dict[tuple[str, str], dict]
) -> dict[str, Any]:
    """(a) and (b) for one training seed, as `--parts` asks: triage, the attending's curriculum, and each stage's
    summary."""
    run: dict[str, Any] = {"summaries": {}}
    if args.parts in ("all", "triage"):
        run["triage"], run["summaries"]["triage"] = triage_part(config, model_path, data, args, measured)
    if args.parts in ("all", "attending"):
        run["attending"], summaries = attending_part(config, data, args, measured)
        run["summaries"].update(summaries)
    return run


def entropy_part(
    config, summaries: dict[str, dict], data: BenchData, args: argparse.Namespace, output_dir: Path
) -> dict[str, Any]:
    """(c): the entropy stage trained again with `entropy_bonus: false`, from the same start model (the
    previous stage's record is copied), same data and seed; TRL's per-step mean token entropy of both runs."""
    from ermedrag.training.mmedagent.train import STAGE_RECORD, STAGES, stage_config

    name = args.entropy_stage
    result: dict[str, Any] = {
        "stage": name,
        "entropy_coef": {"with_bonus": stage_config(config, name).entropy_coef, "without_bonus": 0.0},
    }
    if not data.stage_rows[name]:
        return {**result, "with_bonus": [], "without_bonus": [], "skipped": f"no training rows in bucket {name}"}
    no_bonus = dataclasses.replace(config, output_dir=str(output_dir), entropy_bonus=False)
    previous = STAGES[name].after
    if previous is not None:
        (output_dir / previous).mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(config.output_dir) / previous / STAGE_RECORD, output_dir / previous / STAGE_RECORD)
    ablation = run_stage(no_bonus, name, data.stage_rows[name])
    result["with_bonus"] = logged_series(summaries[name]["metrics_path"])
    result["without_bonus"] = logged_series(ablation["metrics_path"])
    result["mean"] = {k: _mean(result[k]) for k in ("with_bonus", "without_bonus")}
    result["minutes_without_bonus"] = ablation["minutes"]
    return result


def seeds_summary(runs: Sequence[dict[str, Any]], data: BenchData) -> dict[str, Any]:
    """Per part, each metric before and after over the seeds (`seeds.paired_over_seeds`), and held-out accuracy
    with its Wilson 95% interval per seed."""
    from seeds import part_over_seeds

    summary: dict[str, Any] = {"n": len(runs), "training_seeds": [run["training_seed"] for run in runs]}
    for part, rows in (("triage", data.eval_triage), ("attending", data.eval_attending)):
        if all(part in run for run in runs):
            summary[part] = part_over_seeds(runs, part, len(rows))
    return summary


def write_part_only(
    out: Path,
    part: str,
    runs: Sequence[dict[str, Any]],
    data: BenchData,
    settings: dict,
    started: float,
    at_start: str,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
) -> int:
    """`--parts triage` or `attending`: that part's figures (`part`, `seeds.part`, `part_run`: the run they come
    from) replace those in the results file; the other part's and the entropy ablation's recorded ones stay, with
    the run they came from (`settings`, `command`)."""
    result = json.loads(out.read_text()) if out.exists() else {}
    from ermedrag.evals.baselines import beats_baselines

    baselines = runs[0][part]["baselines"]
    against = {name: baselines[name] for name in ("chance", "majority")}  # the issue's bar; the rest beside
    afters = [run[part]["after"]["accuracy"] for run in runs]
    result[part] = {
        **runs[0][part],
        "seeds_after": [run[part]["after"] for run in runs],
        "seeds_beating_chance_and_majority": sum(beats_baselines(a, against) for a in afters),
        "seeds_beating_every_baseline": sum(beats_baselines(a, baselines) for a in afters),
    }
    warm = [(run[part].get("sft") or {}).get("after") for run in runs]  # measured when training followed
    if all(warm):
        result[part]["seeds_after_sft"] = warm
        result[part]["seeds_after_sft_beating_chance_and_majority"] = sum(
            beats_baselines(w["accuracy"], against) for w in warm
        )
        result[part]["seeds_after_sft_beating_every_baseline"] = sum(
            beats_baselines(w["accuracy"], baselines) for w in warm
        )
    result.setdefault("seeds", {})[part] = seeds_summary(runs, data)[part]
    retrofitted = result.get("baselines") or {}  # `recorded_baselines.py`'s block for an earlier run's part
    retrofitted.pop(part, None)
    if not retrofitted:
        result.pop("baselines", None)
    result[f"{part}_run"] = {
        "settings": settings,
        "training_seeds": [run["training_seed"] for run in runs],
        "seed_changes": [run["seed_changes"] for run in runs],
        "seconds": round(time.time() - started, 1),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": at_start,
        "command": " ".join(
            ["python", "benches/learning/mmedagent_learning.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    log(f"wrote the {part}'s figures into {out} ({result[f'{part}_run']['seconds'] / 60:.1f} min)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    folder = benchmarks_dir(args.data)
    if folder is None:
        print(
            f"mmedagent_learning: skipped: the shared data is not at {args.data} (need benchmarks/"
            f"{' and '.join(BENCHMARK_FILES)}); pass --data or set ERMEDRAG_SHARED_DATA",
            file=sys.stderr,
        )
        return 0

    from seeds import allocator_env, hold_work_folder, inputs_key, run_or_reuse

    from ermedrag.tools.models.hf import apply_torch_threads
    from ermedrag.training.mmedagent.train import stage_start_model

    apply_torch_threads()  # the trainers do not read ERMEDRAG_TORCH_THREADS; the hf backend does
    from ermedrag.training.config import comparable_settings

    at_start = describe_machine()
    work = Path(args.work) / ("smoke" if args.smoke else "full")
    hold_work_folder(work)
    for stale in [] if args.reuse else work.glob("train*"):
        shutil.rmtree(stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "mmedagent_learning.json" if args.smoke else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args.replies_dir = str(out.with_name(out.stem + "_replies"))
    model_path = policy_model(args.smoke, args.model, work)
    data = prepare_data(args, folder, work / "export")
    if not data.train_questions or not data.eval_questions:
        print(f"mmedagent_learning: no labelled questions to train on or hold out in {folder}", file=sys.stderr)
        return 1
    config = bench_config(args, model_path, work / "export", work / "train")
    settings = bench_settings(args, config, data)
    log("settings: " + json.dumps(settings))
    inputs = {
        **{k: v for k, v in settings.items() if k != "estimated_minutes_2_cores"},
        "eval_batch": args.eval_batch,
        **inputs_key(args.data, *question_ids(data)),
    }
    measured: dict[tuple[str, str], dict] = {}
    runs, reused_seeds = [], []
    for number in range(args.first_seed, args.first_seed + args.seeds):
        # Seed 0 trains on the split's own training questions; seed k > 0 on a sample it draws itself (its own
        # export), so that the spread over seeds holds the training data's variation as well as the trainer's.
        own = data if number == 0 else prepare_data(args, folder, work / f"export-s{number}", train_draw=number)
        seeded = dataclasses.replace(
            config,
            seed=TRAINING_SEED + number,
            dataset=str(work / ("export" if number == 0 else f"export-s{number}")),
            output_dir=str(work / ("train" if number == 0 else f"train-s{number}")),
        )
        own_inputs = {
            **inputs,
            **inputs_key(args.data, *question_ids(own)),
        }
        run, reused = run_or_reuse(
            Path(seeded.output_dir),
            {"config": comparable_settings(seeded), **own_inputs},
            lambda: seed_part(seeded, model_path, own, args, measured),
            args.reuse,
        )
        run["seed_changes"] = SEED_CHANGES if number else "LoRA initialisation, data order, sampled rollouts"
        run["training_seed"] = seeded.seed
        run["train_rows_by_stage"] = own.stage_rows
        if reused:
            log(f"training seed {seeded.seed}: reusing what an earlier run finished in {seeded.output_dir}")
            if "triage" in run:  # a --parts attending run trained no triage, and the other way round
                measured[model_path, "triage"] = run["triage"]["before"]
            if "attending" in run:
                measured[stage_start_model(seeded, "easy"), "attending"] = run["attending"]["before"]
            reused_seeds.append(seeded.seed)
        runs.append(run)
    if args.parts != "all":
        return write_part_only(out, args.parts, runs, data, settings, started, at_start, args, argv)
    result: dict[str, Any] = {
        "triage": runs[0]["triage"],
        "attending": runs[0]["attending"],
        "seeds": seeds_summary(runs, data),
    }
    summaries = runs[0]["summaries"]
    no_bonus = work / "train-no-bonus"  # compared with the first seed's curves: reused only along with them
    result["entropy"], _ = run_or_reuse(
        no_bonus,
        {"config": comparable_settings(config), **inputs},
        lambda: entropy_part(config, summaries, data, args, no_bonus),
        args.reuse and TRAINING_SEED in reused_seeds,
    )
    result["reused_training_seeds"] = reused_seeds
    log(f"entropy: {json.dumps(result['entropy'])}")

    prefix = "mmedagent_smoke_" if args.smoke else "mmedagent_"
    for name, summary in summaries.items():  # each stage's own curves (first seed)
        if summary.get("plot_path"):
            shutil.copy(summary["plot_path"], out.parent / f"{prefix}{name}_curves.png")
    entropy = result["entropy"]
    if entropy["with_bonus"] or entropy["without_bonus"]:
        plot_entropy(
            entropy["with_bonus"],
            entropy["without_bonus"],
            entropy["entropy_coef"]["with_bonus"],
            args.entropy_stage,
            out.parent / f"{prefix}entropy.png",
        )

    if allocator := allocator_env():
        result["allocator_env"] = allocator
    result.update(
        settings=settings,
        seconds=round(time.time() - started, 1),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        machine=at_start,
        command=" ".join(
            ["python", "benches/learning/mmedagent_learning.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    )
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {out} ({result['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
