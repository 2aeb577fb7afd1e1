"""TRL trainers on a tiny real model (Qwen2 architecture, random weights, trained BPE tokenizer), on CPU.

Each run is 2-3 optimizer steps on 8 rows: what is tested is the wiring (datasets in the project's
conversational format, LoRA and full fine-tuning, reference models, reward components, metrics, plots,
saving and reloading), not learning.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from ermedrag.testing.tiny_model import build_tiny_causal_lm
from ermedrag.training.checkpoints import SETTINGS_FILE
from ermedrag.training.config import DPOTrainingConfig, GRPOTrainingConfig, SFTTrainingConfig, load_config
from ermedrag.training.rewards import reward_code_sha256
from ermedrag.training.trainers import METRICS_FILE, PLOT_FILE, train_dpo, train_grpo, train_sft

REPO = Path(__file__).resolve().parents[2]
LETTERS = "ABCD"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def dpo_dataset(tmp_path_factory) -> str:
    from datasets import Dataset

    rows = []
    for i in range(8):
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": "Extract condition-relation-conclusion triplets as JSON."},
                    {"role": "user", "content": f"Snippet s{i}: Metformin lowers blood glucose in type 2 diabetes."},
                ],
                "chosen": [
                    {
                        "role": "assistant",
                        "content": '[{"condition": "type 2 diabetes", "relation": "treats", "conclusion": "metformin"}]',
                    }
                ],
                "rejected": [{"role": "assistant", "content": "The snippet talks about several things."}],
                # provenance columns, as training.export writes them
                "run_id": f"run-{i}",
                "chosen_reward": 0.9,
                "rejected_reward": 0.2,
            }
        )
    path = tmp_path_factory.mktemp("dpo") / "dataset"
    Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="module")
def grpo_dataset(tmp_path_factory) -> str:
    from datasets import Dataset

    rows = []
    for i in range(8):
        options = {"A": "metformin", "B": "aspirin", "C": "heparin", "D": "digoxin"}
        question = f"Case {i}: which drug lowers blood glucose? " + " ".join(f"{k}) {v}" for k, v in options.items())
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": "Think in <think></think>, answer with <answer>letter</answer>."},
                    {"role": "user", "content": question},
                ],
                "gold": LETTERS[i % 4],
                "options": options,
            }
        )
    path = tmp_path_factory.mktemp("grpo") / "dataset"
    Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


# Reward functions with TRL's signature. Conversational completions are lists of messages.
SEEN_COLUMNS: list[dict] = []


def has_answer_tag(completions, **kwargs) -> list[float]:
    return [1.0 if "<answer>" in completion[-1]["content"] else 0.0 for completion in completions]


SEEN_COMPLETIONS: list[str] = []


def records_completions(completions, **kwargs) -> list[float]:
    SEEN_COMPLETIONS.extend(completion[-1]["content"] for completion in completions)
    return [float(len(completion[-1]["content"]) % 3) for completion in completions]


def length_score(completions, gold, options, **kwargs) -> list[float]:
    SEEN_COLUMNS.append({"gold": list(gold), "options": list(options)})
    return [min(len(completion[-1]["content"]), 60) / 60 for completion in completions]


def read_metrics(output_dir: str) -> list[dict]:
    lines = (Path(output_dir) / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def step_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


def assert_plot(output_dir: str) -> None:
    png = Path(output_dir) / PLOT_FILE
    assert png.is_file()
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # several panels with curves, not an empty canvas


def adapter_weights(output_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "adapter_model.safetensors"))


def assert_adapter_trained(output_dir: str) -> None:
    import torch
    from peft import AutoPeftModelForCausalLM

    assert (Path(output_dir) / "adapter_config.json").is_file()
    assert (Path(output_dir) / "adapter_model.safetensors").is_file()
    model = AutoPeftModelForCausalLM.from_pretrained(output_dir)
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert lora_b, "no LoRA weights in the saved adapter"
    # LoRA B starts at zero: non-zero values mean the saved adapter holds trained weights.
    assert any(torch.count_nonzero(p) > 0 for p in lora_b)


def small(cls, model: str, dataset: str, output_dir: Path, **overrides):
    base = dict(
        model=model,
        dataset=dataset,
        output_dir=str(output_dir),
        learning_rate=1e-3,
        max_steps=3,
        lora_r=8,
        lora_alpha=16,
        logging_steps=1,
        save_steps=1000,
    )
    return cls(**{**base, **overrides})


def test_dpo_lora_run_logs_saves_and_plots(tiny_model, dpo_dataset, tmp_path):
    config = small(
        DPOTrainingConfig, tiny_model, dpo_dataset, tmp_path / "dpo", per_device_train_batch_size=2, max_length=128
    )
    summary = train_dpo(config)

    assert summary["steps"] == 3 and summary["adapter"] is True
    records = step_records(read_metrics(config.output_dir))
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "entropy"):
            assert isinstance(record[key], float) and math.isfinite(record[key]), key
    assert summary["final_metrics"]["step"] == 3
    # lr 1e-3 on 3 steps of one preference: the margin must have moved in the preferred direction.
    assert records[-1]["rewards/margins"] > records[0]["rewards/margins"]
    assert_adapter_trained(config.output_dir)
    assert_plot(config.output_dir)
    saved = json.loads((Path(config.output_dir) / "training_config.json").read_text())
    assert saved["beta"] == config.beta and saved["model"] == tiny_model


def test_dpo_full_finetune_builds_reference_from_path(tiny_model, dpo_dataset, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    config = small(
        DPOTrainingConfig,
        tiny_model,
        dpo_dataset,
        tmp_path / "dpo_full",
        use_lora=False,
        per_device_train_batch_size=2,
        max_steps=2,
        max_length=128,
    )
    summary = train_dpo(config)

    assert summary["steps"] == 2 and summary["adapter"] is False
    assert len(step_records(read_metrics(config.output_dir))) == 2
    trained = AutoModelForCausalLM.from_pretrained(config.output_dir)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    changed = [
        name
        for (name, p), (_, q) in zip(trained.named_parameters(), initial.named_parameters())
        if not torch.equal(p, q)
    ]
    assert changed, "full fine-tuning saved unchanged weights"


def sft_dataset_folder(tmp_path: Path, replies: list[str | None]) -> str:
    """Respondent prompts as `ermedrag export grpo --questions` writes them: a `reference_reply` or null."""
    from datasets import Dataset

    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Answer with <answer>letter</answer>."},
                {
                    "role": "user",
                    "content": f"Evidence: 1. case {i} — is answered by — metformin. Options: A. metformin",
                },
            ],
            "gold": "A",
            "reference_reply": reply,
        }
        for i, reply in enumerate(replies)
    ]
    path = tmp_path / "sft" / "dataset"
    Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def test_sft_warm_start_trains_on_the_reference_replies_only(tiny_model, tmp_path):
    reply = "<think>Evidence [1] says metformin: option A.</think><answer>A</answer>"
    dataset = sft_dataset_folder(tmp_path, [reply, None] * 4)
    config = small(
        SFTTrainingConfig, tiny_model, dataset, tmp_path / "sft-out", per_device_train_batch_size=2, max_steps=-1
    )  # one epoch: 4 replies, 2 a step
    assert config.to_trl().completion_only_loss  # the prompt is context, never a target
    summary = train_sft(config)
    assert summary["trainer"] == "sft" and summary["steps"] == 2 and summary["rows"] == 4  # the 4 nulls skipped
    losses = [r["loss"] for r in step_records(read_metrics(config.output_dir))]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert_adapter_trained(config.output_dir)
    assert_plot(config.output_dir)
    # GRPO goes on from the merged model
    assert summary["start_model"] == str(Path(config.output_dir) / "merged")
    grpo = gold_letter_config(summary["start_model"], tmp_path / "grpo", "AB", 2, max_steps=1)
    assert train_grpo(grpo, reward_funcs=[has_answer_tag])["steps"] == 1


def test_the_evidence_export_trains_sft_from_the_command_line(tiny_model, tmp_path, capsys):
    """What a user runs: `ermedrag export grpo --questions`, then `ermedrag train sft --config` on its dataset."""
    from ermedrag.cli import main

    questions = tmp_path / "toy.jsonl"
    rows = [
        {
            "id": f"q{i}",
            "question": f"Case {i}?",
            "answer": LETTERS[i % 4],
            "options": {k: f"drug {i}{k}" for k in LETTERS},
        }
        for i in range(6)
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["export", "grpo", "--questions", str(questions), "--out", str(tmp_path / "export")]) == 0
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"model: {tiny_model}\ndataset: {tmp_path / 'export' / 'dataset'}\noutput_dir: {tmp_path / 'run'}\n"
        "max_steps: 1\nper_device_train_batch_size: 2\nlora_r: 8\nlora_alpha: 16\n"
    )
    capsys.readouterr()
    assert main(["train", "sft", "--config", str(config)]) == 0
    printed = capsys.readouterr().out  # TRL's step logs, then the summary
    summary = json.loads(printed[printed.rindex("{\n") :])
    assert summary["trainer"] == "sft" and summary["steps"] == 1 and 0 < summary["rows"] <= 6
    assert (tmp_path / "run" / "merged" / "config.json").is_file()


def test_sft_refuses_a_dataset_without_reference_replies(tiny_model, tmp_path):
    config = small(SFTTrainingConfig, tiny_model, sft_dataset_folder(tmp_path, [None, None]), tmp_path / "out")
    with pytest.raises(ValueError, match="no row with a reference reply"):
        train_sft(config)
    config = small(SFTTrainingConfig, tiny_model, grpo_dataset_without_replies(tmp_path), tmp_path / "out2")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['reference_reply'\]"):
        train_sft(config)


def grpo_dataset_without_replies(tmp_path: Path) -> str:
    from datasets import Dataset

    path = tmp_path / "plain" / "dataset"
    Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}], "gold": "A"}]).save_to_disk(str(path))
    return str(path)


def test_grpo_lora_logs_every_reward_component(tiny_model, grpo_dataset, tmp_path):
    SEEN_COLUMNS.clear()
    config = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        tmp_path / "grpo",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        rewards={"length_score": 0.5},
    )
    summary = train_grpo(config, [has_answer_tag, length_score])

    assert summary["steps"] == 3
    assert summary["reward_functions"] == ["has_answer_tag", "length_score"]
    assert summary["reward_weights"] == {"has_answer_tag": 1.0, "length_score": 0.5}  # unnamed: weight 1
    records = step_records(read_metrics(config.output_dir))
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        for key in (
            "loss",
            "reward",
            "rewards/has_answer_tag/mean",
            "rewards/length_score/mean",
            "rewards/length_score/std",
            "entropy",
            "completions/mean_length",
        ):
            assert key in record and math.isfinite(record[key]), key
        # the total is the weighted sum of the components (TRL's default aggregation)
        expected = record["rewards/has_answer_tag/mean"] + 0.5 * record["rewards/length_score/mean"]
        assert record["reward"] == pytest.approx(expected, abs=1e-5)
        assert 0 < record["completions/mean_length"] <= 16
    # the dataset's extra columns reached the reward function, one value per completion
    assert SEEN_COLUMNS and all(len(seen["gold"]) == 4 for seen in SEEN_COLUMNS)
    assert all(g in LETTERS for seen in SEEN_COLUMNS for g in seen["gold"])
    assert all(o["A"] == "metformin" for seen in SEEN_COLUMNS for o in seen["options"])
    assert_adapter_trained(config.output_dir)
    assert_plot(config.output_dir)
    # how many steps had equal rewards in every group, read from TRL's own per-step figure
    silent = summary["zero_variance_steps"]
    expected_silent = sum(r["frac_reward_zero_std"] == 1.0 for r in records)
    assert silent["logged_steps"] == 3 and silent["steps_without_signal"] == expected_silent
    assert silent["share"] == pytest.approx(expected_silent / 3, abs=1e-4)


def signal_only_for_b(completions, gold, **kwargs) -> list[float]:
    """Equal rewards in a group of gold A (no signal), alternating 0 and 1 in a group of gold B. A's 0.7 is not 0:
    TRL's advantages of equal non-zero rewards are rounding remainders, ~6e-4 in a group of 8, never a signal."""
    return [(1.0 if i % 2 else 0.0) if g == "B" else 0.7 for i, g in enumerate(gold)]


