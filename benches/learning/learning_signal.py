"""Learning signal on CPU: does training on our own recorded traces move the agents?

The whole loop, with real parts, on PubMedQA-train questions (their abstracts as the corpus):
  1. index the abstracts; record ER-MedRAG runs with the offline model (train and held-out questions in
     separate trace databases);
  2. export GRPO respondent prompts (with distractor triplets) and DPO extractor pairs from the traces;
  3. measure the base model on held-out prompts; train GRPO (respondent) and DPO (extractor) with LoRA;
     merge each adapter and measure again on the same held-out prompts with the same greedy decoding.
Writes benches/results/learning.json (and the curves of both trainings next to it).

    .venv/bin/python benches/learning/learning_signal.py                 # ≈ 45 minutes on 2 cores
    .venv/bin/python benches/learning/learning_signal.py --smoke         # tiny random model, ~2 minutes
    .venv/bin/python benches/learning/learning_signal.py --reuse --parts grpo   # rerun one training only
    .venv/bin/python benches/learning/learning_signal.py --seeds 3       # each training 3 times (seeds 0, 1, 2)
    .venv/bin/python benches/learning/learning_signal.py --reuse --reuse-trained --seeds 3   # train seed 2 only

With `--seeds N` every training runs N times from the base model (seeds 0..N-1: each records ER-MedRAG runs on
its own training questions, `seeds.training_sample`, and exports its own GRPO prompts and DPO pairs from them; LoRA
initialisation, data order, sampled rollouts) against one before, measured once on the same held-out prompts;
`seeds.over_seeds` reports each metric's mean ± sd after, per-seed values and how many seeds improved it.
Held-out prompts: the `--eval-questions` PubMedQA-train questions after the training ones in one seeded shuffle
(disjoint from them), yes, no and maybe taken in turn (`evals.baselines.balanced_by_answer`: always one answer
scores a third).
`--reuse-trained` measures again each seed whose merged model an earlier run finished with the same training
config (`seeds.RUN_FILE` marks it), so that adding a seed, or a metric, costs no retraining of the others.
The results file is written after each seed: a run stopped part way keeps the seeds it finished (`progress` names
the last one) and goes on with `--reuse --first-seed K`. Each measurement keeps the held-out replies it scored
(`heldout_replies.json` in the seed's merged model, and in `<arm>-before` / `extractor-before` for the base
model), so a metric added later can be read off them; and beside the results file, in the repository, with what
each answered, its gold and its reward parts (`<out stem>/replies/<arm>_<before|seedN_after>.jsonl.gz`,
`kept_replies`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
# The default GRPO arm's steps, sampling and worked example; a lever arm that changes one is recorded under its
# own key.
GRPO_DEFAULTS = {
    "steps": 50,
    "generations": 4,
    "temperature": 0.7,
    "prompts": 1,  # "prompts": per optimizer step
    "resample": 0,  # dynamic sampling: batches a step may draw again (training.grpo)
    "example": "current",
}  # the respondent's worked example (worked_examples.EXAMPLES)
# --smoke's sizes (a tiny random model): they replace these options' values, and are its arms' defaults.
SMOKE_SIZES = {
    "train_questions": 6,
    "eval_questions": 4,
    "grpo_steps": 2,
    "dpo_steps": 2,
    "extract_tokens": 16,
    "respond_tokens": 24,
}
# Beside each measurement (a merged seed, a before): the held-out replies it scored.
REPLIES_FILE = "heldout_replies.json"
# Steps between checkpoints: a training killed part way goes on from its last checkpoint when rerun with --reuse.
CHECKPOINT_STEPS = 10

from ermedrag.offline import go_offline  # noqa: E402

go_offline()  # before datasets and transformers read their settings, at import

from datasets import load_from_disk  # noqa: E402

from ermedrag.agents import extractor, respondent  # noqa: E402
from ermedrag.agents.base import to_chat, to_langchain  # noqa: E402
from ermedrag.tools.agent_calls import text_with_stop  # noqa: E402
from ermedrag.tools.data.benchmarks import Question, load_questions_file  # noqa: E402
from ermedrag.evals.baselines import balanced_by_answer, modal_share, trivial_baselines  # noqa: E402
from ermedrag.evals.rows import EvalConfig
from ermedrag.evals.runner import run_questions  # noqa: E402
from ermedrag.tools.models import load_chat_model  # noqa: E402
from ermedrag.tools.retrieval.corpus import Document  # noqa: E402
from ermedrag.tools.retrieval.index import build_index  # noqa: E402
from ermedrag.tools.records.jsonl import read_records, replace_text  # noqa: E402
from ermedrag.tools.machine import cpu_model  # noqa: E402
from ermedrag.tools.records.traces import TraceStore  # noqa: E402
from ermedrag.training.rewards.answers import (
    cited_numbers,
    correctness_reward,
    evidence_references,  # noqa: E402
    numbered_triplets,
)
from ermedrag.training.checkpoints import resume_checkpoint  # noqa: E402
from ermedrag.training.config import DPOTrainingConfig, GRPOTrainingConfig  # noqa: E402
from ermedrag.training.export import (
    DPOExportConfig,
    GRPOExportConfig,
    export_dpo,
    export_grpo,  # noqa: E402
    reselect_pairs,
)
from ermedrag.training.rewards.extraction import extractor_reward  # noqa: E402
from ermedrag.training.rewards import RESPONDENT_REWARDS, resolve_rewards  # noqa: E402
from ermedrag.training.trainers import train_dpo, train_grpo  # noqa: E402

from seeds import (
    LEARNING_WORK,
    RUN_FILE,
    SEED_CHANGES,
    accuracy_interval,
    afters_from_summary,
    allocator_env,  # noqa: E402
    common_seed_count,
    gain,
    grpo_prompts,
    hold_work_folder,
    learning_run,
    over_seeds,
    reads_rewards,
    record_trained,
    trained_earlier,
    training_identity,
    training_sample,
)
from kept_replies import replies_path, write_replies  # noqa: E402
from worked_examples import EXAMPLES  # noqa: E402


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def abstracts_as_documents(questions: list[Question]) -> list[Document]:
    return [
        Document(
            id=f"{q.id}-{i}",
            title=f"PMID {q.id.removeprefix('pubmedqa-')}",
            text=text,
            source="PubMedQA-train abstract",
        )
        for q in questions
        for i, text in enumerate(q.contexts)
    ]


def record(
    questions: list[Question], model: str, index_dir: Path, trace_db: Path, work: Path, args: argparse.Namespace
) -> None:
    import asyncio

    config = EvalConfig.for_graph(
        "er_medrag",
        {
            "extractor_model": model,
            "respondent_model": model,
            "index_dir": str(index_dir),
            "snippets_k": args.snippets,
            "extractor_max_new_tokens": args.extract_tokens,
            "respondent_max_new_tokens": args.respond_tokens,
        },
    )
    counts = asyncio.run(
        run_questions(
            config, questions, work / f"runs-{trace_db.stem}", concurrency=args.concurrency, trace_db=str(trace_db)
        )
    )
    log(f"recorded {trace_db.name}: {counts}")


def generate(model_spec: str, prompts: list[list[dict[str, str]]], max_new_tokens: int, stop: list[str]) -> list[str]:
    """Greedy completions of chat prompts, batched, ending at the agent's stop strings as in the app (the
    matched one put back, as `tools.agent_calls.call_agent` does): the same decoding before and after training."""
    model = load_chat_model(model_spec, max_new_tokens=max_new_tokens)
    replies = model.batch([to_langchain(p) for p in prompts], stop=stop)
    return [text_with_stop(reply, stop) for reply in replies]


def generate_kept(
    model_spec: str, prompts: list[list[dict[str, str]]], max_new_tokens: int, stop: list[str], folder: Path
) -> list[str]:
    """`generate`, keeping the replies in `folder/REPLIES_FILE` with a fingerprint of their prompts, so that a metric
    added later can be read off the very replies a recorded figure came from."""
    replies = generate(model_spec, prompts, max_new_tokens, stop)
    folder.mkdir(parents=True, exist_ok=True)
    fingerprint = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()
    replace_text(
        folder / REPLIES_FILE,
        json.dumps(
            {"model": model_spec, "max_new_tokens": max_new_tokens, "prompts_sha256": fingerprint, "replies": replies},
            indent=1,
        ),
    )
    return replies


def answer_parsed_rate(texts: list[str], options: list[dict[str, str] | None]) -> float:
    """Share of texts from which the app's answer parser reads an answer, well formed or not."""
    return sum(respondent.parse_answer(t, o)["ok"] for t, o in zip(texts, options)) / max(len(texts), 1)


