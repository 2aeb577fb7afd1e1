"""The Med-R³ learning bench (benches/learning/med_r3_learning.py): its `--smoke` run with two seeds (real
PubMedQA questions and abstracts, the real trainer on a tiny random model), then a third seed with `--reuse`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import load_from_disk

from benches.learning.kept_replies import read_replies
from benches.learning.seeds import training_sample
from tests.benches.test_learning_bench import bench_module
from tests.conftest import REPO

SCRIPT = REPO / "benches" / "learning" / "med_r3_learning.py"
SMOKE_TIMEOUT_S = 900  # ~50 s for two seeds on one thread of an idle 2-core machine
STAGES = ("stage1", "stage2", "stage3")


def smoke(shared_data: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", *args, "--data", str(shared_data), "--work", str(work)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)


def run_smoke(shared_data: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    proc = smoke(shared_data, work, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_seeds_share_the_base_replies_and_a_finished_seed_is_reused(shared_data: Path, tmp_path: Path) -> None:
    proc = run_smoke(shared_data, tmp_path, "--seeds", "2")
    out = tmp_path / "smoke" / "med_r3_learning.json"
    result = json.loads(out.read_text())
    seeds = result["seeds"]
    assert seeds["n"] == 2 and result["reused_seeds"] == []
    # Rolled out: the base model once for both seeds; per seed stage 1's model without and with search (stage 1's
    # after, stage 2's before), stage 2's model once (its after is stage 3's before), and stage 3's model.
    assert proc.stdout.count("rolled out") == 1 + 2 * 4
    assert result["stage3"]["before"]["mean_model_tokens"] == result["stage2"]["after"]["mean_model_tokens"]
    assert set(result["stage3"]["before"]["rewards"]) != set(result["stage2"]["after"]["rewards"])  # own scoring
    assert set(result["baselines"]) == {"chance", "majority", "first_option", "copy_example"}
    assert result["baselines"]["majority"]["n"] == seeds["stage1"]["accuracy_after"][0]["n"]
    assert 0 < result["stage1"]["before"]["modal_answer_share"] <= 1
    base = result["stage1"]["before"]["accuracy"]
    assert seeds["stage1"]["accuracy"]["before"]["values"] == [base, base]
    for stage in STAGES:
        assert len(seeds[stage]["accuracy_after"]) == 2 and seeds[stage]["accuracy_after"][0]["n"] == 3
    # Every scoring keeps its replies beside the results: per stage, seed and phase, with answer, gold and rewards
    kept = tmp_path / "smoke" / "med_r3_learning" / "replies"
    assert sorted(p.name for p in kept.iterdir()) == sorted(
        f"{stage}_seed{seed}_{phase}.jsonl.gz" for stage in STAGES for seed in (0, 1) for phase in ("before", "after")
    )
    stage3 = read_replies(kept / "stage3_seed1_after.jsonl.gz")
    assert len(stage3) == 3 and {r["gold"] for r in stage3} <= {"A", "B", "C"}
    assert set(stage3[0]["rewards"]) == set(result["stage3"]["after"]["rewards"])  # the stage's own reward parts
    same_model = [
        read_replies(kept / name)[0]["reply"]
        for name in ("stage2_seed0_after.jsonl.gz", "stage3_seed0_before.jsonl.gz")
    ]
    assert same_model[0] == same_model[1]
    # Each seed trains on questions of its own (`seeds.training_sample`: none of them held out).
    trained_on = [set(load_from_disk(str(tmp_path / "smoke" / f"train-dataset-s{seed}"))["id"]) for seed in (0, 1)]
    assert trained_on[0] != trained_on[1] and "own training questions" in result["seed_changes"]

    proc = run_smoke(shared_data, tmp_path, "--seeds", "3", "--reuse")
    grown = json.loads(out.read_text())
    assert grown["reused_seeds"] == [0, 1] and grown["seeds"]["n"] == 3
    assert proc.stdout.count("rolled out") == 4  # seed 2 alone: the base model's before is seed 0's record
    for stage in STAGES:
        for metric in ("accuracy", "mean_reward", "format_rate"):
            assert grown["seeds"][stage][metric]["after"]["values"][:2] == seeds[stage][metric]["after"]["values"]
    assert grown["seeds"]["stage1"]["accuracy"]["before"]["values"] == [base] * 3

    # On a machine without the work folder, `--first-seed 3` adds seed 3 to the record's seeds 0-2, once the base
    # model's replies there score as recorded (a record whose base scored otherwise is refused before training).
    elsewhere = tmp_path / "elsewhere" / "smoke"
    elsewhere.mkdir(parents=True)
    other_base = {**grown, "chains": [{**grown["chains"][0], "stage1": {**grown["stage1"], "before": {"accuracy": 2}}}]}
    (elsewhere / out.name).write_text(json.dumps(other_base))
    refused = smoke(shared_data, elsewhere.parent, "--seeds", "1", "--first-seed", "1")
    assert refused.returncode == 1 and "score differently here" in refused.stderr
    assert "Traceback" not in refused.stderr and "stage 1 (seed 1)" not in refused.stdout
    shutil.copy(out, elsewhere / out.name)
    proc = run_smoke(shared_data, elsewhere.parent, "--seeds", "1", "--first-seed", "3")
    added = json.loads((elsewhere / out.name).read_text())
    assert added["recorded_seeds"] == [0, 1, 2] and added["reused_seeds"] == [] and added["seeds"]["n"] == 4
    assert added["chains"][:3] == grown["chains"] and [r["seeds"] for r in added["seed_runs"]] == [[0, 1, 2], [3]]
    assert proc.stdout.count("rolled out") == 1 + 4  # the base model, checked against the record, then seed 3
    assert added["seeds"]["stage1"]["accuracy"]["before"]["values"] == [base] * 4


def test_seeds_are_added_only_to_a_record_of_the_same_settings(shared_data: Path, tmp_path: Path) -> None:
    record = tmp_path / "smoke" / "med_r3_learning.json"
    record.parent.mkdir(parents=True)
    chain = {f"stage{s}": {"before": {"accuracy": 0.0}, "after": {"accuracy": 0.0}} for s in (1, 2, 3)}
    record.write_text(json.dumps({"temperature": 0.7, "eval_prompts": 3, "seeds": {"n": 1}, **chain}))
    other = smoke(shared_data, tmp_path, "--first-seed", "1", "--temperature", "0.9")
    assert other.returncode == 2 and "temperature: recorded 0.7, now 0.9" in other.stderr
    missing = smoke(shared_data, tmp_path, "--first-seed", "2")
    assert missing.returncode == 2 and "holds 1 seeds' chains, not the 2" in missing.stderr
    record.write_text('{"seeds": ')  # cut off mid-write
    broken = smoke(shared_data, tmp_path, "--first-seed", "1")
    assert broken.returncode == 2 and "is not a results record" in broken.stderr and "Traceback" not in broken.stderr
    assert not (tmp_path / "smoke" / "index").exists()  # refused before the index is built


def test_a_seed_draws_its_own_training_questions_and_never_a_held_out_one() -> None:
    pool = [SimpleNamespace(id=f"q{i}") for i in range(40)]
    held_out, first = pool[10:20], pool[:10]
    assert training_sample(pool, held_out, first, seed=0) == first  # what the recorded seed 0 trained on
    drawn = [training_sample(pool, held_out, first, seed) for seed in (1, 2)]
    for sample in drawn:
        assert len(sample) == 10 and len({q.id for q in sample}) == 10
        assert not {q.id for q in sample} & {q.id for q in held_out}
    assert {q.id for q in drawn[0]} != {q.id for q in drawn[1]} != {q.id for q in first}
    assert training_sample(pool, held_out, first, seed=1) == drawn[0]  # seeded: a rerun draws the same


def test_the_warm_start_takes_the_seeds_training_questions_then_more_never_held_out() -> None:
    bench = bench_module("med_r3_learning")
    pool = [SimpleNamespace(id=f"q{i}") for i in range(40)]
    held_out, train = pool[10:20], pool[:10]
    questions = bench.warm_start_questions(pool, held_out, train, 16, seed=1)
    assert questions[:10] == train and len({q.id for q in questions}) == 16
    assert not {q.id for q in questions} & {q.id for q in held_out}
    assert questions != bench.warm_start_questions(pool, held_out, train, 16, seed=2)  # a draw of the seed's own
    assert bench.warm_start_questions(pool, held_out, train, 4, seed=1) == train  # never fewer than it trains on


def test_a_balanced_warm_start_draws_each_answer_equally_never_a_held_out_question() -> None:
    bench = bench_module("med_r3_learning")
    pool = [SimpleNamespace(id=f"q{i}", answer="A" if i % 10 < 6 else "B" if i % 10 < 9 else "C") for i in range(90)]
    held_out, train = pool[60:], pool[:12]
    questions = bench.warm_start_questions(pool, held_out, train, 18, seed=1, balanced=True)
    assert Counter(q.answer for q in questions) == {"A": 6, "B": 6, "C": 6}
    assert len({q.id for q in questions}) == 18 and not {q.id for q in questions} & {q.id for q in held_out}
    first_yes = [q for q in questions if q.answer == "A"][:6]
    assert first_yes == [q for q in train if q.answer == "A"][:6]  # the seed's training questions first


@pytest.mark.slow  # ~1 min: `make test-all`
def test_the_chain_starts_from_an_sft_warm_start_on_reference_replies(shared_data: Path, tmp_path: Path) -> None:
    """`--sft-questions`: the product's SFT (`sft_med_r3` preset) on each question's conclusion and answer, then the
    three stages from its merged model, the base model scored beside them."""
    run_smoke(shared_data, tmp_path, "--seeds", "1", "--sft-questions", "6")
    result = json.loads((tmp_path / "smoke" / "med_r3_learning.json").read_text())
    (warm,) = result["sft_warm_start"]["seeds"]
    assert result["sft_warm_start"]["preset"] == "sft_med_r3" and warm["rows"] == 6 and warm["steps"] >= 1
    assert warm["model_dir"].endswith("train-s0-sft/merged")
    trained = load_from_disk(str(tmp_path / "smoke" / "sft-dataset-s0"))
    assert all(r.startswith("<think>") and r.endswith("</answer>") for r in trained["reference_reply"])
    assert set(load_from_disk(str(tmp_path / "smoke" / "train-dataset-s0"))["id"]) <= set(trained["id"])
    kept = tmp_path / "smoke" / "med_r3_learning" / "replies"
    assert (kept / "stage1_base.jsonl.gz").exists() and set(result["base_model"]) == set(result["stage1"]["before"])
    run_smoke(shared_data, tmp_path, "--seeds", "1", "--sft-questions", "6", "--reuse")
    again = json.loads((tmp_path / "smoke" / "med_r3_learning.json").read_text())
    assert again["sft_warm_start"]["seeds"][0]["reused"] and again["reused_seeds"] == [0]
