"""Med-R³ progressive RL on CPU: does each stage move what it rewards?

PubMedQA-train questions, their abstracts as the searchable corpus (gold evidence = the question's own
abstract). The three stages of `training.med_r3.train_med_r3` (1 reasoning without search, 2 retrieval,
3 joint) run in order with LoRA on the offline model, each from the previous stage's merged model. Before and
after each stage, the same held-out prompts are rolled out greedily in that stage's mode (with or without the
search loop) and scored with that stage's own reward functions and weights. Writes
benches/results/med_r3_learning.json and one curves plot per stage.

    .venv/bin/python benches/learning/med_r3_learning.py              # one chain of the three stages
    .venv/bin/python benches/learning/med_r3_learning.py --seeds 3    # three chains (seeds 0, 1, 2)
    .venv/bin/python benches/learning/med_r3_learning.py --seeds 3 --reuse   # go on: finished seeds are kept
    .venv/bin/python benches/learning/med_r3_learning.py --seeds 2 --first-seed 1   # add seeds 1, 2 to the record
    .venv/bin/python benches/learning/med_r3_learning.py --smoke      # tiny random model, a few minutes

With `--seeds N` the chain of three stages runs N times from the base model (seeds 0..N-1: each its own training
questions, `seeds.training_sample`, LoRA initialisation, data order, sampled rollouts); the base model's before is
measured once, and a later stage's before is its own seed's earlier stage. A model's greedy replies are made once
per mode and scored per stage (stage 2's after and stage 3's before are the same replies). Each finished seed
records its chain in its folder, which `--reuse` takes instead of training that seed again (`reused_seeds`).
`--first-seed K` adds seeds K.. to the seeds 0..K-1 that the `--out` record holds (`recorded_seeds`), on a machine
without their work folder: the same settings, and the base model's replies to the held-out prompts must score
exactly as recorded (the same prompts, model and kind of CPU), else it stops before training.
`seeds` in the JSON reports per stage and metric before and after as mean ± sd, the gain, and how many seeds
improved it. Held-out prompts: the `--eval-questions` PubMedQA-train questions after the training ones in one
seeded shuffle (disjoint from them), yes, no and maybe taken in turn (`evals.baselines.balanced_by_answer`: always
one answer scores a third). Every scoring keeps its replies beside the results file, with each one's answer, gold,
searches and reward parts (`med_r3_learning/replies/stage<S>_seed<N>_<before|after>.jsonl.gz`, `kept_replies`).

`--sft-questions N` (a lever: stage 1 lowered the base model's accuracy while teaching the format) warm-starts each
seed first with the product's SFT (`ermedrag train sft --config sft_med_r3`) on the reference replies of N
questions (its training ones, then more drawn for the seed, none held out: each question's own conclusion, then its
answer), and the chain starts from the merged warm start; `base_model` records the base model's held-out scores
in stage 1's mode beside it. `--sft-balanced` draws those questions with each gold answer equally often.

    .venv/bin/python benches/learning/med_r3_learning.py --seeds 3 --sft-questions 96 \\
        --out benches/results/med_r3_learning_sft.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

from learning_signal import (  # noqa: E402
    abstracts_as_documents,
    answer_baselines,
    answer_parsed_rate,
    command_line,
    log,
    write_result,
)
from seeds import SEED_CHANGES, hold_work_folder, inputs_key, part_over_seeds, run_or_reuse  # noqa: E402
from seeds import training_sample, warm_started  # noqa: E402
from kept_replies import replies_path, write_replies  # noqa: E402

from ermedrag.agents.respondent import parse_answer  # noqa: E402
from ermedrag.evals.baselines import balanced_by_answer, modal_share  # noqa: E402
from ermedrag.tools.data.benchmarks import load_questions_file  # noqa: E402
from ermedrag.tools.retrieval.index import build_index, open_index  # noqa: E402
from ermedrag.training.rewards.answers import correctness_reward, format_reward  # noqa: E402
from ermedrag.training.med_r3.config import MedR3TrainingConfig
from ermedrag.training.config import comparable_settings  # noqa: E402
from ermedrag.training.med_r3.train import STAGES, stage_rewards, stage_start_model, train_med_r3  # noqa: E402
from ermedrag.training.med_r3.data import med_r3_dataset  # noqa: E402
from ermedrag.training.grpo.rollouts import ENDINGS, index_search, run_search_rollouts  # noqa: E402
from ermedrag.training.rewards.search import retrieval_hit_reward  # noqa: E402


def rows_for(questions, index_ids: set[str]) -> list[dict[str, Any]]:
    """Med-R³ questions whose gold evidence is the question's own abstract passages in the index (with their stated
    conclusion: the SFT warm start's reference reasoning)."""
    return [
        {
            "id": q.id,
            "question": q.question,
            "options": q.options,
            "gold": q.answer,
            "benchmark": q.benchmark,
            "gold_evidence": [f"{q.id}-{i}" for i in range(len(q.contexts)) if f"{q.id}-{i}" in index_ids],
            "conclusion": q.conclusion,
        }
        for q in questions
    ]


