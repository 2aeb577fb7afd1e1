"""The GRPO/DPO learning bench (benches/learning/learning_signal.py): its `--smoke` run end to end with two seeds
(real PubMedQA questions and graph runs, the real trainers on a tiny random model), checking the sections that
issue 15 asks for: per-seed results against one before, every reward component, the zero-variance share."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest

from ermedrag.tools.machine import cpu_model
from tests.conftest import REPO

SCRIPT = REPO / "benches" / "learning" / "learning_signal.py"
SMOKE_TIMEOUT_S = 900  # ~40 s on one thread of a busy 2-core machine


def bench_module(name: str):
    """A module of benches/learning/, imported as its scripts import each other (by file name)."""
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def run_smoke(shared_data: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    """The bench's `--smoke` run with `args`, on one torch thread."""
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", *args, "--data", str(shared_data), "--work", str(work)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)


def run_smoke_until(shared_data: Path, work: Path, line: str, *args: str) -> bool:
    """Start the bench's `--smoke` run with `args` and kill it once it logs `line` (True), as a user's kill would
    stop it; False when it ended first."""
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", *args, "--data", str(shared_data), "--work", str(work)]
    with subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for output in proc.stdout:
            if line in output:
                proc.kill()
                return True
        proc.wait(timeout=SMOKE_TIMEOUT_S)
    return False


TRAIN_SPLITS = ("grpo-train", "grpo-train-s1")