def respondent_metrics(
    completions: list[str], rows: list[dict[str, Any]], keep: Path | None = None
) -> dict[str, float]:
    """Every reward component separately (a gain that is only format or only brevity shows as such), the app's
    accuracy, and how long the reasoning is; each reply with its parsed answer, gold and reward parts kept in
    `keep` (`kept_replies`)."""
    columns = {key: [row.get(key) for row in rows] for key in ("gold", "options", "triplets", "question")}
    rewards = resolve_rewards(None, RESPONDENT_REWARDS)  # what train_grpo trains with
    scores = {r.func.__name__: r.func(completions, **columns) for r in rewards}
    total = [sum(r.weight * scores[r.func.__name__][i] for r in rewards) for i in range(len(completions))]
    parsed = [respondent.parse_answer(c, o) for c, o in zip(completions, columns["options"])]
    if keep is not None:
        write_replies(
            keep,
            (
                {
                    "prompt_id": row.get("run_id"),
                    "reply": reply,
                    "answer": answer["answer"],
                    "well_formed": answer["well_formed"],
                    "gold": row.get("gold"),
                    "rewards": {name: values[i] for name, values in scores.items()},
                }
                for i, (reply, answer, row) in enumerate(zip(completions, parsed, rows))
            ),
        )
    n = max(len(completions), 1)
    return {
        "modal_answer_share": modal_share([p["answer"] for p in parsed]),  # 1.0: one answer for everything
        "well_formed_rate": sum(s == 1.0 for s in scores["format_reward"]) / n,
        "answer_parsed_rate": answer_parsed_rate(completions, columns["options"]),
        # what the app would score: any answer its parser reads, well formed or not
        "accuracy": sum(correctness_reward(completions, **columns)) / n,
        "mean_reward": sum(total) / n,
        **{f"reward/{name}": sum(values) / n for name, values in scores.items()},
        "mean_chars": sum(len(c) for c in completions) / n,
        "mean_reasoning_chars": sum(len(p.get("reasoning") or "") for p in parsed) / n,
        **citations(parsed, rows),
    }


def answer_baselines(rows: list[dict[str, Any]], prompts: list | None = None) -> dict[str, Any]:
    """Chance, the held-out majority answer, always the first option and (with prompts) copying the worked example,
    on these held-out rows (`evals.baselines`)."""
    shown = [[key for key, text in (r.get("options") or {}).items() if text is not None] for r in rows]
    return trivial_baselines([r["gold"] for r in rows], shown, prompts)  # rows from disk carry None for absent keys