def warm_start_questions(pool, held_out, train, n: int, seed: int, balanced: bool = False) -> list[Any]:
    """The SFT warm start's `n` questions: the seed's training ones, then more drawn for the seed from those neither
    held out nor trained on. `balanced`: as many of each gold answer (`balanced_by_answer`, the training ones first
    within each), so the warm start cannot learn the pool's answer prior (PubMedQA-train: 55% yes, 11% maybe)."""
    used = {q.id for q in (*held_out, *train)}
    rest = [q for q in pool if q.id not in used]
    draw = random.Random(f"sft:{seed}")
    if balanced:
        return balanced_by_answer([*train, *draw.sample(rest, len(rest))], n)
    return [*train, *draw.sample(rest, min(len(rest), max(0, n - len(train))))]


def warm_start(
    model_path: str, rows: list[dict[str, Any]], work: Path, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """The product's SFT (`sft_med_r3` preset) from `model_path` on the reference replies of `rows`, merged; with
    `--reuse`, the one an earlier run finished with the same settings and questions. The run and `model_dir`."""
    from ermedrag.training.config import SFTTrainingConfig, load_config

    dataset = work / f"sft-dataset-s{seed}"
    med_r3_dataset(rows).save_to_disk(str(dataset))
    training = replace(
        load_config("sft_med_r3", SFTTrainingConfig),
        model=model_path,
        dataset=str(dataset),
        output_dir=str(work / f"train-s{seed}-sft"),
        num_train_epochs=args.sft_epochs,
        seed=seed,
        save_steps=10_000,
    )
    run = warm_started(training, inputs_key(args.data, [r["id"] for r in rows]), args.reuse)
    log(f"seed {seed}: SFT warm start{' (reused)' if run['reused'] else ''}: {json.dumps(run)}")
    return run


def greedy_rollouts(model_dir: str, rows: list[dict[str, Any]], search, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy rollouts of the held-out prompts with or without the search loop: the replies, as the stage rewards
    read them, and the rollouts themselves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dataset = med_r3_dataset(rows)
    prompt_ids = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        for r in dataset
    ]
    generation = GenerationConfig(
        do_sample=False,
        max_new_tokens=args.step_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    rollouts = []
    with torch.no_grad():
        for start in range(0, len(prompt_ids), args.eval_batch):
            rollouts += run_search_rollouts(
                model,
                tokenizer,
                prompt_ids[start : start + args.eval_batch],
                generation_config=generation,
                search=search,
                step_max_new_tokens=args.step_tokens,
                max_total_tokens=args.completion_tokens,
            )
    columns = {key: [r[key] for r in dataset] for key in ("gold", "options", "gold_evidence")}
    columns["model_text"] = [r.model_text for r in rollouts]
    columns["answer_text"] = [r.answer_text for r in rollouts]
    columns["retrieved_ids"] = [r.retrieved_ids for r in rollouts]
    completions = [
        [{"role": "assistant", "content": tokenizer.decode(r.completion_ids, skip_special_tokens=True)}]
        for r in rollouts
    ]
    return {"rollouts": rollouts, "columns": columns, "completions": completions}


def score(
    replies: dict[str, Any], stage: int, config: MedR3TrainingConfig, rows: list[dict[str, Any]], keep: Path
) -> dict:
    """`greedy_rollouts`' replies to `rows` scored with `stage`'s rewards and weights (as `config` sets them); each
    reply with its answer, gold, searches and reward parts kept in `keep` (`kept_replies`)."""
    rollouts, columns, completions = replies["rollouts"], replies["columns"], replies["completions"]
    rewards = stage_rewards(stage, settings=config.reward_settings())
    scores = {r.func.__name__: r.func(completions, **columns) for r in rewards}  # by curve name, as TRL logs them
    n = len(rollouts)
    answers = [parse_answer(t, o)["answer"] for t, o in zip(columns["answer_text"], columns["options"])]
    write_replies(
        keep,
        (
            {
                "prompt_id": row["id"],
                "reply": rollout.model_text,
                "answer": answer,
                "gold": row["gold"],
                "searches": list(rollout.searches),
                "retrieved_ids": list(rollout.retrieved_ids),
                "ended": rollout.ended,
                "rewards": {name: values[i] for name, values in scores.items()},
            }
            for i, (row, rollout, answer) in enumerate(zip(rows, rollouts, answers))
        ),
    )
    total = [sum(r.weight * (scores[r.func.__name__][i] or 0.0) for r in rewards) for i in range(n)]
    formats = format_reward(completions, **columns)
    hits = [h for h in retrieval_hit_reward(completions, **columns) if h is not None]
    # Every kind of ending, zeros included: a seed without one counts 0 in the mean over seeds, not missing.
    endings = [*ENDINGS, *sorted({r.ended for r in rollouts} - set(ENDINGS))]
    return {
        "mean_reward": round(sum(total) / n, 4),
        "format_rate": round(sum(f == 1.0 for f in formats) / n, 4),
        "answer_parsed_rate": round(answer_parsed_rate(columns["model_text"], columns["options"]), 4),
        "accuracy": round(sum(correctness_reward(completions, **columns)) / n, 4),
        "modal_answer_share": modal_share(answers),
        "searches_per_question": round(sum(len(r.searches) for r in rollouts) / n, 3),
        "retrieval_hit_rate": round(sum(hits) / len(hits), 4) if hits else 0.0,
        "mean_model_tokens": round(sum(r.generated_tokens for r in rollouts) / n, 1),
        "ended": {why: sum(r.ended == why for r in rollouts) for why in endings},
        "rewards": {name: round(sum(v or 0.0 for v in values) / n, 4) for name, values in scores.items()},
    }


class Evaluations:
    """Each model's greedy replies made once per mode and scored per stage: stage 2's after and stage 3's before
    are the same model searching, and the base model's before is shared by every seed. Each scoring keeps its
    replies in `kept/stage<S>_<phase>.jsonl.gz`."""

    def __init__(self, rows: list[dict[str, Any]], search, args: argparse.Namespace, kept: Path) -> None:
        self.rows, self.search, self.args, self.kept = rows, search, args, kept
        self.replies: dict[tuple[str, bool], dict[str, Any]] = {}
        self.known: dict[tuple[str, int], dict] = {}  # scores an earlier run recorded (a reused seed's base before)

    def __call__(self, model_dir: str, stage: int, config: MedR3TrainingConfig, phase: str) -> dict:
        if (model_dir, stage) in self.known:
            return self.known[model_dir, stage]
        searching = STAGES[stage].search
        if (model_dir, searching) not in self.replies:
            search = self.search if searching else None
            self.replies[model_dir, searching] = greedy_rollouts(model_dir, self.rows, search, self.args)
            log(
                f"rolled out {len(self.rows)} held-out prompts with {model_dir} "
                f"({'searching' if searching else 'without search'})"
            )
        keep = replies_path(self.kept, f"stage{stage}", phase)
        return score(self.replies[model_dir, searching], stage, config, self.rows, keep)


# A run's settings as its record states them: seeds added with --first-seed share them with the recorded ones.
RECORD_SETTINGS = (
    "model",
    "train_prompts",
    "eval_prompts",
    "steps_per_stage",
    "num_generations",
    "step_tokens",
    "temperature",
    "completion_tokens",
    "micro_batch",
    "sft_questions",
    "sft_epochs",
    "sft_balanced",
)


def record_settings(args: argparse.Namespace, eval_prompts: int) -> dict[str, Any]:
    return {
        "model": "tiny random (smoke)" if args.smoke else "gemma3-270m (base, LoRA per stage, merged between stages)",
        "train_prompts": args.train_questions,  # each seed's own (`seed_changes`)
        "eval_prompts": eval_prompts,
        "steps_per_stage": args.steps,
        "num_generations": args.generations,
        "step_tokens": args.step_tokens,
        "temperature": args.temperature,
        "completion_tokens": args.completion_tokens,
        "micro_batch": args.micro_batch,
        "sft_questions": args.sft_questions,
        "sft_epochs": args.sft_epochs if args.sft_questions else None,
        "sft_balanced": args.sft_balanced,
    }


def recorded_seeds(out: Path, first_seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The record at `out` that `--first-seed` adds to: its first `first_seed` chains and warm starts, after checking
    that it was made with `settings` (a record from before these fields were written states the warm start's
    questions in `sft_warm_start` and holds one chain at its top level). ValueError naming what disagrees."""
    if not out.is_file():
        raise ValueError(f"--first-seed {first_seed} adds to the record at {out}, which does not exist")
    try:
        record = json.loads(out.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{out} is not a results record: {err}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{out} is not a results record (a JSON object)")
    stated = {"sft_questions": record.get("sft_warm_start", {}).get("questions", 0), "sft_balanced": False, **record}
    differing = [
        f"{name}: recorded {stated[name]!r}, now {settings[name]!r}"
        for name in RECORD_SETTINGS
        if name in stated and stated[name] != settings[name]
    ]
    if differing:
        raise ValueError(f"{out} was recorded with other settings ({'; '.join(differing)})")
    one_chain = [{f"stage{s}": record[f"stage{s}"] for s in STAGES if f"stage{s}" in record}]
    one_chain = one_chain if record.get("seeds", {}).get("n") == 1 and len(one_chain[0]) == len(STAGES) else []
    chains = record.get("chains") or one_chain
    if len(chains) < first_seed:
        raise ValueError(f"{out} holds {len(chains)} seeds' chains, not the {first_seed} that --first-seed adds to")
    return {
        "record": record,
        "chains": chains[:first_seed],
        "warm_starts": record.get("sft_warm_start", {}).get("seeds", [])[:first_seed],
    }


def check_base_replies(earlier: dict[str, Any], here: dict[str, Any], out: Path) -> None:
    """Exit with one line unless the base model's held-out replies here (`here`, their scores) score as the record
    that --first-seed adds to had them (its `base_model`, else its first chain's stage-1 before): the same prompts,
    model and kind of CPU."""
    recorded = earlier["record"].get("base_model") or earlier["chains"][0]["stage1"]["before"]
    differing = sorted(k for k in {**recorded, **here} if recorded.get(k) != here.get(k))
    if differing:
        raise SystemExit(
            f"error: the base model's held-out replies score differently here than in {out} ({', '.join(differing)}):"
            " other prompts, another model or another kind of CPU; record these seeds in a new --out"
        )


def seed_runs(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that recorded a record's seeds (one entry for a record written before runs were listed)."""
    if not record:
        return []
    return record.get("seed_runs") or [
        {
            "seeds": list(range(record["seeds"]["n"])),
            "minutes": record.get("total_minutes"),
            "command": record.get("command"),
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "ermedrag" / "bench" / "med_r3"))
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "med_r3_learning.json"))
    parser.add_argument("--train-questions", type=int, default=24)
    parser.add_argument("--eval-questions", type=int, default=48)
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per stage")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO group)")
    parser.add_argument("--step-tokens", type=int, default=96, help="tokens per generation step")
    parser.add_argument("--completion-tokens", type=int, default=192, help="model-written tokens per rollout")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature of training rollouts (at 1.0 the base 270M model leaves the format "
        "in nearly every sample, so a group's rewards are all equal and GRPO learns nothing)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        help="completions per forward/backward pass (the rest of a group by gradient accumulation): "
        "a rollout's tokens include the inserted documents, and with the whole group of 4 in "
        "one pass stage 2 ran out of 24 GB",
    )
    parser.add_argument("--eval-batch", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=1, help="run the chain of stages this many times (seeds 0..N-1)")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="add seeds K..K+N-1 to the seeds 0..K-1 recorded in --out (their work folder need not be here)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take each seed whose chain an earlier run finished with the same settings from its "
        "record (to add seeds, or go on after a stop); only while the training code is unchanged",
    )
    parser.add_argument(
        "--sft-questions",
        type=int,
        default=0,
        help="a lever: warm-start each seed with the product's SFT on this many questions' reference replies "
        "before stage 1 (0: none)",
    )
    parser.add_argument("--sft-epochs", type=float, default=1.0, help="epochs of the warm start")
    parser.add_argument(
        "--sft-balanced",
        action="store_true",
        help="draw the warm start's questions balanced by gold answer (else as the pool has them: 55%% yes)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny random model and sizes: checks the pipeline")
    args = parser.parse_args()
    if args.micro_batch < 1 or args.generations % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide --generations {args.generations}")
    if args.first_seed < 0:
        parser.error(f"--first-seed {args.first_seed} must be at least 0")
    started = time.time()

    work = Path(args.work) / ("smoke" if args.smoke else "full")
    hold_work_folder(work)
    for old in [] if args.reuse else work.glob("train*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from ermedrag.testing.tiny_model import build_tiny_causal_lm

        model_path = build_tiny_causal_lm(work / "tiny")
        args.train_questions, args.eval_questions, args.steps = 4, 3, 1
        args.generations, args.step_tokens, args.completion_tokens, args.micro_batch = 2, 16, 32, 1
        args.sft_questions = min(args.sft_questions, 6)
    else:
        from ermedrag.tools.models.offline import offline_model_dir

        model_path = str(offline_model_dir())

    pool = load_questions_file(Path(args.data) / "benchmarks" / "pubmedqa_train.jsonl")
    random.Random(0).shuffle(pool)
    held_out = balanced_by_answer(pool[args.train_questions :], args.eval_questions)
    out = Path(args.out) if not args.smoke else work / "med_r3_learning.json"
    settings = record_settings(args, len(held_out))
    try:
        earlier = recorded_seeds(out, args.first_seed, settings) if args.first_seed else {}
    except ValueError as err:
        parser.error(str(err))
    index_dir = work / "index"
    stats = build_index(abstracts_as_documents(pool), index_dir, progress=False)
    index = open_index(index_dir)
    log(
        f"indexed {len(pool)} abstracts: {stats['chunks_total']} chunks ({stats['chunks_added']} new, "
        f"{stats['seconds']:.0f} s)"
    )
    index_ids = {cid.rsplit("#", 1)[0] for cid in index.bm25_ids}
    eval_rows = rows_for(held_out, index_ids)
    search = index_search(index, k=5)

    config = MedR3TrainingConfig(
        model=model_path,
        dataset="",  # each seed's own, below
        output_dir=str(work / "train"),
        index_dir=str(index_dir),
        max_steps=args.steps,
        learning_rate=1e-4,
        num_generations=args.generations,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.generations // args.micro_batch,
        max_completion_length=args.completion_tokens,
        step_max_new_tokens=args.step_tokens,
        temperature=args.temperature,
        save_steps=10_000,
        mask_truncated_completions=False,
    )
    evaluations = Evaluations(eval_rows, search, args, out.with_suffix("") / "replies")
    if earlier:  # measured before any training: a record it cannot add to stops the run at once
        check_base_replies(earlier, evaluations(model_path, 1, config, "base"), out)
    chains, warm_starts = list(earlier.get("chains", [])), list(earlier.get("warm_starts", []))
    reused_seeds: list[int] = []
    for seed in range(args.first_seed, args.first_seed + max(args.seeds, 1)):
        train_questions = training_sample(pool, held_out, pool[: args.train_questions], seed)
        train_rows = rows_for(train_questions, index_ids)
        dataset = work / f"train-dataset-s{seed}"
        med_r3_dataset(train_rows).save_to_disk(str(dataset))
        inputs = inputs_key(args.data, [r["id"] for r in train_rows], [r["id"] for r in eval_rows])
        start_model = model_path
        if args.sft_questions:
            sft_questions = warm_start_questions(
                pool, held_out, train_questions, args.sft_questions, seed, args.sft_balanced
            )
            warm_starts.append(warm_start(model_path, rows_for(sft_questions, index_ids), work, seed, args))
            start_model = warm_starts[-1]["model_dir"]
            inputs["starts_from"] = warm_starts[-1]["stamp"]  # a warm start trained again: the chain too
        chain, reused = run_stages(
            replace(
                config, model=start_model, seed=seed, dataset=str(dataset), output_dir=str(work / f"train-s{seed}")
            ),
            evaluations,
            {**inputs, "eval_batch": args.eval_batch},
            args.reuse,
        )
        chains.append(chain)
        reused_seeds += [seed] if reused else []
    result: dict[str, Any] = dict(chains[0])  # the first seed's stages, as one run reports them
    result["seeds"] = {"n": len(chains), **{name: part_over_seeds(chains, name, len(eval_rows)) for name in chains[0]}}
    result["baselines"] = answer_baselines(eval_rows, [r["prompt"] for r in med_r3_dataset(eval_rows)])
    if warm_starts:  # the chains start from the warm starts: the base model's own scores beside them
        result["base_model"] = evaluations(model_path, 1, config, "base")
        result["sft_warm_start"] = {
            "questions": args.sft_questions,
            "balanced_by_answer": args.sft_balanced,
            "preset": "sft_med_r3",
            "seeds": warm_starts,
        }
    if not args.smoke:
        for stage in STAGES:
            plot = chains[0][f"stage{stage}"].get("plot_path")
            if plot:
                # named after --out (med_r3_learning_sft.json: med_r3_sft_stage1_curves.png), so a lever's run
                # never overwrites the default record's curves
                shutil.copy(plot, out.with_name(f"{out.stem.replace('_learning', '')}_stage{stage}_curves.png"))
    for chain in chains:
        for entry in chain.values():
            entry.pop("plot_path", None)
    result.update(
        {
            **settings,
            "decoding": "greedy, same held-out prompts before and after each stage, in the stage's mode",
            "reused_seeds": reused_seeds,  # their minutes are those of the run that trained them
            "recorded_seeds": list(range(args.first_seed)),  # taken from the record this run added to
            "seed_changes": SEED_CHANGES,
            "chains": chains,  # each seed's, in seed order: what --first-seed reads back
            "seed_runs": [
                *seed_runs(earlier.get("record", {})),
                {
                    "seeds": list(range(args.first_seed, len(chains))),
                    "minutes": round((time.time() - started) / 60, 1),
                    "command": command_line(),
                },
            ],
        }
    )
    write_result(result, out, started)


def run_stages(
    config: MedR3TrainingConfig, evaluations: Evaluations, inputs: dict[str, Any], reuse: bool
) -> tuple[dict[str, dict], bool]:
    """The three stages in order with `config`'s seed, each measured before and after on the held-out prompts in
    its own mode, and whether they were reused: with `reuse`, a seed whose chain an earlier run finished with the
    same config and `inputs` (data, questions, held-out batch) is taken from its record instead."""
    chain, reused = run_or_reuse(
        Path(config.output_dir),
        {"config": comparable_settings(config), **inputs},
        lambda: train_and_measure(config, evaluations),
        reuse,
    )
    if reused:
        log(f"seed {config.seed}: reusing the chain an earlier run finished in {config.output_dir}")
        evaluations.known[stage_start_model(config, 1), 1] = chain["stage1"]["before"]
    return chain, reused


def train_and_measure(config: MedR3TrainingConfig, evaluations: Evaluations) -> dict[str, dict]:
    result = {}
    for stage in STAGES:
        before = evaluations(stage_start_model(config, stage), stage, config, f"seed{config.seed}_before")
        log(f"stage {stage} (seed {config.seed}) before: {json.dumps(before)}")
        stage_started = time.time()
        summary = train_med_r3(config, stages=[stage])["stages"][stage]
        minutes = (time.time() - stage_started) / 60
        after = evaluations(summary["model_dir"], stage, config, f"seed{config.seed}_after")
        log(f"stage {stage} (seed {config.seed}) after ({minutes:.1f} min): {json.dumps(after)}")
        result[f"stage{stage}"] = {
            "name": STAGES[stage].name,
            "search": STAGES[stage].search,
            "before": before,
            "after": after,
            "steps": summary["steps"],
            "minutes": round(minutes, 1),
            "reward_weights": summary["reward_weights"],
            "plot_path": summary.get("plot_path"),
        }
    return result


if __name__ == "__main__":
    main()