def test_smoke_with_two_seeds_reports_each_metric_over_seeds(shared_data: Path, tmp_path: Path) -> None:
    proc = run_smoke(shared_data, tmp_path, "--seeds", "2", "--dpo-close-cut", "both")
    out = tmp_path / "smoke" / "learning.json"
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())

    seeds = result["seeds"]
    assert seeds["n"] == 2
    grpo = seeds["grpo_respondent"]
    for metric in (
        "accuracy",
        "well_formed_rate",
        "reward/format_reward",
        "reward/well_formed_correctness_reward",
        "reward/length_penalty",
        "reward/evidence_use_reward",
        "mean_reasoning_chars",
    ):
        entry = grpo[metric]
        assert len(entry["after"]["values"]) == 2 and 0 <= entry["seeds_higher_after"] <= 2, metric
        assert entry["before"] == result["grpo_respondent"]["before"][metric]  # one before for every seed
    assert grpo["accuracy_before"]["n"] == result["grpo_respondent"]["eval_prompts"]
    low, high = grpo["accuracy_before"]["wilson_95"]
    assert 0 <= low <= grpo["accuracy_before"]["accuracy"] <= high <= 1
    assert len(grpo["zero_variance_share"]) == 2 and all(0 <= s <= 1 for s in grpo["zero_variance_share"])
    assert [z["logged_steps"] for z in result["grpo_respondent"]["zero_variance_steps"]] == [2, 2]
    baselines = result["grpo_respondent"]["baselines"]  # on the same held-out prompts
    assert set(baselines) == {"chance", "majority", "first_option", "copy_example"}
    assert baselines["majority"]["n"] == result["grpo_respondent"]["eval_prompts"]
    assert 0 < result["grpo_respondent"]["before"]["modal_answer_share"] <= 1
    for metric in ("cites_relevant_number", "cites_distractor_number", "cites_first_line"):  # what is cited
        assert len(grpo[metric]["after"]["values"]) == 2, metric
    # every measurement keeps the held-out replies it scored, so a metric added later needs no model
    kept = {
        folder: json.loads((tmp_path / "smoke" / folder / "heldout_replies.json").read_text())
        for folder in (
            "grpo-before",
            "grpo-merged-s0",
            "grpo-merged-s1",
            "extractor-before",
            "dpo-train-closed-s1-merged-s1",  # seed 1's own pairs (its own training questions)
        )
    }
    # each seed learned from questions of its own: seed 1 recorded runs on them and exported its own prompts
    from datasets import load_from_disk

    asked = [set(load_from_disk(str(tmp_path / "smoke" / split / "dataset"))["question"]) for split in TRAIN_SPLITS]
    assert asked[0] and asked[1] and asked[0] != asked[1]
    assert "own training questions" in result["grpo_respondent"]["seed_changes"]
    prompts = {"grpo": result["grpo_respondent"]["eval_prompts"], "dpo": result["dpo_extractor"]["eval_prompts"]}
    assert all(len(kept[f]["replies"]) == prompts["grpo" if f.startswith("grpo") else "dpo"] for f in kept)
    assert len({kept[f]["prompts_sha256"] for f in kept if f.startswith("grpo")}) == 1  # the same prompts
    # and beside the results file, per arm and phase: what each reply answered, its gold and its reward parts
    beside = tmp_path / "smoke" / "learning" / "replies"
    assert sorted(p.name for p in beside.iterdir()) == sorted(
        f"{arm}_{phase}.jsonl.gz"
        for arm, phases in (
            ("grpo_respondent", ("before", "seed0_after", "seed1_after")),
            ("extractor", ("before",)),
            ("dpo_extractor", ("seed0_after", "seed1_after")),
            ("dpo_extractor_close_cut", ("seed0_after", "seed1_after")),
        )
        for phase in phases
    )
    read_replies = bench_module("kept_replies").read_replies
    respondent_rows = read_replies(beside / "grpo_respondent_seed1_after.jsonl.gz")
    assert [r["reply"] for r in respondent_rows] == kept["grpo-merged-s1"]["replies"]
    assert [r["gold"] for r in respondent_rows] == [
        r["gold"] for r in read_replies(beside / "grpo_respondent_before.jsonl.gz")
    ]
    assert {"format_reward", "well_formed_correctness_reward"} <= set(respondent_rows[0]["rewards"])
    extractor_rows = read_replies(beside / "extractor_before.jsonl.gz")
    assert [r["reply"] for r in extractor_rows] == kept["extractor-before"]["replies"]
    assert {"structure", "faithfulness", "conciseness", "total"} <= set(extractor_rows[0]["rewards"])

    for arm in ("dpo_extractor", "dpo_extractor_close_cut"):  # both settings, on the same sampled candidates
        dpo = seeds[arm]
        assert set(dpo["mean_reward_gain"]) == {"mean", "sd"}
        assert len(dpo["strict_json_rate"]["after"]["values"]) == 2
        assert result[arm]["close_cut_lists"] == arm.endswith("close_cut")
        composition = result[arm]["pair_composition"]  # what the pairs teach: each side's reward components
        assert set(composition) == ({"chosen", "rejected"} if result[arm]["pairs"] else set())
        assert all(composition[side]["total"] <= composition["chosen"]["total"] for side in composition)
        for metric in (
            "reward/structure",
            "reward/faithfulness",
            "reward/conciseness",
            "mean_triplets",
            "mean_completion_chars",
        ):  # every component of the extractor reward, and the lengths
            assert len(dpo[metric]["after"]["values"]) == 2, metric
    assert result["dpo_extractor"]["before"] == result["dpo_extractor_close_cut"]["before"]

    # --reuse-trained with a third seed: the two trained seeds are measured again from their merged models.
    proc = run_smoke(
        shared_data, tmp_path, "--reuse", "--reuse-trained", "--parts", "dpo", "--seeds", "3", "--dpo-close-cut", "both"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("reusing dpo-") + proc.stdout.count("reusing dpo-") == 4  # 2 arms x seeds 0 and 1
    grown = json.loads(out.read_text())
    assert grown["seeds"]["n"] == 2  # the GRPO part still has 2 seeds
    for arm in ("dpo_extractor", "dpo_extractor_close_cut"):
        values = grown["seeds"][arm]["mean_reward"]["after"]["values"]
        assert len(values) == 3 and values[:2] == seeds[arm]["mean_reward"]["after"]["values"]
        assert grown[arm]["reused_seeds"] == [0, 1]

    # A training killed before its merge goes on from its last checkpoint when rerun with --reuse (here the
    # final one: the marker that the merge finished is removed, as a kill between the two leaves it).
    (tmp_path / "smoke" / "grpo-merged-s0" / "bench_run.json").unlink()
    proc = run_smoke(shared_data, tmp_path, "--reuse", "--parts", "grpo", "--seeds", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "grpo-out-s0: went on from its checkpoint at step 2" in proc.stderr + proc.stdout
    # and a finished seed, rerun without --reuse-trained, is trained again from the start
    proc = run_smoke(shared_data, tmp_path, "--reuse", "--parts", "grpo", "--seeds", "1")
    assert proc.returncode == 0 and "went on from" not in proc.stderr + proc.stdout

    # A multi-seed run records each seed as it finishes: killed while training seed 1, the file keeps seed 0
    # (measured again from its merged model here) and says how far the run got; --first-seed 1 goes on.
    shutil.rmtree(tmp_path / "smoke" / "grpo-out-s1")
    (tmp_path / "smoke" / "grpo-merged-s1" / "bench_run.json").unlink()
    seed_one_started = run_smoke_until(
        shared_data,
        tmp_path,
        "grpo_respondent seed 0: recorded",
        "--reuse",
        "--reuse-trained",
        "--parts",
        "grpo",
        "--seeds",
        "2",
    )
    assert seed_one_started, "the run ended without recording seed 0"
    stopped = json.loads(out.read_text())
    assert stopped["progress"].startswith("grpo_respondent seed 0 recorded")
    assert stopped["seeds"]["grpo_respondent"]["n"] == 1 and stopped["grpo_respondent"]["reused_seeds"] == [0]
    proc = run_smoke(
        shared_data, tmp_path, "--reuse", "--reuse-trained", "--parts", "grpo", "--first-seed", "1", "--seeds", "1"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finished = json.loads(out.read_text())
    assert "progress" not in finished and finished["seeds"]["grpo_respondent"]["n"] == 2
    assert finished["grpo_respondent"]["reused_seeds"] == [0]  # the earlier run's, kept
    assert (
        finished["seeds"]["grpo_respondent"]["accuracy"]["after"]["values"][0]
        == stopped["seeds"]["grpo_respondent"]["accuracy"]["after"]["values"][0]
    )

    # seeds recorded against another before (other traces: another kind of CPU) are not added to: one clear line
    assert json.loads(out.read_text())["grpo_respondent"]["cpu"] == cpu_model()
    recorded = json.loads(out.read_text())
    recorded["seeds"]["grpo_respondent"]["accuracy"]["before"] += 0.5
    out.write_text(json.dumps(recorded))
    proc = run_smoke(shared_data, tmp_path, "--reuse", "--parts", "grpo", "--first-seed", "1", "--seeds", "1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--first-seed 1 cannot add to grpo_respondent" in proc.stderr and "accuracy differ" in proc.stderr
    assert "Recorded on CPU" in proc.stderr and "grpo-merged-s1" not in proc.stderr  # stopped before training


def test_paired_seeds_report_each_seeds_own_before_and_every_nested_metric() -> None:
    seeds = bench_module("seeds")
    befores = [
        {"accuracy": 0.25, "rewards": {"format": 0.5}, "ended": {"budget": 10}},
        {"accuracy": 0.5, "rewards": {"format": 0.25}, "ended": {"budget": 8}},
    ]
    afters = [
        {"accuracy": 0.5, "rewards": {"format": 1.0}, "ended": {"budget": 4, "answer": 6}},
        {"accuracy": 0.25, "rewards": {"format": 0.75}, "ended": {"budget": 2}},
    ]
    summary = seeds.paired_over_seeds(befores, afters)
    assert summary["n"] == 2
    assert summary["accuracy"]["before"]["values"] == [0.25, 0.5]
    assert summary["accuracy"]["gain"] == {"mean": 0.0, "sd": 0.3536, "values": [0.25, -0.25]}
    assert summary["accuracy"]["seeds_higher_after"] == 1
    assert summary["rewards/format"]["after"]["mean"] == 0.875 and summary["rewards/format"]["seeds_higher_after"] == 2
    assert summary["ended/budget"]["gain"]["values"] == [-6, -6]
    assert "ended/answer" not in summary  # only in one after: no before to compare with
    runs = [{"stage1": {"before": b, "after": a}} for b, a in zip(befores, afters)]
    part = seeds.part_over_seeds(runs, "stage1", eval_prompts=4)  # what each multi-stage bench records per part
    assert {k: v for k, v in part.items() if k != "accuracy_after"} == summary
    assert [a["accuracy"] for a in part["accuracy_after"]] == [0.5, 0.25] and part["accuracy_after"][0]["n"] == 4
    befores[1]["rewards"] = {}  # a metric one seed lacks (recorded before it existed) has no mean over n seeds
    assert "rewards/format" not in seeds.paired_over_seeds(befores, afters)


def test_seeds_added_later_extend_the_recorded_ones_against_the_same_before() -> None:
    seeds = bench_module("seeds")
    before = {"mean_reward": 0.5, "strict_json_rate": 0.1}
    recorded = seeds.over_seeds(
        before, [{"mean_reward": 0.6, "strict_json_rate": 0.2}, {"mean_reward": 0.4, "strict_json_rate": 0.1}]
    )
    recorded = {**recorded, "mean_reward_gain": seeds.gain(recorded, "mean_reward")}  # extra keys are not metrics
    earlier = seeds.afters_from_summary(recorded, before, 2)
    assert earlier == [{"mean_reward": 0.6, "strict_json_rate": 0.2}, {"mean_reward": 0.4, "strict_json_rate": 0.1}]
    grown = seeds.over_seeds(before, [*earlier, {"mean_reward": 0.8, "strict_json_rate": 0.3}])
    assert grown["n"] == 3 and grown["mean_reward"]["after"]["values"] == [0.6, 0.4, 0.8]
    assert grown["mean_reward"]["seeds_higher_after"] == 2
    newer = seeds.over_seeds(
        {**before, "cites": 0.2}, [*earlier, {"mean_reward": 0.8, "strict_json_rate": 0.3, "cites": 0.4}]
    )
    assert "cites" not in newer  # measured in the added seed only: no mean over 1 seed under n = 3
    with pytest.raises(ValueError, match="another before"):
        seeds.afters_from_summary(recorded, {**before, "mean_reward": 0.45}, 2)
    with pytest.raises(ValueError, match="holds 2 seeds"):
        seeds.afters_from_summary(recorded, before, 3)


def arm_file(path: Path, before: dict, afters: list[dict], cpu: str, **settings) -> Path:
    """A results file holding one run of an arm as learning_signal.py writes it."""
    seeds = bench_module("seeds")
    record = {
        "before": before,
        "after": afters[0],
        "steps": 50,
        "eval_prompts": 48,
        "temperature": 0.7,
        "minutes": 50.0,
        "command": "python benches/learning/learning_signal.py",
        "cpu": cpu,
        **settings,
    }
    summary = {**seeds.over_seeds(before, afters), "zero_variance_share": [0.5] * len(afters)}
    path.write_text(json.dumps({"arm": record, "seeds": {"arm": summary, "n": len(afters)}}))
    return path


def test_runs_with_their_own_befores_combine_into_paired_seeds(tmp_path: Path, capsys) -> None:
    """Two machines' runs of one recipe (other traces, so other befores) join as paired seeds; a third run adds on;
    another recipe is refused in one line."""
    combine = bench_module("combine_runs")
    first = arm_file(
        tmp_path / "a.json",
        {"accuracy": 0.3125, "rewards": {"format": 0.75}},
        [{"accuracy": 0.5, "rewards": {"format": 1.0}}],
        cpu="Xeon",
    )
    second = arm_file(
        tmp_path / "b.json",
        {"accuracy": 0.375, "rewards": {"format": 0.5}},
        [{"accuracy": 0.375, "rewards": {"format": 0.75}}, {"accuracy": 0.5, "rewards": {"format": 1.0}}],
        cpu="EPYC",
    )
    assert combine.main(["--key", "arm", "--into", str(first), str(second)]) == 0
    result = json.loads(first.read_text())
    summary = result["seeds"]["arm"]
    assert summary["n"] == 3 and result["seeds"]["n"] == 3
    assert summary["runs"] == [{"cpu": "Xeon", "seeds": 1}, {"cpu": "EPYC", "seeds": 2}]
    assert summary["accuracy"]["before"]["values"] == [0.3125, 0.375, 0.375]  # each seed beside its own run's
    assert summary["accuracy"]["gain"]["values"] == [0.1875, 0.0, 0.125]
    assert summary["accuracy"]["seeds_higher_after"] == 2
    assert summary["rewards/format"]["gain"]["values"] == [0.25, 0.25, 0.5]
    assert [a["accuracy"] for a in summary["accuracy_after"]] == [0.5, 0.375, 0.5]
    assert len(summary["accuracy_before"]) == 2 and summary["zero_variance_share"] == [0.5, 0.5, 0.5]
    assert [run["cpu"] for run in result["arm"]["runs"]] == ["Xeon", "EPYC"] and "before" not in result["arm"]

    third = arm_file(
        tmp_path / "c.json",
        {"accuracy": 0.25, "rewards": {"format": 0.5}},
        [{"accuracy": 0.25, "rewards": {"format": 0.5}}],
        cpu="EPYC",
    )
    assert combine.main(["--key", "arm", "--into", str(first), str(third)]) == 0
    assert json.loads(first.read_text())["seeds"]["arm"]["accuracy"]["gain"]["values"] == [0.1875, 0.0, 0.125, 0.0]
    kept = first.read_text()
    assert combine.main(["--key", "arm", "--into", str(first), str(third)]) == 2  # run twice: nothing counts twice
    assert "given twice" in capsys.readouterr().err and first.read_text() == kept

    # the third run grown by --first-seed (its seed 0 and a seed 1) replaces itself; other seeds against its before
    # are refused
    grown = arm_file(
        tmp_path / "c2.json",
        {"accuracy": 0.25, "rewards": {"format": 0.5}},
        [{"accuracy": 0.25, "rewards": {"format": 0.5}}, {"accuracy": 0.5, "rewards": {"format": 1.0}}],
        cpu="EPYC",
    )
    assert combine.main(["--key", "arm", "--into", str(first), str(grown)]) == 0
    combined = json.loads(first.read_text())["seeds"]["arm"]
    assert combined["accuracy"]["gain"]["values"] == [0.1875, 0.0, 0.125, 0.0, 0.25]
    assert combined["runs"] == [{"cpu": "Xeon", "seeds": 1}, {"cpu": "EPYC", "seeds": 2}, {"cpu": "EPYC", "seeds": 2}]
    kept = first.read_text()
    rerun = arm_file(
        tmp_path / "c3.json",
        {"accuracy": 0.25, "rewards": {"format": 0.5}},
        [{"accuracy": 0.375, "rewards": {"format": 0.5}}],
        cpu="EPYC",
    )
    assert combine.main(["--key", "arm", "--into", str(first), str(rerun)]) == 2
    assert "grow with learning_signal.py --first-seed" in capsys.readouterr().err and first.read_text() == kept

    other = arm_file(tmp_path / "d.json", {"accuracy": 0.25}, [{"accuracy": 0.5}], cpu="EPYC", temperature=0.9)
    assert combine.main(["--key", "arm", "--into", str(first), str(other)]) == 2
    assert "trained another recipe: temperature differ" in capsys.readouterr().err and first.read_text() == kept
    assert combine.main(["--key", "missing", "--into", str(first), str(other)]) == 2
    assert "holds no arm 'missing'" in capsys.readouterr().err
    # malformed files: one clear line each, and the combined file is left as it was
    (tmp_path / "list.json").write_text("[]")
    assert combine.main(["--key", "arm", "--into", str(first), str(tmp_path / "list.json")]) == 2
    assert "holds no arm 'arm'" in capsys.readouterr().err
    broken = json.loads(third.read_text())
    broken["arm"]["runs"] = [{"cpu": "EPYC"}]  # a combined record whose run lost its before and afters
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert combine.main(["--key", "arm", "--into", str(first), str(tmp_path / "broken.json")]) == 2
    assert "is not as learning_signal.py writes it (KeyError" in capsys.readouterr().err
    assert first.read_text() == kept


def test_a_seed_is_reused_only_when_its_merge_finished_with_the_same_config(tmp_path: Path) -> None:
    import dataclasses

    seeds = bench_module("seeds")

    @dataclasses.dataclass
    class Config:
        output_dir: str
        max_steps: int = 3
        seed: int = 0

    config, merged = Config(str(tmp_path / "out")), tmp_path / "merged"
    merged.mkdir()
    assert seeds.trained_earlier(config, merged) is None  # never merged
    run = {"steps": 3, "minutes": 1.5, "zero_variance_steps": {"share": 0.25}}
    seeds.record_trained(merged, config, run)
    assert seeds.trained_earlier(config, merged) == run
    assert seeds.trained_earlier(dataclasses.replace(config, seed=1), merged) is None  # another config
    marker = merged / seeds.RUN_FILE
    recorded = json.loads(marker.read_text())
    marker.write_text(json.dumps({**recorded, "reward_code_sha256": "0" * 64}))
    assert seeds.trained_earlier(config, merged) is None  # trained under other reward code
    assert seeds.trained_earlier(config, merged, rewarded=False) == run  # SFT reads no reward: still the same
    marker.write_text(json.dumps(recorded))
    assert seeds.trained_earlier(config, merged) == run
    marker.write_text(marker.read_text()[:20])  # a kill while the marker was written
    assert seeds.trained_earlier(config, merged) is None
    marker.unlink()  # what a new training of the seed does first
    assert seeds.trained_earlier(config, merged) is None


def test_a_finished_seed_is_reused_and_an_unfinished_or_changed_one_runs_again(tmp_path: Path) -> None:
    run_or_reuse = bench_module("seeds").run_or_reuse
    folder, settings, runs = tmp_path / "train-s0", {"config": {"seed": 0, "max_steps": 8}, "eval_questions": 48}, []

    def train() -> dict:
        runs.append(1)
        (folder / "stage1").mkdir(parents=True)  # what a training writes
        return {"stage1": {"after": {"accuracy": 0.5}}}

    first, reused = run_or_reuse(folder, settings, train, reuse=True)  # nothing recorded yet: trains
    assert not reused and len(runs) == 1
    again, reused = run_or_reuse(folder, settings, train, reuse=True)
    assert reused and again == first and len(runs) == 1
    _, reused = run_or_reuse(folder, {**settings, "eval_questions": 12}, train, reuse=True)  # another held-out set
    assert not reused and len(runs) == 2  # the folder was emptied first: the training found no stale stage
    _, reused = run_or_reuse(folder, {**settings, "eval_questions": 12}, train, reuse=False)
    assert not reused and len(runs) == 3


def lever_options(**changed: Any) -> Namespace:
    """learning_signal.py's GRPO options at their defaults, with `changed` ones (by attribute name)."""
    return Namespace(
        **{
            "grpo_evidence_weight": None,
            "grpo_respond_tokens": None,
            "respond_tokens": 96,
            "grpo_generations": 4,
            "grpo_temperature": 0.7,
            "grpo_prompts_per_step": 1,
            "grpo_example": "current",
            "grpo_steps": 50,
            "grpo_resample": 0,
            "smoke": False,
            **changed,
        }
    )


def test_each_grpo_lever_arm_has_its_own_key_and_folders() -> None:
    grpo_arm = bench_module("learning_signal").grpo_arm

    def options(
        evidence=None,
        tokens=None,
        generations=4,
        temperature=0.7,
        prompts=1,
        example="current",
        steps=50,
        resample=0,
        smoke=False,
    ):
        return lever_options(
            grpo_evidence_weight=evidence,
            grpo_respond_tokens=tokens,
            grpo_generations=generations,
            grpo_temperature=temperature,
            grpo_prompts_per_step=prompts,
            grpo_example=example,
            grpo_steps=steps,
            grpo_resample=resample,
            smoke=smoke,
        )

    def arm(*args, **kwargs):
        key, settings = grpo_arm(options(*args, **kwargs))
        return key, settings.folder, settings.tokens, settings.weights

    assert arm() == arm(tokens=96) == ("grpo_respondent", "grpo", 96, {})  # the default arm: its seeds are reused
    assert arm(evidence=1.0) == ("grpo_respondent_evidence_1", "grpo-evidence1", 96, {"evidence": 1.0})
    assert arm(tokens=192) == ("grpo_respondent_tokens_192", "grpo-tokens192", 192, {})
    assert arm(0.5, 192) == (
        "grpo_respondent_evidence_0.5_tokens_192",
        "grpo-evidence0.5-tokens192",
        192,
        {"evidence": 0.5},
    )
    # The zero-variance levers: each sampling setting off its default is an arm of its own.
    assert arm(generations=8)[:2] == ("grpo_respondent_generations_8", "grpo-generations8")
    assert arm(temperature=1.0)[:2] == ("grpo_respondent_temperature_1", "grpo-temperature1")
    assert arm(temperature=0.7000001)[0] == "grpo_respondent_temperature_0.7000001"  # never the default's name
    assert arm(prompts=2, temperature=0.9)[:2] == (
        "grpo_respondent_temperature_0.9_prompts_2",
        "grpo-temperature0.9-prompts2",
    )
    prompts_arm = grpo_arm(options(prompts=2))[1]
    assert (prompts_arm.generations, prompts_arm.temperature, prompts_arm.prompts_per_step) == (4, 0.7, 2)
    # the same sampled completions in half the steps, and dynamic sampling, are arms too; --smoke's steps are its own
    assert arm(prompts=2, steps=25)[:2] == ("grpo_respondent_prompts_2_steps_25", "grpo-prompts2-steps25")
    assert arm(resample=2)[:2] == ("grpo_respondent_resample_2", "grpo-resample2")
    assert grpo_arm(options(resample=2))[1].resample == 2
    assert arm(steps=2, smoke=True)[:2] == ("grpo_respondent", "grpo")


def test_respondent_metrics_split_numbered_citations_into_relevant_and_distractor() -> None:
    respondent_metrics = bench_module("learning_signal").respondent_metrics
    evidence = [
        {"condition": "c", "relation": "r", "conclusion": "x", "snippet_id": "s1", "distractor": True},
        {"condition": "c", "relation": "r", "conclusion": "y", "snippet_id": "s2", "distractor": False},
    ]
    row = {"options": None, "triplets": evidence}
    replies = [
        "<think>Evidence 1 says so.</think><answer>yes</answer>",  # a distractor
        "<think>Evidence 2 says so.</think><answer>yes</answer>",  # the relevant line
        "<think>Evidence 1 and evidence 2 agree.</think><answer>yes</answer>",  # both
        "<think>Evidence 7 says so.</think><answer>yes</answer>",  # a number the prompt never showed
        "<think>The evidence says so.</think><answer>yes</answer>",
    ]  # no number
    metrics = respondent_metrics(replies, [{**row, "gold": "yes", "question": "Q?"}] * len(replies))
    assert {name: metrics[name] for name in ("cites_a_number", "cites_relevant_number", "cites_distractor_number")} == {
        "cites_a_number": 3 / 5,
        "cites_relevant_number": 2 / 5,
        "cites_distractor_number": 2 / 5,
    }
    assert metrics["cites_first_line"] == 2 / 5  # a position habit shows whatever line 1 holds
    assert metrics["names_unused_line"] == 3 / 5  # "says so" uses no line's words
    # with line 2's words: only the reply naming line 1 for them, and the one naming both with no words, remain
    with_words = [reply.replace("says so", "says y holds") for reply in replies]
    assert respondent_metrics(with_words, [{**row, "gold": "yes", "question": "Q?"}] * 5)["names_unused_line"] == 2 / 5


def test_a_worked_example_arm_trains_on_its_own_rewritten_copy_of_the_export(tmp_path: Path) -> None:
    from datasets import Dataset, load_from_disk

    from ermedrag.agents import respondent
    from ermedrag.agents.base import to_chat

    learning_signal = bench_module("learning_signal")
    prompt = to_chat(respondent.build_messages("Is it yes?", None, "1. [s1] a — causes — b"))  # as the export
    exported = tmp_path / "grpo-train" / "dataset"
    Dataset.from_list([{"prompt": prompt, "gold": "yes"}]).save_to_disk(str(exported))
    options = lever_options(grpo_respond_tokens=192, grpo_example="cites_number")
    key, arm = learning_signal.grpo_arm(options)
    assert key == "grpo_respondent_tokens_192_example_cites_number"
    assert arm.folder == "grpo-tokens192-examplecites_number"

    rows = load_from_disk(str(arm.prepare_train_dataset(tmp_path)))
    assert arm.prepare_train_dataset(tmp_path) == tmp_path / "grpo-tokens192-examplecites_number-train" / "dataset"
    example_reply, question = rows[0]["prompt"][2]["content"], rows[0]["prompt"][-1]["content"]
    assert "Evidence 1 says" in example_reply and question == prompt[-1]["content"] and rows[0]["gold"] == "yes"
    assert not [p.name for p in exported.iterdir() if p.name.startswith("cache-")]  # the export is left as it was
    default = learning_signal.grpo_arm(lever_options(grpo_respond_tokens=192))[1]
    assert default.prepare_train_dataset(tmp_path) == exported  # the default arm trains on the export itself


def test_an_example_copy_from_another_example_text_is_written_again_and_its_seeds_retrained(tmp_path: Path) -> None:
    from datasets import Dataset, load_from_disk

    from ermedrag.agents import respondent
    from ermedrag.agents.base import to_chat

    learning_signal = bench_module("learning_signal")
    prompt = to_chat(respondent.build_messages("Is it yes?", None, "1. [s1] a — causes — b"))
    Dataset.from_list([{"prompt": prompt, "gold": "yes"}]).save_to_disk(str(tmp_path / "grpo-train" / "dataset"))
    options = lever_options(grpo_respond_tokens=192, grpo_example="cites_number")
    arm = learning_signal.grpo_arm(options)[1]
    copy = arm.prepare_train_dataset(tmp_path)
    # a copy written when the example read otherwise, and a seed trained on it (finished, with checkpoints)
    stale = [
        [*row[:2], {**row[2], "content": row[2]["content"].replace("Evidence 1", "Line 1")}, *row[3:]]
        for row in load_from_disk(str(copy))["prompt"]
    ]
    Dataset.from_list([{"prompt": p, "gold": "yes"} for p in stale]).save_to_disk(str(copy) + ".old")
    shutil.rmtree(copy)
    Path(str(copy) + ".old").rename(copy)
    merged, checkpoints = tmp_path / f"{arm.folder}-merged-s0", tmp_path / f"{arm.folder}-out-s0" / "checkpoint-50"
    checkpoints.mkdir(parents=True)
    merged.mkdir()
    (merged / "bench_run.json").write_text("{}")

    assert arm.prepare_train_dataset(tmp_path) == copy
    assert "Evidence 1 says" in load_from_disk(str(copy))[0]["prompt"][2]["content"]
    assert not (merged / "bench_run.json").exists() and not checkpoints.parent.exists()  # trained again, from 0
    (merged / "bench_run.json").write_text("{}")
    arm.prepare_train_dataset(tmp_path)  # an up-to-date copy is kept, with its seeds
    assert (merged / "bench_run.json").exists()


def test_rescoring_refuses_replies_recorded_on_other_held_out_prompts() -> None:
    citation_example = bench_module("citation_example")
    rows = [{"question": "Q?", "options": None, "gold": "yes", "triplets": []}]
    recorded = {
        "prompts_sha256": citation_example.prompts_sha256(rows),
        "arms": {"current": {"replies": ["<think>The evidence says so.</think><answer>yes</answer>"]}},
    }
    assert citation_example.rescore(recorded, rows)["arms"]["current"]["accuracy"] == 1.0
    with pytest.raises(SystemExit, match="not the ones the recorded replies answered"):
        citation_example.rescore(recorded, [{**rows[0], "gold": "no"}])


def test_a_run_never_replaces_a_record_combined_from_several_machines(tmp_path: Path) -> None:
    """combine_runs.py's record holds other machines' runs, which a run here cannot rebuild; a one-machine record
    is what a rerun replaces. Both refusals come before any model is loaded."""
    bench = bench_module("learning_signal")
    combined = {"runs": [{"cpu": "Xeon", "seeds": 1}, {"cpu": "EPYC", "seeds": 2}]}
    record = tmp_path / "smoke" / "learning.json"  # where --smoke records
    record.parent.mkdir()
    record.write_text(json.dumps({"grpo_respondent": combined, "dpo_extractor_close_cut": {"steps": 2}}))
    command = [sys.executable, str(SCRIPT), "--smoke", "--reuse", "--work", str(tmp_path), "--data", str(tmp_path)]
    refused = subprocess.run(command + ["--parts", "grpo"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "holds grpo_respondent combined from 2 runs" in refused.stderr
    assert json.loads(record.read_text())["grpo_respondent"] == combined  # untouched
    bench.refuse_combined(
        json.loads(record.read_text()), record, bench.dpo_keys(lever_options(dpo_close_cut="on", dpo_temperature=1.0))
    )  # a one-machine record: no refusal
    assert bench.dpo_keys(lever_options(dpo_close_cut="both", dpo_temperature=0.7)) == [
        "dpo_extractor_t0.7",
        "dpo_extractor_close_cut_t0.7",
    ]

    missing = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "no" / "x.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "its folder does not exist" in missing.stderr


def test_seeds_added_later_keep_the_earlier_seeds_timing_and_reuse() -> None:
    training_time = bench_module("learning_signal").training_time
    earlier = {"minutes": 50.0, "reused_seeds": [0]}  # two seeds, a mean of 50 minutes each
    assert training_time([2], [{"minutes": 20.0, "reused": False}], earlier, 2) == {
        "minutes": 40.0,
        "reused_seeds": [0],
    }
    assert training_time([0], [{"minutes": 20.0, "reused": True}], earlier, 0) == {"minutes": 20.0, "reused_seeds": [0]}


def test_a_second_run_on_a_work_folder_in_use_stops_naming_the_first(tmp_path: Path) -> None:
    seeds = bench_module("seeds")
    work = tmp_path / "full"
    holder = subprocess.Popen(  # a bench run holding the folder, until its stdin closes
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from seeds import hold_work_folder; "
            f"hold_work_folder(Path({str(work)!r})); print('held', flush=True); sys.stdin.read()",
        ],
        cwd=SCRIPT.parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        in_use = rf"{re.escape(str(work))}, a bench.s work folder, is held by process {holder.pid} "
        with pytest.raises(SystemExit, match=in_use):
            seeds.hold_work_folder(work)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    seeds.hold_work_folder(work)  # free once that run has exited
    seeds.hold_work_folder(work)  # and this process may claim it again