def citations(parsed: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, float]:
    """Shares of replies whose reasoning cites by number some evidence line shown, a relevant one, a distractor,
    the first line, and that names a line (number or snippet id) without using its words. Evidence use gained by
    copying the worked example's "Evidence 1" shows in the last two: line 1 is cited whatever it holds."""
    counts = {
        "cites_a_number": 0,
        "cites_relevant_number": 0,
        "cites_distractor_number": 0,
        "cites_first_line": 0,
        "names_unused_line": 0,
    }
    for reply, row in zip(parsed, rows):
        triplets = numbered_triplets(row["triplets"])
        shown = {t["number"]: t["distractor"] for t in triplets}
        cited = [n for n in cited_numbers(str(reply.get("reasoning") or "")) if n in shown]
        distractor_flags = [shown[n] for n in cited]
        counts["cites_a_number"] += bool(distractor_flags)
        counts["cites_first_line"] += 1 in cited
        counts["cites_relevant_number"] += not all(distractor_flags)
        counts["cites_distractor_number"] += any(distractor_flags)
        references = evidence_references(reply, row.get("options"), triplets, str(row.get("question") or ""))
        counts["names_unused_line"] += any(ref.named and not ref.restated for ref in references)
    return {name: count / max(len(parsed), 1) for name, count in counts.items()}


def extractor_metrics(
    completions: list[str], events: list[dict[str, Any]], keep: Path | None = None
) -> dict[str, float]:
    """The extractor's parse rates and reward parts on held-out snippets; each reply with its triplets and reward
    parts kept in `keep` (`kept_replies`)."""
    parsed = [extractor.parse_triplets(c, "s") for c in completions]
    scored = [
        extractor_reward(c, e["inputs"]["snippet"], question=e["inputs"]["question"])
        for c, e in zip(completions, events)
    ]
    if keep is not None:
        write_replies(
            keep,
            (
                {
                    "prompt_id": event.get("event_id"),
                    "reply": reply,
                    "triplets": triplets["triplets"],
                    "parsed": triplets["ok"],
                    "rewards": dataclasses.asdict(s),
                }
                for reply, triplets, s, event in zip(completions, parsed, scored, events)
            ),
        )
    with_claims = [s for s, p in zip(scored, parsed) if p["triplets"]]  # faithfulness and conciseness judge claims
    return {
        "parseable_rate": sum(p["ok"] for p in parsed) / len(parsed),
        "strict_json_rate": sum(p["ok"] and p["strict"] for p in parsed) / len(parsed),
        "mean_reward": sum(s.total for s in scored) / len(scored),
        "reward/structure": sum(s.structure for s in scored) / len(scored),
        "reward/faithfulness": sum(s.faithfulness for s in with_claims) / max(len(with_claims), 1),
        "reward/conciseness": sum(s.conciseness for s in with_claims) / max(len(with_claims), 1),
        "mean_triplets": sum(len(p["triplets"]) for p in parsed) / len(parsed),
        "mean_completion_chars": sum(len(c) for c in completions) / len(completions),
    }