def one_prompt_per_gold(path: Path, golds: str) -> str:
    from datasets import Dataset

    rows = [
        {"prompt": [{"role": "user", "content": f"Case {i}: answer with <answer>letter</answer>."}], "gold": g}
        for i, g in enumerate(golds)
    ]
    Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def gold_letter_config(tiny_model, tmp_path: Path, golds: str, group: int, **overrides) -> GRPOTrainingConfig:
    """A short GRPO run on one prompt per gold letter, one group of `group` completions a step."""
    return small(
        GRPOTrainingConfig,
        tiny_model,
        one_prompt_per_gold(tmp_path / golds.lower(), golds),
        tmp_path / f"{golds.lower()}-out",
        per_device_train_batch_size=group,
        num_generations=group,
        max_completion_length=8,
        stop_strings=[],
        **overrides,
    )


def test_dynamic_sampling_trains_on_batches_with_a_signal(tiny_model, tmp_path):
    """A step whose group got equal rewards is replaced by fresh prompts until one has a signal; the logged figures
    are the kept batch's, and `resampled_batches` says how many were set aside."""
    config = gold_letter_config(tiny_model, tmp_path, "AB", 4, resample_zero_variance_batches=10)
    summary = train_grpo(config, [signal_only_for_b])
    records = step_records(read_metrics(config.output_dir))
    assert summary["steps"] == 3 and [r["step"] for r in records] == [1, 2, 3]
    assert [r["frac_reward_zero_std"] for r in records] == [0.0, 0.0, 0.0]  # every step trained on gold B
    assert summary["zero_variance_steps"]["steps_without_signal"] == 0
    # the sampler's first epoch puts gold A first in one of steps 1 and 2: at least that step drew again
    assert sum(r["resampled_batches"] for r in records) >= 1
    assert_adapter_trained(config.output_dir)

    # with no prompt that can give a signal, each step draws its attempts and trains on the last batch
    config = dataclasses.replace(
        config,
        dataset=one_prompt_per_gold(tmp_path / "aa", "AA"),
        output_dir=str(tmp_path / "aa-out"),
        resample_zero_variance_batches=2,
        per_device_train_batch_size=8,
        num_generations=8,
    )
    summary = train_grpo(config, [signal_only_for_b])
    records = step_records(read_metrics(config.output_dir))
    assert [(r["frac_reward_zero_std"], r["resampled_batches"]) for r in records] == [(1.0, 2.0)] * 3
    silent = summary["zero_variance_steps"]
    assert silent["steps_without_signal"] == silent["steps_resampled"] == 3


