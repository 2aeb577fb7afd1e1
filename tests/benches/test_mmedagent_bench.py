"""The MMedAgent-RL learning bench (benches/learning/mmedagent_learning.py): its `--smoke` run end to end (real
shared questions, the real staged trainer on a tiny random model, every section of the result file), its clean
skip without the shared data, and the parts a random model cannot exercise: the split, the scripted
specialists' reliabilities, the ceilings, and the held-out scoring on replies that are right or wrong."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from benches.learning import mmedagent_learning as bench
from tests.conftest import REPO

SCRIPT = REPO / "benches" / "learning" / "mmedagent_learning.py"
SMOKE_TIMEOUT_S = 600  # ~20 s on one thread of an idle 2-core machine; far more only when something hangs


def run_bench(*args: str, timeout: float = SMOKE_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_smoke_run_with_two_seeds_writes_every_section(shared_data: Path, tmp_path: Path) -> None:
    proc = run_bench("--smoke", "--seeds", "2", "--data", str(shared_data), "--work", str(tmp_path))
    out = tmp_path / "smoke" / "mmedagent_learning.json"
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sizes = bench.SMOKE_SIZES

    triage = result["triage"]
    assert triage["chance"] == pytest.approx(1 / 7, abs=1e-4)
    assert triage["majority_class"] == pytest.approx(1 / 6, abs=1e-4)  # balanced: 2 held out per specialty
    for when in ("before", "after"):
        assert triage[when]["n"] == sizes["eval_questions"] and 0 <= triage[when]["accuracy"] <= 1
    assert triage["steps"] == sizes["triage_steps"]
    assert set(triage["baselines"]) == {"chance", "majority", "first_option", "copy_example", "keyword"}
    assert triage["baselines"]["copy_example"]["hits"] == 0  # the example answers from a list of its own
    strongest = max(b["ci95"][1] if isinstance(b, dict) else b for b in triage["baselines"].values())
    assert triage["after_beats_baselines"] == (triage["after"]["accuracy"] > strongest)
    kept = {p.name for p in (tmp_path / "smoke" / "mmedagent_learning_replies").iterdir()}
    stages = [f"attending_seed{seed}_after_{name}" for seed in (42, 43) for name in ("easy", "medium", "hard")]
    phases = ["triage_before", "triage_seed42_after", "triage_seed43_after", "attending_before", *stages]
    assert kept == {f"{phase}.jsonl.gz" for phase in phases}

    attending = result["attending"]
    assert set(attending["ceiling"]) >= {"majority_vote", "trust_best", "best_single"}
    assert attending["ceiling"]["best_single"] >= attending["ceiling"]["trust_best"]
    assert list(attending["after_each_stage"]) == ["easy", "medium", "hard"]
    assert set(attending["baselines"]) == {"chance", "majority", "first_option", "copy_example"}
    assert attending["baselines"]["first_option"]["hits"] <= 3  # gold positions balanced: at most a quarter of 12
    rows = result["settings"]["train_rows_by_stage"]
    assert rows["triage"] == sizes["train_questions"] == rows["easy"] + rows["medium"] + rows["hard"]
    for name in ("easy", "medium", "hard"):  # every bucket has rows with the smoke's split: every stage trained
        assert attending["after_each_stage"][name]["steps"] == sizes[f"{name}_steps"]
    assert attending["after"]["n"] == sizes["eval_questions"]

    entropy = result["entropy"]
    assert entropy["stage"] == "hard" and entropy["entropy_coef"] == {"with_bonus": 3e-2, "without_bonus": 0.0}
    assert len(entropy["with_bonus"]) == len(entropy["without_bonus"]) == sizes["hard_steps"]
    # Same start model, data and seed: the first step's entropy is measured before any update, so it is equal.
    assert entropy["with_bonus"][0] == pytest.approx(entropy["without_bonus"][0], rel=1e-4)

    seeds = result["seeds"]
    assert seeds["n"] == 2 and seeds["training_seeds"] == [42, 43]
    for part in ("triage", "attending"):
        entry = seeds[part]["accuracy"]
        assert entry["before"]["values"] == [result[part]["before"]["accuracy"]] * 2  # the base model, measured once
        assert len(entry["after"]["values"]) == 2 and 0 <= entry["seeds_higher_after"] <= 2
        assert entry["after"]["values"][0] == result[part]["after"]["accuracy"]  # the first seed is the run reported
        assert [a["n"] for a in seeds[part]["accuracy_after"]] == [sizes["eval_questions"]] * 2
    assert (tmp_path / "smoke" / "train-s1" / "hard").is_dir()  # the second seed trained its own chain

    assert result["seconds"] > 0 and result["date"] and "CPUs" in result["machine"]
    for name in ("triage", "easy", "medium", "hard"):
        assert (tmp_path / "smoke" / f"mmedagent_smoke_{name}_curves.png").stat().st_size > 0
    assert (tmp_path / "smoke" / "mmedagent_smoke_entropy.png").stat().st_size > 0

    # --reuse takes every finished seed (and the entropy ablation) from its record: the same figures, no training.
    for plot in (tmp_path / "smoke").glob("mmedagent_smoke_*.png"):
        plot.unlink()
    proc = run_bench("--smoke", "--seeds", "2", "--reuse", "--data", str(shared_data), "--work", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads(out.read_text())
    assert again["reused_training_seeds"] == [42, 43] and result["reused_training_seeds"] == []
    assert again["seeds"] == seeds and again["entropy"] == entropy and again["attending"] == attending
    assert "steps on" not in proc.stdout  # no stage trained again
    for name in ("triage", "easy", "medium", "hard", "entropy"):  # drawn again from the reused records
        plot = (
            tmp_path
            / "smoke"
            / (f"mmedagent_smoke_{name}_curves.png" if name != "entropy" else "mmedagent_smoke_entropy.png")
        )
        assert plot.stat().st_size > 0, plot


def test_without_the_shared_data_it_says_so_and_exits_cleanly(tmp_path: Path) -> None:
    proc = run_bench("--smoke", "--data", str(tmp_path / "absent"), "--work", str(tmp_path), timeout=60)
    assert proc.returncode == 0
    assert "skipped" in proc.stderr and str(tmp_path / "absent") in proc.stderr
    assert "ERMEDRAG_SHARED_DATA" in proc.stderr
    assert not (tmp_path / "smoke").exists()


# ------------------------------------------------------------------- the parts a random model cannot exercise


def question(qid: str, benchmark: str = "medmcqa_dev", subject: str = "Pathology", meta: dict | None = None):
    from ermedrag.tools.data.benchmarks import Question

    return Question(
        id=qid,
        question=f"Case {qid}: what is the diagnosis?",
        answer="B",
        benchmark=benchmark,
        options={"A": "Alpha", "B": "Beta", "C": "Gamma", "D": "Delta"},
        subject=subject,
        meta=meta or {},
    )


def test_balanced_split_is_disjoint_seeded_and_even_across_specialties() -> None:
    pools = {s: [question(f"{s}-{i}") for i in range(n)] for s, n in (("P", 20), ("R", 4), ("S", 30))}
    train, held_out = bench.split_questions(pools, 9, 6, seed=3, sampling="balanced")
    assert len(train) == 9 and len(held_out) == 6
    assert not {q.id for q in train} & {q.id for q in held_out}
    assert sorted(q.id[0] for q in train) == list("PPPRRRSSS")
    assert sorted(q.id[0] for q in held_out) == list("PPPRSS")  # R had one left: its next turn went to P
    assert [q.id for q in bench.split_questions(pools, 9, 6, seed=3, sampling="balanced")[0]] == [q.id for q in train]
    # A specialty that runs out leaves its turn to the others.
    train, held_out = bench.split_questions(pools, 12, 9, seed=0, sampling="balanced")
    assert sum(q.id.startswith("R") for q in train + held_out) == 4 and len(train) + len(held_out) == 21


def test_a_training_draw_keeps_the_held_out_questions_and_draws_its_own_training_sample() -> None:
    pools = {s: [question(f"{s}-{i}") for i in range(n)] for s, n in (("P", 20), ("R", 8), ("S", 30))}
    train, held_out = bench.split_questions(pools, 9, 6, seed=3, sampling="balanced")
    own, same_held_out = bench.split_questions(pools, 9, 6, seed=3, sampling="balanced", train_draw=1)
    other, _ = bench.split_questions(pools, 9, 6, seed=3, sampling="balanced", train_draw=2)
    assert [q.id for q in same_held_out] == [q.id for q in held_out]
    assert not {q.id for q in own} & {q.id for q in held_out} and len(own) == 9
    assert sorted(q.id[0] for q in own) == list("PPPRRRSSS")  # still balanced across specialties
    assert {q.id for q in own} != {q.id for q in train} and {q.id for q in own} != {q.id for q in other}
    natural, _ = bench.split_questions(pools, 9, 6, seed=3, sampling="natural", train_draw=1)
    assert len(natural) == 9 and not {q.id for q in natural} & {
        q.id for q in bench.split_questions(pools, 9, 6, seed=3, sampling="natural")[1]
    }


def test_held_out_attending_golds_stand_at_every_position_in_turn(shared_data: Path, tmp_path: Path) -> None:
    """Always one letter (or an attending collapsed onto one) scores chance on the held-out attending rows."""
    args = bench.parse_args(["--train-questions", "12", "--eval-questions", "24"])
    data = bench.prepare_data(args, bench.benchmarks_dir(str(shared_data)), tmp_path / "export")
    rows = data.eval_attending
    assert [r["id"] for r in rows] == [q.id for q in data.eval_questions]
    for index, row in enumerate(rows):
        assert list(row["options"]).index(row["gold"]) == index % len(row["options"])
        original = data.eval_questions[index]
        assert row["options"][row["gold"]] == original.options[original.answer]  # the gold text moved with its key
        assert sorted(row["options"].values()) == sorted(original.options.values())


def test_triage_only_writes_its_figures_beside_the_recorded_attending(shared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "smoke" / "mmedagent_learning.json"
    out.parent.mkdir(parents=True)
    recorded = {"attending": {"accuracy": 0.5}, "seeds": {"n": 3, "attending": {"accuracy": "recorded"}}}
    out.write_text(json.dumps(recorded))
    proc = run_bench(
        "--smoke",
        "--parts",
        "triage",
        "--seeds",
        "2",
        "--prompts-per-step",
        "2",
        "--data",
        str(shared_data),
        "--work",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # Two prompts an optimizer step: the first step went through 2 of the 48 training rows
    first_step = json.loads((tmp_path / "smoke" / "train" / "triage" / "metrics.jsonl").read_text().splitlines()[0])
    assert result["triage_run"]["settings"]["prompts_per_step"] == 2
    assert first_step["step"] == 1 and first_step["epoch"] == pytest.approx(2 / 48)
    assert result["attending"] == recorded["attending"]
    assert result["seeds"]["attending"] == recorded["seeds"]["attending"] and result["seeds"]["n"] == 3
    assert len(result["seeds"]["triage"]["accuracy"]["after"]["values"]) == 2
    assert len(result["triage"]["seeds_after"]) == 2 and 0 <= result["triage"]["seeds_beating_chance_and_majority"] <= 2
    assert (
        result["triage_run"]["training_seeds"] == [42, 43]
        and "own training questions" in result["triage_run"]["seed_changes"][1]
    )
    assert not (tmp_path / "smoke" / "train" / "easy").exists()  # the attending's stages did not train

    # Going on after a stop: the finished triage seeds are taken from their records, not trained again
    proc = run_bench(
        "--smoke", "--parts", "triage", "--seeds", "2", "--prompts-per-step", "2", "--reuse",
        "--data", str(shared_data), "--work", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        proc.stdout.count("reusing what an earlier run finished")
        + proc.stderr.count("reusing what an earlier run finished")
        == 2
    )
    assert json.loads(out.read_text())["triage"]["seeds_after"] == result["triage"]["seeds_after"]


def test_a_warm_started_triage_trains_sft_on_the_reference_replies_then_grpo_from_it(
    shared_data: Path, tmp_path: Path
) -> None:
    common = (
        "--smoke", "--parts", "triage", "--sft-epochs", "0.25", "--data", str(shared_data), "--work", str(tmp_path)
    )  # fmt: skip
    alone = run_bench(*common, "--triage-steps", "0")  # the warm start alone, then GRPO on top of that very one
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    result = tmp_path / "smoke" / "mmedagent_learning.json"
    warm = json.loads(result.read_text())["triage"]["sft"]
    proc = run_bench(*common, "--reuse")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "triage warm start (reused: an earlier run trained it)" in proc.stdout + proc.stderr
    triage = json.loads(result.read_text())["triage"]
    assert triage["sft"]["rows"] == bench.SMOKE_SIZES["train_questions"] and triage["sft"]["steps"] == 3  # 48/4/4
    assert triage["sft"]["model_dir"] == warm["model_dir"] == str(tmp_path / "smoke" / "train-sft" / "merged")
    assert triage["sft"]["train_loss"] == warm["train_loss"] and triage["sft"]["reused"]
    stage = json.loads((tmp_path / "smoke" / "train" / "triage" / "mmedagent_stage.json").read_text())
    assert stage["start_model"] == triage["sft"]["model_dir"]  # GRPO went on from the warm start
    assert triage["steps"] == bench.SMOKE_SIZES["triage_steps"]
    assert triage["sft"]["after"] == json.loads(result.read_text())["triage"]["seeds_after_sft"][0]
    assert triage["sft"]["after"]["n"] == bench.SMOKE_SIZES["eval_questions"]  # the warm start measured on its own
    kept = {p.name for p in (tmp_path / "smoke" / "mmedagent_learning_replies").iterdir()}
    assert {"triage_seed42_after_sft.jsonl.gz", "triage_seed42_after.jsonl.gz"} <= kept


def test_a_warm_started_attending_is_measured_beside_the_recorded_triage(shared_data: Path, tmp_path: Path) -> None:
    """`--parts attending --sft-epochs`: SFT on reference replies of gold answers balanced over the positions, the
    warm start measured alone (no curriculum steps), its figures written beside the recorded triage's, and the
    block an older run's retrofit left for the attending dropped (the part carries its own baselines)."""
    out = tmp_path / "smoke" / "mmedagent_learning.json"
    out.parent.mkdir(parents=True)
    recorded = {"triage": {"accuracy": 0.8}, "seeds": {"n": 3, "triage": "recorded"}, "baselines": {"attending": {}}}
    out.write_text(json.dumps(recorded))
    proc = run_bench(
        "--smoke", "--parts", "attending", "--sft-epochs", "0.25", "--easy-steps", "0", "--medium-steps", "0",
        "--hard-steps", "0", "--data", str(shared_data), "--work", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["triage"] == recorded["triage"] and result["seeds"]["triage"] == "recorded"
    assert "baselines" not in result and result["attending_run"]["settings"]["parts"] == "attending"
    attending = result["attending"]
    assert set(attending["baselines"]) == {"chance", "majority", "first_option", "copy_example"}
    assert attending["sft"]["rows"] == bench.SMOKE_SIZES["train_questions"]
    assert attending["after"] == attending["sft"]["after"] == result["attending"]["seeds_after_sft"][0]
    assert all(stage["steps"] == 0 for stage in attending["after_each_stage"].values())
    assert not (tmp_path / "smoke" / "train" / "triage").exists()  # the triage did not train
    kept = {p.name for p in (tmp_path / "smoke" / "mmedagent_learning_replies").iterdir()}
    assert kept == {"attending_before.jsonl.gz", "attending_seed42_after_sft.jsonl.gz"}
    sft_rows = [json.loads(line) for line in (tmp_path / "smoke" / "export" / "sft-attending" / "data.jsonl").open()]
    assert all(list(r["options"]).index(r["gold"]) == i % len(r["options"]) for i, r in enumerate(sft_rows))
    assert all(r["reference_reply"].endswith(f"<answer>{r['gold']}</answer>") for r in sft_rows)


def test_triage_steps_zero_measures_a_warm_start_alone_and_nothing_else() -> None:
    args = bench.parse_args(["--parts", "triage", "--sft-epochs", "1", "--triage-steps", "0"])
    assert (args.sft_epochs, args.triage_steps) == (1.0, 0)
    no_curriculum = ["--easy-steps", "0", "--medium-steps", "0", "--hard-steps", "0"]
    args = bench.parse_args(["--parts", "attending", "--sft-epochs", "1", "--first-seed", "2", *no_curriculum])
    assert (args.parts, args.first_seed, args.hard_steps) == ("attending", 2, 0)
    for wrong in (
        ["--triage-steps", "0"],
        ["--sft-epochs", "1", "--triage-steps", "0"],
        no_curriculum,
        ["--parts", "attending", *no_curriculum],
        ["--sft-epochs", "1", *no_curriculum],
        ["--hard-steps", "-1"],
        ["--first-seed", "1"],
        ["--sft-epochs", "-1"],
        ["--sft-questions", "240"],
        ["--sft-epochs", "1", "--sft-questions", "0"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(wrong)


def test_warm_start_questions_add_to_the_training_ones_and_leave_the_held_out_set_alone() -> None:
    pools = {s: [question(f"{s}{i}", subject=s) for i in range(30)] for s in ("Pathologist", "Surgeon", "Radiologist")}
    train, held_out = bench.split_questions({s: list(qs) for s, qs in pools.items()}, 6, 6, 0, "balanced")
    drawn = bench.warm_start_questions(pools, train, held_out, 36, "0:1")
    ids = [q.id for q in drawn]
    assert ids[:6] == [q.id for q in train] and len(set(ids)) == 36
    assert not set(ids) & {q.id for q in held_out}
    assert Counter(q.subject for q in drawn) == {"Pathologist": 12, "Surgeon": 12, "Radiologist": 12}
    assert [q.id for q in bench.warm_start_questions(pools, train, held_out, 36, "0:1")] == ids  # seeded
    assert [q.id for q in bench.warm_start_questions(pools, train, held_out, 36, "0:2")] != ids
    assert bench.warm_start_questions(pools, train, held_out, 3, "0:1") == train  # never fewer than the training set


def test_scripted_specialists_are_right_at_their_reliability_and_wrong_uniformly() -> None:
    rng = random.Random(0)
    draws = [bench.scripted_opinions(question(str(i)), "Pathologist", rng, (0.8, 0.5, 0.2)) for i in range(4000)]
    for index, reliability in enumerate((0.8, 0.5, 0.2)):
        answers = [opinions[index]["answer"] for opinions in draws]
        assert sum(a == "B" for a in answers) / len(answers) == pytest.approx(reliability, abs=0.03)
        wrong = [a for a in answers if a != "B"]
        assert set(wrong) == {"A", "C", "D"}
        assert all(abs(wrong.count(k) / len(wrong) - 1 / 3) < 0.05 for k in "ACD")
    # Right or wrong, the reasoning has the same shape: only the answer carries the signal.
    assert {o["reasoning"].split("(")[0].replace(o["answer"], "?") for opinions in draws[:50] for o in opinions} == {
        "The findings fit option ? "
    }


def test_ceilings_on_hand_made_prompts() -> None:
    rows = [
        {"gold": "A", "specialist_answers": ["A", "A", "B"], "majority": "A", "bucket": "medium"},
        {"gold": "A", "specialist_answers": ["B", "A", "C"], "majority": None, "bucket": "medium"},  # a tie
        {"gold": "C", "specialist_answers": ["A", "B", "B"], "majority": "B", "bucket": "hard"},
        {"gold": "D", "specialist_answers": ["D", "D", "D"], "majority": "D", "bucket": "easy"},
    ]
    got = bench.ceilings(rows)
    assert got == {
        "majority_vote": 0.5,
        "trust_best": 0.5,
        "best_single": 0.75,
        "per_specialist": [0.5, 0.75, 0.25],
        "any_specialist_right": 0.75,
    }


def test_held_out_scoring_counts_right_and_wrong_replies(monkeypatch, tmp_path) -> None:
    """The scoring of held-out replies, with fixed replies in place of a model's rollouts."""
    from ermedrag.training.mmedagent.config import MMedAgentTrainingConfig
    from ermedrag.training.mmedagent.train import stage_config

    config = MMedAgentTrainingConfig(model="unused", dataset=str(tmp_path), output_dir=str(tmp_path / "out"))
    args = SimpleNamespace(eval_batch=4, replies_dir=str(tmp_path / "replies"))
    cases = [question("1"), question("2", "medxpertqa_text_test", "", {"body_system": "Endocrine"})]
    triage = bench.triage_rows(cases)
    assert [r["gold_specialty"] for r in triage] == ["Pathologist", "Endocrinologist"]
    replies = ["<think>A biopsy.</think><answer>Pathologist</answer>", "<answer>Surgeon</answer>"]
    monkeypatch.setattr(bench, "greedy_rollouts", lambda *a, **k: (replies, [10, 4]))
    scored = bench.evaluate_triage("unused", triage, stage_config(config, "triage"), args, "before")
    assert (scored["accuracy"], scored["well_formed_rate"], scored["named_a_specialty"]) == (0.5, 0.5, 1.0)
    assert scored["predicted"] == {"Pathologist": 1, "Surgeon": 1}
    assert (scored["copy_rate"], scored["modal_share"]) == (0.0, 0.5)  # neither names the example's specialty
    with gzip.open(tmp_path / "replies" / "triage_before.jsonl.gz", "rt") as kept:
        rows = [json.loads(line) for line in kept]
    assert [(r["reply"], r["named"], r["correct"]) for r in rows] == [
        (replies[0], "Pathologist", 1.0),
        (replies[1], "Surgeon", 0.0),
    ]

    attending = bench.attending_rows(cases, random.Random(0), (1.0, 1.0, 0.0))
    assert [r["bucket"] for r in attending] == ["medium", "medium"] and attending[0]["majority"] == "B"
    replies = ["<think>Specialists 1 and 2 agree.</think><answer>B</answer>", "Answer: C"]
    scored = bench.evaluate_attending("unused", attending, stage_config(config, "easy"), args, "before")
    assert (scored["accuracy"], scored["answer_parsed_rate"], scored["well_formed_rate"]) == (0.5, 1.0, 0.5)
    assert (scored["followed_specialist_1"], scored["followed_majority"]) == (0.5, 0.5)
    assert scored["accuracy_by_bucket"]["medium"] == {"accuracy": 0.5, "n": 2}
    assert scored["modal_share"] == 0.5 and scored["accuracy_ci95"][0] < 0.5 < scored["accuracy_ci95"][1]
    with gzip.open(tmp_path / "replies" / "attending_before.jsonl.gz", "rt") as kept:
        rows = [json.loads(line) for line in kept]
    assert [(r["reply"], r["answer"], r["correct"]) for r in rows] == [(replies[0], "B", 1.0), (replies[1], "C", 0.0)]


def test_an_empty_bucket_passes_its_start_model_on_to_the_next_stage(tmp_path) -> None:
    from ermedrag.training.mmedagent.config import MMedAgentTrainingConfig
    from ermedrag.training.mmedagent.train import stage_start_model

    config = MMedAgentTrainingConfig(model=str(tmp_path), dataset=str(tmp_path), output_dir=str(tmp_path / "out"))
    skipped = bench.run_stage(config, "easy", 0)
    assert skipped["skipped"] and skipped["steps"] == 0 and skipped["model_dir"] == str(tmp_path)
    assert stage_start_model(config, "medium") == str(tmp_path)
    no_steps = dataclasses.replace(config, stage_overrides={"medium": {"max_steps": 0}})  # rows, but 0 steps
    assert bench.run_stage(no_steps, "medium", 5)["skipped"] and stage_start_model(config, "hard") == str(tmp_path)


def test_trivial_triage_baselines_with_the_keyword_rule():
    listed = ["Pathologist", "Dermatologist", "Endocrinologist"]
    assert bench.keyword_specialty("A skin rash with silvery plaques; a biopsy was taken.", listed) == "Dermatologist"
    assert bench.keyword_specialty("Low TSH, high T4: the thyroid.", listed) == "Endocrinologist"
    assert bench.keyword_specialty("Nothing any rule knows.", listed) == "Pathologist"  # no hit: the first listed
    questions = [
        SimpleNamespace(question="Skin rash", options={"A": "x"}, benchmark="medmcqa", subject="Skin"),
        SimpleNamespace(question="Biopsy", options={"A": "x"}, benchmark="medmcqa", subject="Pathology"),
        SimpleNamespace(question="A plaque", options={"A": "x"}, benchmark="medmcqa", subject="Skin"),
    ]
    from ermedrag.agents import triage

    prompts = [triage.triage_messages(q.question, q.options, listed) for q in questions]
    baselines = bench.triage_baselines(questions, prompts, listed)
    assert baselines["chance"] == pytest.approx(1 / 3, abs=1e-4)
    assert (baselines["majority"]["hits"], baselines["first_option"]["hits"]) == (2, 1)
    assert (baselines["keyword"]["hits"], baselines["copy_example"]["hits"]) == (3, 0)  # examples are never listed


def test_one_later_seed_alone_and_the_triage_beta_reach_the_trainer_config() -> None:
    from ermedrag.training.mmedagent.train import stage_config

    args = bench.parse_args(["--parts", "triage", "--first-seed", "1", "--seeds", "1", "--triage-beta", "0.04"])
    config = bench.bench_config(args, "model", Path("export"), Path("train"))
    assert stage_config(config, "triage").beta == 0.04
    assert (
        stage_config(config, "easy").beta
        == stage_config(bench.bench_config(bench.parse_args([]), "m", Path("e"), Path("t")), "easy").beta
    )
    for wrong in (
        ["--first-seed", "1"],
        ["--parts", "triage", "--first-seed", "-1"],
        ["--triage-beta", "-0.1"],
        ["--triage-format-weight", "-1"],
        ["--triage-format-weight", "inf"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(wrong)


def test_a_triage_format_weight_of_zero_leaves_only_the_right_specialty_paying() -> None:
    from ermedrag.training.mmedagent.train import stage_config, stage_rewards
    from ermedrag.training.rewards import named_weights

    def triage_weights(argv: list[str]) -> dict[str, float]:
        config = bench.bench_config(bench.parse_args(argv), "model", Path("export"), Path("train"))
        return named_weights(stage_rewards(stage_config(config, "triage"), "triage"))

    assert triage_weights([]) == {"triage_correctness_ungated": 1.0, "triage_format": 0.5}
    assert triage_weights(["--triage-format-weight", "0"]) == {"triage_correctness_ungated": 1.0}
    assert triage_weights(["--triage-format-weight", "0.1"])["triage_format"] == 0.1