def merged_model(adapter_dir: str, base: str, out: Path) -> str:
    """The base model with a LoRA adapter merged in, saved as a plain folder for the hf: backend in the base
    checkpoint's own dtype, so that the after decodes as the before does (the offline model is stored in bfloat16;
    float32 decoding is several times slower on these CPUs). The merge itself is done in float32 and rounded once."""
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from ermedrag.tools.machine import checkpoint_dtype

    model = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype="float32").merge_and_unload()
    model.to(getattr(torch, checkpoint_dtype(base) or "float32")).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("ERMEDRAG_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--work", default=str(LEARNING_WORK))
    parser.add_argument(
        "--out",
        help="results JSON (default: benches/results/learning.json; for a GRPO lever arm, "
        "any --grpo-* setting off its default, learning_grpo_levers.json beside it)",
    )
    parser.add_argument("--parts", default="grpo,dpo", help="which trainings to run: grpo, dpo or both")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the work folder's index, traces and exports from an earlier run (same sizes)",
    )
    parser.add_argument(
        "--reuse-trained",
        action="store_true",
        help="with --reuse, also measure again (not train again) each seed an earlier run trained and "
        "merged with the very same training config; only while the training code is unchanged",
    )
    parser.add_argument("--train-questions", type=int, default=32)
    parser.add_argument("--eval-questions", type=int, default=48)
    parser.add_argument("--snippets", type=int, default=2)
    parser.add_argument("--extract-tokens", type=int, default=64)
    parser.add_argument("--respond-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--grpo-steps",
        type=int,
        default=GRPO_DEFAULTS["steps"],
        help="GRPO optimizer steps (other than the default: a lever arm, ..._steps_N; with "
        "--grpo-prompts-per-step 2, 25 steps sample as many completions as the default 50)",
    )
    parser.add_argument(
        "--grpo-generations",
        type=int,
        default=GRPO_DEFAULTS["generations"],
        help="completions sampled per prompt (a GRPO group; other than the default: a lever arm, "
        "recorded as grpo_respondent_generations_N)",
    )
    parser.add_argument(
        "--grpo-temperature",
        type=float,
        default=GRPO_DEFAULTS["temperature"],
        help="sampling temperature of GRPO rollouts (at 1.0 nearly every sample of the base 270M "
        "model leaves the format, a group's rewards are equal and GRPO learns nothing; other "
        "than the default: a lever arm, grpo_respondent_temperature_T)",
    )
    parser.add_argument(
        "--grpo-prompts-per-step",
        type=int,
        default=GRPO_DEFAULTS["prompts"],
        help="prompts (groups) per optimizer step, sampled together, the loss accumulated over as "
        "many passes of one group's size: with one, a step whose group got equal rewards "
        "teaches nothing (a lever arm, grpo_respondent_prompts_N)",
    )
    parser.add_argument(
        "--grpo-resample",
        type=int,
        default=GRPO_DEFAULTS["resample"],
        help="dynamic sampling: a step whose group got equal rewards draws fresh training prompts up "
        "to this many times and trains on the first with a signal (a lever arm, "
        "grpo_respondent_resample_N; training.grpo)",
    )
    parser.add_argument(
        "--grpo-respond-tokens",
        type=int,
        default=None,
        help="train and measure the respondent with this token budget instead of --respond-tokens "
        "(a lever arm, recorded as grpo_respondent_tokens_N; the graph's own default is 192: a "
        "smaller budget cuts long reasoning, and GRPO then rewards being short)",
    )
    parser.add_argument(
        "--grpo-example",
        choices=sorted(EXAMPLES),
        default=GRPO_DEFAULTS["example"],
        help="the respondent's worked example in the training and held-out prompts (current: as "
        "recorded; cites_number: its reasoning cites 'Evidence 1'; cites_among_two: two "
        "evidence lines, citing the second; worked_examples.py). Other than current: a lever "
        "arm, grpo_respondent_example_NAME, with its own before and training copy",
    )
    parser.add_argument(
        "--grpo-evidence-weight",
        type=float,
        default=None,
        help="train the respondent with this weight on evidence_use_reward instead of the default "
        f"{RESPONDENT_REWARDS['evidence']} (a lever arm, recorded as grpo_respondent_evidence_W; "
        "its mean_reward is still scored with the default weights, comparable across arms)",
    )
    parser.add_argument("--dpo-steps", type=int, default=20)
    parser.add_argument("--dpo-samples", type=int, default=3)
    parser.add_argument(
        "--dpo-temperature",
        type=float,
        default=1.0,
        help="temperature the DPO export samples alternatives at (other than 1: its own export "
        "folder and result keys, e.g. dpo_extractor_close_cut_t0.7)",
    )
    parser.add_argument(
        "--dpo-close-cut",
        choices=("off", "on", "both"),
        default="on",
        help="DPOExportConfig.close_cut_lists: also score each candidate the budget cut, closed after "
        "its last complete triplet; `both` trains both settings on the same sampled candidates "
        "(seeds.dpo_extractor: off, seeds.dpo_extractor_close_cut: on)",
    )
    parser.add_argument("--seeds", type=int, default=1, help="train each agent this many times (seeds 0..N-1)")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="add seeds first..first+N-1 to the --out file's seeds 0..first-1 (same before, --reuse)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny random model and sizes: checks the pipeline")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE_SIZES)
    if args.first_seed and not args.reuse:
        parser.error("--first-seed adds seeds to a recorded run: pass --reuse (the same traces, prompts and before)")
    if args.reuse_trained and not args.reuse:
        parser.error("--reuse-trained measures seeds trained in the work folder: pass --reuse as well")
    if (
        args.grpo_generations < 2
        or args.grpo_prompts_per_step < 1
        or args.grpo_temperature <= 0
        or args.grpo_resample < 0
    ):
        parser.error(
            "--grpo-generations must be at least 2 (a group), --grpo-prompts-per-step at least 1, "
            "--grpo-temperature above 0, --grpo-resample 0 or more"
        )
    if args.out is None:  # a lever arm never lands in learning.json, whose seeds.n counts every part's seeds
        lever = grpo_arm(args)[0] != "grpo_respondent"
        args.out = str(REPO / "benches" / "results" / ("learning_grpo_levers.json" if lever else "learning.json"))
    if not Path(args.out).resolve().parent.is_dir():  # found before hours of training, not after
        parser.error(f"--out {args.out}: its folder does not exist")
    parts = set(args.parts.split(","))
    if not parts or parts - {"grpo", "dpo"}:
        parser.error(f"--parts {args.parts!r}: expected grpo, dpo or grpo,dpo")
    started = time.time()

    work = learning_run(Path(args.work), args.smoke)
    hold_work_folder(work)
    if not args.reuse:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from ermedrag.testing.tiny_model import build_tiny_causal_lm

        model_path = build_tiny_causal_lm(work / "tiny")
    else:
        from ermedrag.tools.models.offline import offline_model_dir

        model_path = str(offline_model_dir())
    model = f"hf:{model_path}"

    out = Path(args.out) if not args.smoke else work / "learning.json"
    result = json.loads(out.read_text()) if out.exists() else {}
    refuse_combined(
        result, out, ([grpo_arm(args)[0]] if "grpo" in parts else []) + (dpo_keys(args) if "dpo" in parts else [])
    )
    questions = split_questions(args)
    train_db, eval_db = TrainingSplit.of_seed(work, 0).traces, work / "traces-eval.sqlite"
    if not (args.reuse and grpo_prompts(work, "eval").exists()):
        prepare(args, work, model, train_db, eval_db, questions)
    seeds = list(range(args.first_seed, args.first_seed + max(args.seeds, 1)))
    # Each seed learns from questions of its own (seed 0: the recorded ones): their traces, GRPO prompts, DPO pairs
    splits = {seed: seed_training_split(args, work, model, questions, seed) for seed in seeds}
    arms = {seed: dpo_arms(args, work, splits[seed]) for seed in seeds} if "dpo" in parts else {}

    eval_rows = [dict(r) for r in load_from_disk(str(grpo_prompts(work, "eval")))]
    eval_events = list(TraceStore(eval_db).events(agent="extractor"))
    if "dpo" in parts and not eval_events:
        raise SystemExit(
            f"{eval_db} holds no extractor calls to measure the extractor on: record the held-out "
            "traces again (run without --reuse)"
        )
    extract_prompts = [to_chat(e["messages"]) for e in eval_events]
    results_dir = Path(args.out).parent
    kept = out.with_suffix("") / "replies"  # benches/results/learning/replies/<arm>_<phase>.jsonl.gz

    recorded = result.get("seeds", {})
    result["seeds"] = dict(recorded)  # --parts grpo keeps the DPO summary

    def recorded_afters(key: str, before: dict[str, float]) -> list[dict[str, float]]:
        """The seeds recorded before --first-seed (read before training: a different before stops the run)."""
        try:
            return afters_from_summary(recorded.get(key, {}), before, args.first_seed) if args.first_seed else []
        except ValueError as err:
            raise SystemExit(
                f"--first-seed {args.first_seed} cannot add to {key} in {out}: {err}. Recorded on CPU "
                f"{result.get(key, {}).get('cpu', '(not recorded)')}; this machine's: {cpu_model()} "
                "(see benches/README: seeds add up only on the same kind of CPU)"
            ) from None

    def recorded_arm(key: str) -> dict[str, Any]:
        """What the --out file held for the arm (its record and its seeds summary) that --first-seed adds to."""
        return {"record": result.get(key, {}), "seeds": recorded.get(key, {})} if args.first_seed else {}

    if "grpo" in parts:
        key, arm = grpo_arm(args)
        eval_prompts = [EXAMPLES[arm.example](r["prompt"]) for r in eval_rows]
        before = respondent_metrics(
            generate_kept(model, eval_prompts, arm.tokens, respondent.STOP, work / f"{arm.folder}-before"),
            eval_rows,
            keep=replies_path(kept, key, "before"),
        )
        log(f"before: respondent {before}")
        prior, earlier = recorded_afters(key, before), recorded_arm(key)
        runs = []
        for seed in seeds:
            replies = replies_path(kept, key, f"seed{seed}_after")
            runs.append(grpo_run(args, work, model_path, eval_prompts, eval_rows, seed, arm, splits[seed], replies))
            afters = prior + [r["after"] for r in runs]
            result[key], result["seeds"][key] = grpo_records(
                args, arm, before, afters, runs, seeds, earlier, len(eval_rows)
            )
            write_progress(result, out, started, f"{key} seed {seed}", seeds)
        copy_curves(runs, args, results_dir / f"learning_{key}_curves.png")
        result[key]["baselines"] = answer_baselines(eval_rows, eval_prompts)

    if arms:
        before = extractor_metrics(
            generate_kept(model, extract_prompts, args.extract_tokens, extractor.STOP, work / "extractor-before"),
            eval_events,
            keep=replies_path(kept, "extractor", "before"),
        )
        log(f"before: extractor {before}")
    for key in dpo_keys(args) if arms else []:
        prior, earlier = recorded_afters(key, before), recorded_arm(key)
        runs = []
        for seed in seeds:
            replies = replies_path(kept, key, f"seed{seed}_after")
            runs.append(dpo_run(args, arms[seed][key], work, model_path, extract_prompts, eval_events, seed, replies))
            afters = prior + [r["after"] for r in runs]
            result[key], result["seeds"][key] = dpo_records(
                args, key, arms[seeds[0]][key], before, afters, runs, seeds, earlier, len(eval_events)
            )
            write_progress(result, out, started, f"{key} seed {seed}", seeds)
        copy_curves(runs, args, results_dir / f"learning_{key}_curves.png")

    result.pop("progress", None)  # every part's seeds are recorded
    write_result(result, out, started)