def test_a_step_without_any_signal_leaves_the_weights_as_they_were(tiny_model, tmp_path):
    """Every group of gold A gets equal rewards (0.7): TRL's advantages are then rounding remainders, ~6e-4, and
    Adam turns them into full-sized steps (LoRA B reached ~2e-3 without the hold). The trainer holds each such
    step: LoRA B stays at its initial 0."""
    config = gold_letter_config(tiny_model, tmp_path, "AA", 8)
    summary = train_grpo(config, [signal_only_for_b])
    records = step_records(read_metrics(config.output_dir))
    assert [(r["frac_reward_zero_std"], r["silent_steps_held"]) for r in records] == [(1.0, 1.0)] * summary["steps"]
    assert_adapter_untrained(config.output_dir)


def test_the_entropy_bonus_waits_for_a_reward_signal(tiny_model, tmp_path):
    """γ 0.1 on steps that are all silent (gold A): the bonus would be the whole gradient, and Adam a full-sized step
    (the triage sweep's collapse). The trainer sets γ to 0 for such a step and, with β 0, holds it: LoRA B stays 0.
    With entropy_bonus_on_silent_steps (TRL's rule) the same steps move the weights."""
    config = gold_letter_config(tiny_model, tmp_path, "AA", 8, trl_overrides={"entropy_coef": 0.1})
    summary = train_grpo(config, [signal_only_for_b])
    held = [
        (r["entropy_bonus_held"], r["entropy_coef"], r["silent_steps_held"])
        for r in step_records(read_metrics(config.output_dir))
    ]
    assert held == [(1.0, 0.0, 1.0)] * summary["steps"]
    assert_adapter_untrained(config.output_dir)

    ungated = dataclasses.replace(config, output_dir=str(tmp_path / "ungated"), entropy_bonus_on_silent_steps=True)
    summary = train_grpo(ungated, [signal_only_for_b])
    records = step_records(read_metrics(ungated.output_dir))
    assert [r["entropy_coef"] for r in records] == [0.1] * summary["steps"]
    assert not any("entropy_bonus_held" in r or "silent_steps_held" in r for r in records)
    assert_adapter_trained(ungated.output_dir)


