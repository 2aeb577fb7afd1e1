"""The GRPO/DPO learning bench (benches/learning/learning_signal.py): its `--smoke` run end to end with two seeds
(real PubMedQA questions and graph runs, the real trainers on a tiny random model), checking the sections that
issue 15 asks for: per-seed results against one before, every reward component, the zero-variance share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "benches" / "learning" / "learning_signal.py"
SMOKE_TIMEOUT_S = 900  # ~40 s on one thread of a busy 2-core machine


def test_smoke_with_two_seeds_reports_each_metric_over_seeds(shared_data: Path, tmp_path: Path) -> None:
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--seeds", "2", "--dpo-close-cut", "both",
                           "--data", str(shared_data), "--work", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SMOKE_TIMEOUT_S)
    out = tmp_path / "smoke" / "learning.json"
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())

    seeds = result["seeds"]
    assert seeds["n"] == 2
    grpo = seeds["grpo_respondent"]
    for metric in ("accuracy", "well_formed_rate", "reward/format_reward", "reward/well_formed_correctness_reward",
                   "reward/length_penalty", "reward/evidence_use_reward", "mean_reasoning_chars"):
        entry = grpo[metric]
        assert len(entry["after"]["values"]) == 2 and 0 <= entry["seeds_higher_after"] <= 2, metric
        assert entry["before"] == result["grpo_respondent"]["before"][metric]  # one before for every seed
    assert grpo["accuracy_before"]["n"] == result["grpo_respondent"]["eval_prompts"]
    low, high = grpo["accuracy_before"]["wilson_95"]
    assert 0 <= low <= grpo["accuracy_before"]["accuracy"] <= high <= 1
    assert len(grpo["zero_variance_share"]) == 2 and all(0 <= s <= 1 for s in grpo["zero_variance_share"])
    assert [z["logged_steps"] for z in result["grpo_respondent"]["zero_variance_steps"]] == [2, 2]

    for arm in ("dpo_extractor", "dpo_extractor_close_cut"):  # both settings, on the same sampled candidates
        dpo = seeds[arm]
        assert set(dpo["mean_reward_gain"]) == {"mean", "sd"}
        assert len(dpo["strict_json_rate"]["after"]["values"]) == 2
        assert result[arm]["close_cut_lists"] == arm.endswith("close_cut")
        composition = result[arm]["pair_composition"]  # what the pairs teach: each side's reward components
        assert set(composition) == ({"chosen", "rejected"} if result[arm]["pairs"] else set())
        assert all(composition[side]["total"] <= composition["chosen"]["total"] for side in composition)
        for metric in ("reward/structure", "reward/faithfulness", "reward/conciseness", "mean_triplets",
                       "mean_completion_chars"):  # every component of the extractor reward, and the lengths
            assert len(dpo[metric]["after"]["values"]) == 2, metric
    assert result["dpo_extractor"]["before"] == result["dpo_extractor_close_cut"]["before"]

    # --reuse-trained with a third seed: the two trained seeds are measured again from their merged models.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--reuse", "--reuse-trained", "--parts", "dpo",
                           "--seeds", "3", "--dpo-close-cut", "both", "--data", str(shared_data), "--work", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("reusing dpo-") + proc.stdout.count("reusing dpo-") == 4  # 2 arms x seeds 0 and 1
    grown = json.loads(out.read_text())
    assert grown["seeds"]["n"] == 2  # the GRPO part still has 2 seeds
    for arm in ("dpo_extractor", "dpo_extractor_close_cut"):
        values = grown["seeds"][arm]["mean_reward"]["after"]["values"]
        assert len(values) == 3 and values[:2] == seeds[arm]["mean_reward"]["after"]["values"]
        assert grown[arm]["reused_seeds"] == [0, 1]


def test_paired_seeds_report_each_seeds_own_before_and_every_nested_metric() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from seeds import paired_over_seeds, part_over_seeds
    finally:
        sys.path.remove(str(SCRIPT.parent))
    befores = [{"accuracy": 0.25, "rewards": {"format": 0.5}, "ended": {"budget": 10}},
               {"accuracy": 0.5, "rewards": {"format": 0.25}, "ended": {"budget": 8}}]
    afters = [{"accuracy": 0.5, "rewards": {"format": 1.0}, "ended": {"budget": 4, "answer": 6}},
              {"accuracy": 0.25, "rewards": {"format": 0.75}, "ended": {"budget": 2}}]
    summary = paired_over_seeds(befores, afters)
    assert summary["n"] == 2
    assert summary["accuracy"]["before"]["values"] == [0.25, 0.5]
    assert summary["accuracy"]["gain"] == {"mean": 0.0, "sd": 0.3536, "values": [0.25, -0.25]}
    assert summary["accuracy"]["seeds_higher_after"] == 1
    assert summary["rewards/format"]["after"]["mean"] == 0.875 and summary["rewards/format"]["seeds_higher_after"] == 2
    assert summary["ended/budget"]["gain"]["values"] == [-6, -6]
    assert "ended/answer" not in summary  # only in one after: no before to compare with
    runs = [{"stage1": {"before": b, "after": a}} for b, a in zip(befores, afters)]
    part = part_over_seeds(runs, "stage1", eval_prompts=4)  # what each multi-stage bench records per part
    assert {k: v for k, v in part.items() if k != "accuracy_after"} == summary
    assert [a["accuracy"] for a in part["accuracy_after"]] == [0.5, 0.25] and part["accuracy_after"][0]["n"] == 4


def test_seeds_added_later_extend_the_recorded_ones_against_the_same_before() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from seeds import afters_from_summary, gain, over_seeds
    finally:
        sys.path.remove(str(SCRIPT.parent))
    before = {"mean_reward": 0.5, "strict_json_rate": 0.1}
    recorded = over_seeds(before, [{"mean_reward": 0.6, "strict_json_rate": 0.2},
                                   {"mean_reward": 0.4, "strict_json_rate": 0.1}])
    recorded = {**recorded, "mean_reward_gain": gain(recorded, "mean_reward")}  # extra keys are not metrics
    earlier = afters_from_summary(recorded, before, 2)
    assert earlier == [{"mean_reward": 0.6, "strict_json_rate": 0.2}, {"mean_reward": 0.4, "strict_json_rate": 0.1}]
    grown = over_seeds(before, [*earlier, {"mean_reward": 0.8, "strict_json_rate": 0.3}])
    assert grown["n"] == 3 and grown["mean_reward"]["after"]["values"] == [0.6, 0.4, 0.8]
    assert grown["mean_reward"]["seeds_higher_after"] == 2
    with pytest.raises(ValueError, match="another before"):
        afters_from_summary(recorded, {**before, "mean_reward": 0.45}, 2)
    with pytest.raises(ValueError, match="holds 2 seeds"):
        afters_from_summary(recorded, before, 3)


def test_a_seed_is_reused_only_when_its_merge_finished_with_the_same_config(tmp_path: Path) -> None:
    import dataclasses

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from seeds import RUN_FILE, record_trained, trained_earlier
    finally:
        sys.path.remove(str(SCRIPT.parent))

    @dataclasses.dataclass
    class Config:
        output_dir: str
        max_steps: int = 3
        seed: int = 0

    config, merged = Config(str(tmp_path / "out")), tmp_path / "merged"
    merged.mkdir()
    assert trained_earlier(config, merged) is None  # never merged
    run = {"steps": 3, "minutes": 1.5, "zero_variance_steps": {"share": 0.25}}
    record_trained(merged, config, run)
    assert trained_earlier(config, merged) == run
    assert trained_earlier(dataclasses.replace(config, seed=1), merged) is None  # another config
    (merged / RUN_FILE).write_text((merged / RUN_FILE).read_text()[:20])  # a kill while the marker was written
    assert trained_earlier(config, merged) is None
    (merged / RUN_FILE).unlink()  # what a new training of the seed does first
    assert trained_earlier(config, merged) is None