@dataclass(frozen=True)
class GRPOArm:
    """One GRPO arm: its reward weights over the respondent's defaults (empty: the defaults), the respondent's
    token budget in training and in the held-out before and after, its sampling (completions per prompt,
    temperature, prompts per optimizer step, batches a silent step may draw again), the worked example in its
    prompts, and its folders' prefix."""

    weights: dict[str, float]
    tokens: int
    generations: int
    temperature: float
    prompts_per_step: int
    resample: int
    example: str
    folder: str

    def prepare_train_dataset(self, work: Path, split: str = "train") -> Path:
        """The training prompts: the exported ones, or a copy with this arm's worked example (written whole or not
        at all: a killed write leaves no folder to reuse). A copy whose prompts are no longer the export rewritten
        by today's `EXAMPLES` entry is written again, and the seeds trained on it are no longer reused."""
        exported = grpo_prompts(work, split)
        if self.example == GRPO_DEFAULTS["example"]:
            return exported
        rewritten = work / f"{self.folder}-{split}" / "dataset"
        rewrite = EXAMPLES[self.example]
        exported_rows = load_from_disk(str(exported))  # in memory: no cache files in the shared export
        expected = [rewrite(prompt) for prompt in exported_rows["prompt"]]
        if rewritten.exists() and load_from_disk(str(rewritten))["prompt"] == expected:
            return rewritten
        if rewritten.exists():
            log(
                f"{rewritten.parent.name}: its worked example is not today's {self.example!r}: written again, "
                "its trained seeds retrained"
            )
            for marker in work.glob(f"{self.folder}-merged-s*/{RUN_FILE}"):
                marker.unlink()
            for checkpoints in work.glob(f"{self.folder}-out-s*"):  # else a rerun resumes at their last step
                shutil.rmtree(checkpoints)
        partial = rewritten.with_name("dataset.partial")
        shutil.rmtree(partial, ignore_errors=True)
        exported_rows.map(lambda row: {"prompt": rewrite(row["prompt"])}, keep_in_memory=True).save_to_disk(
            str(partial)
        )
        shutil.rmtree(rewritten, ignore_errors=True)
        partial.rename(rewritten)
        return rewritten


def grpo_arm(args: argparse.Namespace) -> tuple[str, GRPOArm]:
    """The result key and settings of the arm that the lever options ask for: each setting other than its
    default names a part of the key and folders (none: the default arm, `grpo_respondent`)."""
    weights = {} if args.grpo_evidence_weight is None else {"evidence": args.grpo_evidence_weight}
    tokens = args.respond_tokens if args.grpo_respond_tokens is None else args.grpo_respond_tokens
    settings = {
        "evidence": weights.get("evidence"),
        "tokens": tokens,
        "generations": args.grpo_generations,
        "temperature": args.grpo_temperature,
        "prompts": args.grpo_prompts_per_step,
        "resample": args.grpo_resample,
        "example": args.grpo_example,
        "steps": args.grpo_steps,
    }
    defaults = {
        "evidence": None,
        "tokens": args.respond_tokens,
        **GRPO_DEFAULTS,
        "steps": SMOKE_SIZES["grpo_steps"] if args.smoke else GRPO_DEFAULTS["steps"],
    }
    levers = [(name, exact_label(value)) for name, value in settings.items() if value != defaults[name]]
    key = "grpo_respondent" + "".join(f"_{name}_{value}" for name, value in levers)
    folder = "grpo" + "".join(f"-{name}{value}" for name, value in levers)
    return key, GRPOArm(
        weights,
        tokens,
        args.grpo_generations,
        args.grpo_temperature,
        args.grpo_prompts_per_step,
        args.grpo_resample,
        args.grpo_example,
        folder,
    )