def assert_adapter_untrained(output_dir: str) -> None:
    import torch
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(output_dir)
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)


class Interrupted(Exception):
    pass


def interrupted_at_step(step: int, reward=length_score):
    """`reward`, under its own name, raising on the given step's rollouts, as a killed run stops there."""
    calls = 0

    def interrupted(completions, **kwargs) -> list[float]:
        nonlocal calls
        calls += 1
        if calls == step:
            raise Interrupted(f"stopped at step {step}")
        return reward(completions, **kwargs)

    interrupted.__name__ = reward.__name__
    return interrupted


def test_grpo_resume_continues_from_the_last_complete_checkpoint(tiny_model, grpo_dataset, tmp_path):
    import torch

    config = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        tmp_path / "grpo_resume",
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
    )
    with pytest.raises(Interrupted):
        train_grpo(config, [has_answer_tag, interrupted_at_step(4)])
    output_dir = Path(config.output_dir)
    assert [r["step"] for r in step_records(read_metrics(config.output_dir))] == [1, 2, 3]
    assert (output_dir / "checkpoint-2").is_dir() and not (output_dir / "adapter_model.safetensors").exists()
    (output_dir / "checkpoint-3").mkdir()  # a checkpoint the kill cut off before its settings file
    with (output_dir / METRICS_FILE).open("a", encoding="utf-8") as handle:
        handle.write('{"step": 3, "loss": 0.1')  # and the line it was writing

    rollouts_scored = []

    def counted_answer_tag(completions, **kwargs) -> list[float]:
        rollouts_scored.append(len(completions))
        return has_answer_tag(completions)

    counted_answer_tag.__name__ = "has_answer_tag"
    summary = train_grpo(dataclasses.replace(config, resume=True), [counted_answer_tag, length_score])

    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4
    assert len(rollouts_scored) == 2  # only steps 3 and 4 were trained in this run
    # steps 1-2 kept from the interrupted run, step 3 trained again, once in the record, then step 4
    assert [r["step"] for r in step_records(read_metrics(config.output_dir))] == [1, 2, 3, 4]
    assert summary["zero_variance_steps"]["logged_steps"] == 4
    assert_adapter_trained(config.output_dir)
    trained = adapter_weights(config.output_dir)

    # resumed once more, the finished run trains no step past max_steps: it saves its last checkpoint's weights
    again = train_grpo(dataclasses.replace(config, resume=True), [has_answer_tag, length_score])
    assert again["resumed_from_step"] == 4 and again["steps"] == 4 and again["train_loss"] is None
    assert not (output_dir / "checkpoint-5").exists()
    assert [r["step"] for r in step_records(read_metrics(config.output_dir))] == [1, 2, 3, 4]
    assert all(torch.equal(trained[name], weight) for name, weight in adapter_weights(config.output_dir).items())

    # the checkpoints belong to this run's settings: resuming them under others is refused, naming what differs
    with pytest.raises(ValueError, match=r"other settings \(checkpoint-4: learning_rate differ\)"):
        train_grpo(dataclasses.replace(config, resume=True, learning_rate=5e-4), [has_answer_tag, length_score])
    # a setting added after runs were recorded (config.ADDED_SETTINGS) is left out of the record at the value those
    # runs trained with, so checkpoints written before it existed still resume; another value is other settings
    recorded = [json.loads(f.read_text()) for f in output_dir.glob(f"checkpoint-*/{SETTINGS_FILE}")]
    assert recorded and all("resample_zero_variance_batches" not in settings for settings in recorded)
    with pytest.raises(ValueError, match=r"checkpoint-4: resample_zero_variance_batches differ"):
        train_grpo(
            dataclasses.replace(config, resume=True, resample_zero_variance_batches=2), [has_answer_tag, length_score]
        )
    # and to the reward code they were trained under (a reward's rule is code, not a setting)
    for settings_file in output_dir.glob(f"checkpoint-*/{SETTINGS_FILE}"):  # the complete checkpoints
        settings = json.loads(settings_file.read_text())
        assert settings["reward_code_sha256"] == reward_code_sha256()
        settings_file.write_text(json.dumps({**settings, "reward_code_sha256": "0" * 64}))
    with pytest.raises(ValueError, match=r"checkpoint-4: reward_code_sha256 differ"):
        train_grpo(dataclasses.replace(config, resume=True), [has_answer_tag, length_score])


def test_a_new_run_in_a_folder_resumes_its_own_checkpoints_not_the_earlier_runs(
    tiny_model, grpo_dataset, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a relative output_dir, created by the first run, names the same folder after
    first = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        Path("runs") / "grpo",
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        resume=True,
    )
    train_grpo(first, [has_answer_tag])  # leaves checkpoint-2 and checkpoint-4
    second = dataclasses.replace(first, learning_rate=5e-4, resume=False)
    with pytest.raises(Interrupted):  # from the beginning in the same folder, killed at step 3
        train_grpo(second, [has_answer_tag, interrupted_at_step(3)])
    aside = list((tmp_path / "runs" / "grpo").glob("earlier-run-*"))  # the first run's, moved, not overwritten
    assert len(aside) == 1 and sorted(d.name for d in aside[0].iterdir()) == [
        "checkpoint-2",
        "checkpoint-4",
        METRICS_FILE,
    ]
    assert [r["step"] for r in step_records(read_metrics(aside[0]))] == [1, 2, 3, 4]  # its curves go with them
    summary = train_grpo(dataclasses.replace(second, resume=True), [has_answer_tag, length_score])
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4  # its own checkpoint, not the first run's


def test_resume_is_refused_where_it_could_not_go_on_exactly(tiny_model, grpo_dataset, tmp_path):
    base = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        tmp_path / "grpo",
        max_steps=2,
        resume=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
    )
    for overrides, message in (
        ({"trl_overrides": {"num_iterations": 2}}, "num_iterations 1"),
        ({"save_total_limit": 1}, "save_total_limit of 2 or more"),
    ):
        with pytest.raises(ValueError, match=message):  # before any step is trained
            train_grpo(dataclasses.replace(base, **overrides), [has_answer_tag])
        assert not (tmp_path / "grpo" / METRICS_FILE).exists()