def exact_label(value: float | str) -> str:
    """A number as short as it reads back exactly (1.0 → "1", 0.7 → "0.7", 0.7000001 stays itself); a name as is."""
    if isinstance(value, str):
        return value
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def grpo_run(
    args: argparse.Namespace,
    work: Path,
    model_path: str,
    eval_prompts: list,
    eval_rows: list[dict],
    seed: int,
    arm: GRPOArm,
    split: TrainingSplit,
    replies: Path,
) -> dict[str, Any]:
    """Train the respondent with GRPO from the base model (one seed, on its own split) and measure it on the
    held-out prompts (its replies kept in `replies`)."""
    config = GRPOTrainingConfig(
        model=model_path,
        dataset=str(arm.prepare_train_dataset(work, split.name)),
        output_dir=str(work / f"{arm.folder}-out-s{seed}"),
        max_steps=args.grpo_steps,
        learning_rate=1e-4,
        num_generations=arm.generations,
        per_device_train_batch_size=arm.generations,
        gradient_accumulation_steps=arm.prompts_per_step,
        max_completion_length=arm.tokens,
        temperature=arm.temperature,
        save_steps=CHECKPOINT_STEPS,
        resume=True,
        seed=seed,
        rewards=arm.weights or None,
        resample_zero_variance_batches=arm.resample,
    )
    run = trained(args, config, work / f"{arm.folder}-merged-s{seed}", train_grpo)
    after = respondent_metrics(
        generate_kept(f"hf:{run['merged']}", eval_prompts, arm.tokens, respondent.STOP, Path(run["merged"])),
        eval_rows,
        keep=replies,
    )
    log(f"after grpo (seed {seed}): {after} ({run['minutes']} min; {run.get('zero_variance_steps')})")
    return {"after": after, **run}


def dpo_run(
    args: argparse.Namespace,
    dpo_dir: Path,
    work: Path,
    model_path: str,
    extract_prompts: list,
    eval_events: list[dict],
    seed: int,
    replies: Path,
) -> dict[str, Any]:
    """Train the extractor with DPO from the base model (one seed) and measure it on the held-out prompts (its
    replies kept in `replies`)."""
    config = DPOTrainingConfig(
        model=model_path,
        dataset=str(dpo_dir / "dataset"),
        output_dir=str(work / f"{dpo_dir.name}-out-s{seed}"),
        max_steps=args.dpo_steps,
        learning_rate=5e-5,
        per_device_train_batch_size=2,
        max_length=1024,
        save_steps=CHECKPOINT_STEPS,
        resume=True,
        seed=seed,
    )
    run = trained(args, config, work / f"{dpo_dir.name}-merged-s{seed}", train_dpo)
    after = extractor_metrics(
        generate_kept(f"hf:{run['merged']}", extract_prompts, args.extract_tokens, extractor.STOP, Path(run["merged"])),
        eval_events,
        keep=replies,
    )
    log(f"after dpo (seed {seed}): {after} ({run['minutes']} min)")
    return {"after": after, **run}