def test_resume_without_a_checkpoint_starts_from_the_beginning(tiny_model, grpo_dataset, tmp_path):
    config = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        tmp_path / "grpo_fresh",
        max_steps=2,
        resume=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
    )
    summary = train_grpo(config, [has_answer_tag])
    assert summary["resumed_from_step"] is None and summary["steps"] == 2
    assert [r["step"] for r in step_records(read_metrics(config.output_dir))] == [1, 2]


def test_zero_variance_steps_counts_steps_whose_groups_all_had_equal_rewards():
    from ermedrag.training.metrics import zero_variance_steps

    records = [
        {"step": 1, "frac_reward_zero_std": 1.0},
        {"step": 2, "frac_reward_zero_std": 0.5},
        {"step": 3, "frac_reward_zero_std": 1.0},
        {"step": 4, "frac_reward_zero_std": float("nan")},
        {"step": 5, "loss": 0.1},
    ]
    assert zero_variance_steps(records) == {
        "logged_steps": 3,
        "steps_without_signal": 2,
        "share": 0.6667,
        "mean_frac_reward_zero_std": 0.8333,
    }
    assert zero_variance_steps([{"step": 1, "loss": 0.2}]) is None  # DPO logs no such figure
    # dynamic sampling: step 1 found a signal on its second draw, step 2 on its first, step 3 found none in 2 more
    resampled = [
        {"step": 1, "frac_reward_zero_std": 0.0, "resampled_batches": 1},
        {"step": 2, "frac_reward_zero_std": 0.0, "resampled_batches": 0},
        {"step": 3, "frac_reward_zero_std": 1.0, "resampled_batches": 2},
    ]
    assert zero_variance_steps(resampled) == {
        "logged_steps": 3,
        "steps_without_signal": 1,
        "share": 0.3333,
        "mean_frac_reward_zero_std": 0.3333,
        "steps_resampled": 2,
        "mean_resampled_batches": 1.0,
    }


def test_silent_groups_are_those_whose_advantages_are_all_equal_not_all_zero():
    import torch

    from ermedrag.training.grpo.sampling import silent_group_share

    # TRL's advantages for eight rewards of 0.7 are each ~6e-4 (the mean's rounding remainder over std + 1e-4)
    silent = [5.96e-4] * 8
    learning = [-0.93, 0.93] * 4
    assert silent_group_share({"advantages": torch.tensor(silent + learning)}, 8) == 0.5
    assert silent_group_share({"advantages": torch.tensor(silent + silent)}, 8) == 1.0
    assert silent_group_share({"advantages": torch.tensor([])}, 8) == 1.0


def test_grpo_rollouts_end_at_the_stop_string(tiny_model, grpo_dataset, tmp_path):
    """As the app's respondent stops at </answer>; "e" stands in for it because a random tiny model writes it
    within a few tokens, and nothing may follow the token that completed it."""
    SEEN_COMPLETIONS.clear()
    config = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        tmp_path / "grpo",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=32,
        stop_strings=["e"],
    )
    assert train_grpo(config, [records_completions])["steps"] == 3
    stopped = [text for text in SEEN_COMPLETIONS if "e" in text]
    assert len(SEEN_COMPLETIONS) == 12 and stopped
    assert all(len(text) - text.index("e") <= 12 for text in stopped), stopped  # within the last token
    # a completion ended by its stop string counts as terminated for TRL, not truncated
    assert any(r["completions/clipped_ratio"] < 1.0 for r in step_records(read_metrics(config.output_dir)))


def test_grpo_full_finetune_with_kl_uses_reference_model(tiny_model, grpo_dataset, tmp_path):
    from transformers import AutoModelForCausalLM

    config = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        tmp_path / "grpo_kl",
        use_lora=False,
        beta=0.04,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
    )
    summary = train_grpo(config, [length_score])

    assert summary["steps"] == 2 and summary["adapter"] is False
    records = step_records(read_metrics(config.output_dir))
    assert len(records) == 2
    assert all("kl" in r and r["kl"] >= 0 for r in records)
    # After one update the policy differs from the frozen reference, so the second step's KL is positive.
    assert records[-1]["kl"] > 0
    AutoModelForCausalLM.from_pretrained(config.output_dir)
    assert_plot(config.output_dir)


def test_grpo_with_project_rewards(tiny_model, grpo_dataset, tmp_path):
    from ermedrag.training.rewards import RESPONDENT_REWARDS

    config = small(
        GRPOTrainingConfig,
        tiny_model,
        grpo_dataset,
        tmp_path / "grpo_project",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
    )
    summary = train_grpo(config)  # rewards unset: the respondent's, from the registry
    assert summary["reward_weights"] == RESPONDENT_REWARDS

    records = step_records(read_metrics(config.output_dir))
    assert len(records) == 2
    for name in summary["reward_functions"]:
        assert all(math.isfinite(r[f"rewards/{name}/mean"]) for r in records)
    assert "format_reward" in summary["reward_functions"]