def trained(
    args: argparse.Namespace,
    config: Any,
    merged: Path,
    train: Callable[[Any], dict[str, Any]],
    starts_from: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train one seed (from the base model, or from the trained model `starts_from` identifies) and merge its
    adapter; with `--reuse-trained`, a seed an earlier run trained and merged with this very identity
    (`seeds.training_identity`) is measured again instead (`reused` True). A training killed before its merge goes
    on from its last checkpoint (`config.resume`); a finished one is trained again."""
    identity = training_identity(config, starts_from)
    earlier = trained_earlier(identity, merged, reads_rewards(config)) if args.reuse_trained else None
    if earlier:
        log(f"reusing {merged.name}: trained earlier with this config ({earlier['steps']} steps)")
        return {**earlier, "reused": True, "merged": str(merged), "plot_path": None}
    if (merged / RUN_FILE).exists() or not resumable(config):
        shutil.rmtree(config.output_dir, ignore_errors=True)  # finished, or checkpoints of other settings or rewards
        (merged / RUN_FILE).unlink(missing_ok=True)
    started = time.time()
    summary = train(config)
    if summary["resumed_from_step"]:
        log(f"{Path(config.output_dir).name}: went on from its checkpoint at step {summary['resumed_from_step']}")
    run = {
        "steps": summary["steps"],
        "minutes": round((time.time() - started) / 60, 1),  # this process's part
        "resumed_from_step": summary["resumed_from_step"],
        "zero_variance_steps": summary.get("zero_variance_steps"),
    }
    merged_model(summary["model_dir"], config.model, merged)
    record_trained(merged, identity, run)
    return {**run, "reused": False, "merged": str(merged), "plot_path": summary.get("plot_path")}


def resumable(config: Any) -> bool:
    """False when the training's folder holds checkpoints of other settings only (`resume_checkpoint` refuses)."""
    try:
        resume_checkpoint(config)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Questions:
    """PubMedQA-train after one seeded shuffle: every question (the corpus's abstracts), the first training
    ones (seed 0's) and the held-out ones after them, yes/no/maybe equally often."""

    pool: list[Question]
    train: list[Question]
    held_out: list[Question]


def split_questions(args: argparse.Namespace) -> Questions:
    pool = load_questions_file(Path(args.data) / "benchmarks" / "pubmedqa_train.jsonl")
    random.Random(0).shuffle(pool)
    held_out = balanced_by_answer(pool[args.train_questions :], args.eval_questions)
    return Questions(pool, pool[: args.train_questions], held_out)


def prepare(args: argparse.Namespace, work: Path, model: str, train_db: Path, eval_db: Path, questions: Questions):
    """Index the abstracts, record graph runs, and export GRPO prompts from them."""
    stats = build_index(abstracts_as_documents(questions.pool), work / "index", progress=False)
    log(f"indexed {len(questions.pool)} abstracts: {stats['chunks_total']} chunks in {stats['seconds']:.0f}s")
    record(questions.train, model, work / "index", train_db, work, args)
    record(questions.held_out, model, work / "index", eval_db, work, args)
    for name, db in (("train", train_db), ("eval", eval_db)):
        export_traces(db, work, name, seed=0)


def export_traces(db: Path, work: Path, split: str, seed: int) -> None:
    config = GRPOExportConfig(traces=str(db), out=str(grpo_prompts(work, split).parent), seed=seed)
    log(f"grpo export {split}: {export_grpo(config, progress=False)}")


@dataclass(frozen=True)
class TrainingSplit:
    """What one seed trains on: its GRPO prompts' split (`grpo_prompts`) and the traces its DPO pairs come from."""

    name: str
    traces: Path

    @staticmethod
    def of_seed(work: Path, seed: int) -> TrainingSplit:
        """Seed 0's is the recorded `train` split; another seed's has its own name, traces and exports."""
        suffix = "" if seed == 0 else f"-s{seed}"
        return TrainingSplit(f"train{suffix}", work / f"traces-train{suffix}.sqlite")


def seed_training_split(
    args: argparse.Namespace, work: Path, model: str, questions: Questions, seed: int
) -> TrainingSplit:
    """Seed 0 trains on the recorded training traces; another seed records ER-MedRAG runs on its own training
    questions (`seeds.training_sample`, none held out) and exports them, its distractors drawn with its seed
    (kept with --reuse)."""
    split = TrainingSplit.of_seed(work, seed)
    if seed == 0:
        return split
    if not (args.reuse and grpo_prompts(work, split.name).exists()):
        split.traces.unlink(missing_ok=True)
        shutil.rmtree(work / f"runs-{split.traces.stem}", ignore_errors=True)
        own = training_sample(questions.pool, questions.held_out, questions.train, seed)
        record(own, model, work / "index", split.traces, work, args)
        export_traces(split.traces, work, split.name, seed)
    return split


def refuse_combined(result: dict[str, Any], out: Path, keys: list[str]) -> None:
    """A record that combine_runs.py joined from several machines' runs cannot be rebuilt here: never replace it."""
    for key in keys:
        if "runs" in result.get(key, {}):
            raise SystemExit(
                f"{out} holds {key} combined from {len(result[key]['runs'])} runs (combine_runs.py); a "
                "run here would replace them: write it to another --out, then join it with "
                "benches/learning/combine_runs.py"
            )


def dpo_temperature_suffix(args: argparse.Namespace) -> str:
    """Another sampling temperature is another export, and its arms are recorded under their own keys."""
    return "" if args.dpo_temperature == 1.0 else f"_t{args.dpo_temperature:g}"


def dpo_keys(args: argparse.Namespace) -> list[str]:
    """The result keys of the DPO arms this run trains: without closed cut lists, with them, or both."""
    suffix = dpo_temperature_suffix(args)
    return {
        "off": ["dpo_extractor" + suffix],
        "on": ["dpo_extractor_close_cut" + suffix],
        "both": ["dpo_extractor" + suffix, "dpo_extractor_close_cut" + suffix],
    }[args.dpo_close_cut]


def dpo_arms(args: argparse.Namespace, work: Path, split: TrainingSplit) -> dict[str, Path]:
    """The DPO settings to train, by result key, with their exported pairs: the extractor's pairs from the
    split's training traces (sampled alternatives, reward margin), exported once; with `--dpo-close-cut both` the
    arm without closed candidates reselects its pairs from the same scored samples."""
    closing = args.dpo_close_cut != "off"
    train_db = split.traces
    folder_suffix = dpo_temperature_suffix(args).replace("_", "-") + split.name.removeprefix("train")
    export = work / (("dpo-train-closed" if closing else "dpo-train") + folder_suffix)
    margin = 0.0 if args.smoke else 0.1
    if not (args.reuse and (export / "dataset").exists()):
        shutil.rmtree(export, ignore_errors=True)
        counts = export_dpo(
            DPOExportConfig(
                traces=str(train_db),
                out=str(export),
                samples=args.dpo_samples,
                temperature=args.dpo_temperature,
                max_new_tokens=args.extract_tokens,
                usefulness=False,
                margin=margin,
                close_cut_lists=closing,
            ),
            progress=False,
        )
        log(f"dpo export ({export.name}): {counts}")
    keys = dpo_keys(args)
    if args.dpo_close_cut != "both":
        return {keys[0]: export}
    reselected = work / ("dpo-train-same-samples" + folder_suffix)
    pairs = reselect_pairs(str(train_db), export, reselected, margin, closed=False)
    log(f"dpo pairs without closed candidates: {pairs}")
    return {keys[0]: reselected, keys[1]: export}


def copy_curves(runs: list[dict[str, Any]], args: argparse.Namespace, target: Path) -> None:
    """The training curves of the first seed this run trained (a reused seed's are those of its own run)."""
    plotted = [run["plot_path"] for run in runs if run.get("plot_path")]
    if plotted and not args.smoke and not args.first_seed:
        shutil.copy(plotted[0], target)


def pair_composition(export_log: Path) -> dict[str, dict[str, float]]:
    """What the DPO pairs teach: the mean reward components of their chosen and of their rejected sides, read
    from the export's log (each pair beside its scored candidates)."""
    sides: dict[str, list[dict[str, float]]] = {"chosen": [], "rejected": []}
    for record in read_records(export_log):
        pair = record.get("pair")
        if not pair:  # a prompt whose candidates made no pair
            continue
        scored = {c["completion"]: c["components"] for c in record["candidates"]}
        for side in sides:
            components = scored.get(pair[side][0]["content"])
            if components:
                sides[side].append(components)
    return {
        side: {
            name: round(sum(c[name] for c in rows) / len(rows), 3)
            for name in ("total", "structure", "faithfulness", "conciseness")
        }
        for side, rows in sides.items()
        if rows
    }


def training_time(seeds: list[int], runs: list[dict[str, Any]], earlier: dict[str, Any], kept: int) -> dict[str, Any]:
    """Training minutes per seed (a reused seed's as its own run timed them) and which seeds were reused, over
    the `kept` seeds of the `earlier` record (--first-seed) and this run's."""
    earlier_reused = [seed for seed in earlier.get("reused_seeds", []) if seed < kept]
    timed = [run["minutes"] for run in runs if run.get("minutes") is not None]
    if kept and earlier.get("minutes") is not None:  # the earlier record keeps a mean over its seeds
        timed += [earlier["minutes"]] * kept
    return {
        "minutes": round(sum(timed) / len(timed), 1) if timed else None,
        "reused_seeds": earlier_reused + [seed for seed, run in zip(seeds, runs) if run["reused"]],
    }


def grpo_records(
    args: argparse.Namespace,
    arm: GRPOArm,
    before: dict[str, float],
    afters: list[dict[str, float]],
    runs: list[dict[str, Any]],
    seeds: list[int],
    earlier: dict[str, Any],
    eval_count: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GRPO arm's record and its seeds summary: the seeds `earlier` holds (--first-seed) and this run's `runs` so
    far, whose afters together are `afters`."""
    record, summary = earlier.get("record", {}), earlier.get("seeds", {})
    kept = args.first_seed
    arm_record = {
        "before": before,
        "after": record.get("after", afters[0]),
        "steps": runs[0]["steps"],
        **training_time(seeds, runs, record, kept),
        "model": "tiny random" if args.smoke else "gemma3-270m (base, LoRA)",
        "train_prompts": args.train_questions,
        "eval_prompts": eval_count,
        "num_generations": arm.generations,
        "temperature": arm.temperature,
        "prompts_per_step": arm.prompts_per_step,
        "worked_example": arm.example,
        **({"resample_zero_variance_batches": arm.resample} if arm.resample else {}),  # records before it: off
        "reward_weights": {**RESPONDENT_REWARDS, **arm.weights},
        "respond_tokens": arm.tokens,
        "command": command_line(),
        "cpu": cpu_model(),
        "seed_changes": SEED_CHANGES,
        "zero_variance_steps": record.get("zero_variance_steps", [])[:kept] + [r["zero_variance_steps"] for r in runs],
    }
    seeds_summary = {
        **over_seeds(before, afters),
        "accuracy_before": accuracy_interval(before["accuracy"], eval_count),
        "accuracy_after": [accuracy_interval(a["accuracy"], eval_count) for a in afters],
        "zero_variance_share": summary.get("zero_variance_share", [])[:kept]
        + [(r["zero_variance_steps"] or {}).get("share") for r in runs],
    }
    return arm_record, seeds_summary


def dpo_records(
    args: argparse.Namespace,
    key: str,
    dpo_dir: Path,
    before: dict[str, float],
    afters: list[dict[str, float]],
    runs: list[dict[str, Any]],
    seeds: list[int],
    earlier: dict[str, Any],
    eval_count: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DPO arm's record and its seeds summary, as `grpo_records` for GRPO."""
    record = earlier.get("record", {})
    arm_record = {
        "before": before,
        "after": record.get("after", afters[0]),
        "steps": runs[0]["steps"],
        **training_time(seeds, runs, record, args.first_seed),
        "pairs": len(load_from_disk(str(dpo_dir / "dataset"))),
        "eval_prompts": eval_count,
        "pair_composition": pair_composition(dpo_dir / "log.jsonl"),
        "samples": args.dpo_samples,
        "sampling_temperature": args.dpo_temperature,
        "close_cut_lists": "close_cut" in key,
        "command": command_line(),
        "cpu": cpu_model(),
        "seed_changes": SEED_CHANGES + " (the pairs above: the first seed's)",
    }
    summary = over_seeds(before, afters)
    return arm_record, {
        **summary,
        "mean_reward_gain": gain(summary, "mean_reward"),
        "strict_json_rate": summary.get("strict_json_rate"),
    }


def write_progress(result: dict[str, Any], out: Path, started: float, done: str, seeds: list[int]) -> None:
    """Write the record after each trained seed, so that a run stopped part way keeps the seeds it finished (go on
    with --reuse --first-seed); `progress` says how far it got and is dropped when the run completes."""
    result["seeds"]["n"] = common_seed_count(result["seeds"])
    result["decoding"] = "greedy, same prompts and token budgets before and after"
    result["progress"] = f"{done} recorded; this run trains seeds {seeds[0]}..{seeds[-1]} of each part"
    write_result(result, out, started, show=False)
    log(f"{done}: recorded in {out}")


def command_line() -> str:
    """This run's command, recorded at the top and in each arm it writes: a levers file holds several runs' arms."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script  # a caller outside: pytest's
    return " ".join(["python", str(shown), *sys.argv[1:]])


def write_result(result: dict[str, Any], out: Path, started: float, show: bool = True) -> None:
    """Add the run's total minutes and command line, write the JSON and (`show`) print it."""
    result.update(total_minutes=round((time.time() - started) / 60, 1), command=command_line())
    if allocator := allocator_env():
        result["allocator_env"] = allocator
    replace_text(out, json.dumps(result, indent=2) + "\n")  # a kill never cuts the other arms' record
    if show:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