def test_reward_names_are_checked_before_training(tmp_path):
    config = GRPOTrainingConfig(
        model="unused", dataset=str(tmp_path), output_dir=str(tmp_path / "out"), rewards={"has_answer": 1.0}
    )
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['has_answer'\]; known: \['has_answer_tag'\]"):
        train_grpo(config, [has_answer_tag])
    config.rewards = {"corectness": 1.0}
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['corectness'\]; known: \[.*'correctness'"):
        train_grpo(config)


def test_positional_reward_weights_are_refused_with_a_pointer_to_named_ones(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("model: m\ndataset: d\noutput_dir: o\nreward_weights: [1.0, 0.5]\n")
    with pytest.raises(
        ValueError,
        match=r"reward_weights is no longer a key: weight rewards by name with "
        r"rewards: \{name: weight\}",
    ):
        load_config(path, GRPOTrainingConfig)
    config = GRPOTrainingConfig(
        model="m", dataset="d", output_dir=str(tmp_path), num_generations=4, trl_overrides={"reward_weights": [1.0]}
    )
    with pytest.raises(ValueError, match="rewards: {name: weight}"):
        config.to_trl()


def test_load_config_reports_unknown_keys_and_missing_file(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("model: m\ndataset: d\noutput_dir: o\nlearning_rat: 1e-5\nnum_generation: 4\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\).*\['learning_rat', 'num_generation'\]"):
        load_config(path, GRPOTrainingConfig)
    with pytest.raises(FileNotFoundError, match="training config not found"):
        load_config(tmp_path / "absent.yaml", GRPOTrainingConfig)
    path.write_text("model: m\ndataset: d\n")
    with pytest.raises(ValueError, match=r"missing required key\(s\).*output_dir"):
        load_config(path, DPOTrainingConfig)
    # PyYAML reads 1e-5 (no dot) as a string: float fields take it as the number it means.
    path.write_text("model: m\ndataset: d\noutput_dir: o\nlearning_rate: 1e-5\nbeta: 0\n")
    config = load_config(path, DPOTrainingConfig)
    assert config.learning_rate == 1e-5 and config.beta == 0.0


@pytest.mark.parametrize(
    "line, message",
    [
        ("stop_strings: </answer>", r"stop_strings: expected a list of strings \(one string is \['</answer>'\]\)"),
        ("stop_strings: [a, 1]", "stop_strings: expected a list of strings, got"),
        ("max_steps: 2.5", "max_steps: expected a whole number, got 2.5"),
        ("max_steps: true", "max_steps: expected a whole number, got True"),
        ("learning_rate: [1]", r"learning_rate: expected a number, got \[1\]"),
        ("rewards: 3", "rewards: expected a mapping"),
        ("model: 270", "model: expected text, got 270"),
        ("1: x", r"keys must be field names, got \[1\]"),
        ("model: [m", "not valid YAML: while parsing a flow sequence"),
    ],
)
def test_a_config_value_of_the_wrong_kind_is_an_error_naming_its_field(tmp_path, line, message):
    """Never a value that fails later: a string for a list would be taken letter by letter as stop strings."""
    path = tmp_path / "grpo.yaml"
    path.write_text(f"model: m\ndataset: d\noutput_dir: o\n{line}\n")
    with pytest.raises(ValueError, match=message):
        load_config(path, GRPOTrainingConfig)


def test_a_whole_number_written_as_a_float_is_taken_as_the_int_it_means(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("model: m\ndataset: d\noutput_dir: o\nmax_steps: 1e3\nstop_strings: []\n")
    config = load_config(path, GRPOTrainingConfig)
    assert config.max_steps == 1000 and isinstance(config.max_steps, int) and config.stop_strings == []


def test_example_configs_load_and_map_to_trl(tmp_path):
    import torch

    dpo = load_config(REPO / "training/configs/dpo_extractor.yaml", DPOTrainingConfig)
    grpo = load_config(REPO / "training/configs/grpo_respondent.yaml", GRPOTrainingConfig)
    for config in (dpo, grpo):
        config.output_dir = str(tmp_path / "out")
        args = config.to_trl()
        assert args.bf16 is torch.cuda.is_available()
        assert args.use_cpu is (not torch.cuda.is_available())
        assert args.report_to in ("none", [], ["none"])
        assert args.learning_rate == config.learning_rate
    assert grpo.to_trl().num_generations == grpo.num_generations
    from ermedrag.training.rewards import RESPONDENT_REWARDS

    assert grpo.rewards == RESPONDENT_REWARDS  # the example spells out the defaults
    assert dpo.to_trl().loss_type == ["sigmoid"]


def test_trl_checks_and_overrides(tmp_path):
    config = GRPOTrainingConfig(
        model="m", dataset="d", output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=4
    )
    with pytest.raises(ValueError, match="divisible by num_generations"):
        config.to_trl()
    config = GRPOTrainingConfig(
        model="m",
        dataset="d",
        output_dir=str(tmp_path),
        num_generations=4,
        trl_overrides={"use_adaptive_entropy": True, "entropy_target": 0.3},
    )
    args = config.to_trl()
    assert args.use_adaptive_entropy is True and args.entropy_target == 0.3
    config.trl_overrides = {"no_such_option": 1}
    with pytest.raises(ValueError, match="no_such_option"):
        config.to_trl()
