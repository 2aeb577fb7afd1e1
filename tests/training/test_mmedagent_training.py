"""MMedAgent-RL training: the triage labels' mapping table, the export from runs of the real graph (scripted
panel, ermedrag/testing/scripted/panel.py), the triage rewards, the stage schedule (γ and β per stage), TRL's entropy bonus
as the stages configure it (it changes the loss by exactly γ·mean entropy, and the gradient), and the four stages
on a tiny random model, chained through LoRA merges."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from ermedrag.agents import triage
from ermedrag.agents.base import to_chat
from ermedrag.graphs.mmedagent.graph import graph
from ermedrag.tools.data.benchmarks import Question
from ermedrag.tools.records.traces import TraceStore
from ermedrag.training.mmedagent.config import MMedAgentTrainingConfig
from ermedrag.training.config import SFTTrainingConfig, load_config
from ermedrag.training.mmedagent.train import (
    STAGES,
    parse_stages,
    stage_config,
    stage_rewards,
    train_mmedagent,
)
from ermedrag.training.rewards.answers import correctness_reward, format_reward
from ermedrag.training.rewards.triage import (
    triage_correctness_reward,
    triage_format_reward,
    well_formed_triage_correctness_reward,
)
from ermedrag.tools.data.specialties import (
    MEDMCQA_SUBJECT_SPECIALTY,
    MEDXPERTQA_BODY_SYSTEM_SPECIALTY,
    MMLU_SUBJECT_SPECIALTY,
    gold_specialty_for,
)

REPO = Path(__file__).resolve().parents[2]
PANEL = "scripted:ermedrag.testing.scripted.panel"
OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Sulfonylurea", "D": "Acarbose"}


def question(benchmark: str, subject: str = "", **meta) -> Question:
    return Question(id="q", question="?", options=OPTIONS, answer="A", benchmark=benchmark, subject=subject, meta=meta)


# ------------------------------------------------------------------------------------------- mapping table


def test_mapping_table_maps_known_subjects_and_never_guesses():
    assert gold_specialty_for(question("medmcqa", "Pathology")) == "Pathologist"
    assert gold_specialty_for(question("medmcqa_dev", "Radiology")) == "Radiologist"  # a file stem names it too
    assert gold_specialty_for(question("medmcqa", "surgery")) == "Surgeon"
    assert gold_specialty_for(question("medmcqa", "Ophthalmology")) == "Ophthalmologist"
    assert gold_specialty_for(question("medmcqa", "Skin")) == "Dermatologist"
    assert gold_specialty_for(question("medmcqa", "Dental")) is None  # a subject with no specialty of the list
    assert gold_specialty_for(question("medmcqa", "Dermatology")) is None  # unknown spelling: not guessed
    assert gold_specialty_for(question("medmcqa", "")) is None
    assert gold_specialty_for(question("medxpertqa", "Diagnosis", body_system="Endocrine")) == "Endocrinologist"
    assert gold_specialty_for(question("medxpertqa_text_test", body_system="Integumentary")) == "Dermatologist"
    assert gold_specialty_for(question("medxpertqa", body_system="Nervous")) is None
    assert gold_specialty_for(question("mmlu_med", "anatomy")) is None
    assert gold_specialty_for(question("medqa", "Pathology")) is None  # no table for MedQA
    assert gold_specialty_for(question("mmlu_pro", "health")) is None
    assert gold_specialty_for(question("my_file", "Pathology", source="MedMCQA")) == "Pathologist"  # by source
    assert gold_specialty_for({"benchmark": "medmcqa", "subject": "Surgery"}) == "Surgeon"  # a plain dict
    assert gold_specialty_for({"benchmark": "medmcqa", "subject": "x" * 10_000}) is None


def test_every_subject_in_the_shared_files_is_in_a_table(shared_data):
    """A value the shared files carry is in its table (mapped or explicitly None): none falls through unseen."""
    tables = {
        "medmcqa_dev.jsonl": ("subject", MEDMCQA_SUBJECT_SPECIALTY),
        "medxpertqa_text_test.jsonl": ("body_system", MEDXPERTQA_BODY_SYSTEM_SPECIALTY),
        "mmlu_med_test.jsonl": ("subject", MMLU_SUBJECT_SPECIALTY),
    }
    for name, (field_name, table) in tables.items():
        values = {json.loads(line).get(field_name) for line in (shared_data / "benchmarks" / name).open()}
        assert values and values <= set(table), (name, sorted(values - set(table)))


# -------------------------------------------------------------------------------------------- export

# (question, gold, benchmark label (file, field, value) or None, context, extra input)
RUNS = [
    ("Which stain shows amyloid? #answers=A,A,A", "A", ("medmcqa_dev", "subject", "Pathology"), {}, {}),
    ("Which tooth erupts first? #answers=A,B,B", "A", ("medmcqa_dev", "subject", "Dental"), {}, {}),
    ("An unlabelled question #answers=B,B,B", "A", None, {}, {}),
    ("Thyroid storm drug? #answers=B,A,A", "B", ("medxpertqa_text_test", "body_system", "Endocrine"), {}, {}),
    ("Appendicitis next step? #answers=C,C,C", "A", None, {}, {"gold_specialty": "surgeon"}),
    (
        "Silvery plaques on elbows? #answers=A,A,A",
        "A",
        ("medmcqa_dev", "subject", "Skin"),
        {"specialties": "Radiologist, Surgeon"},
        {},
    ),
    (
        "Oracle triage question #answers=A",
        "A",
        ("medmcqa_dev", "subject", "Pathology"),
        {"triage_mode": "oracle"},
        {"gold_specialty": "Pathologist"},
    ),
    ("A question without gold #answers=A", None, None, {}, {}),
]


def write_benchmarks(folder: Path) -> None:
    """The runs' questions as benchmark rows, with options in another order (an eval may permute them)."""
    folder.mkdir(parents=True)
    files: dict[str, list[str]] = {"medmcqa_dev": [], "medxpertqa_text_test": []}
    reversed_options = dict(zip("ABCD", reversed(OPTIONS.values())))
    for i, (text, _, label, _, _) in enumerate(RUNS):
        if label:
            name, field_name, value = label
            files[name].append(
                json.dumps(
                    {
                        "id": f"q{i}",
                        "question": f"  {text} ",
                        "options": reversed_options,
                        "answer": "A",
                        "source": name,
                        field_name: value,
                    }
                )
            )
    for name, rows in files.items():
        (folder / f"{name}.jsonl").write_text("\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    """The RUNS answered by the real graph with the scripted panel, and their export through the CLI."""
    from ermedrag import cli

    root = tmp_path_factory.mktemp("mmedagent")
    traces = root / "traces.sqlite"
    for text, gold, _, context, extra in RUNS:
        graph.invoke(
            {"question": text, "options": OPTIONS, "gold": gold, **extra},
            context={"respondent_model": PANEL, "trace_db": str(traces), **context},
        )
    write_benchmarks(root / "data" / "benchmarks")
    assert (
        cli.main(
            [
                "export",
                "mmedagent",
                "--trace-db",
                str(traces),
                "--data",
                str(root / "data"),
                "--out",
                str(root / "export"),
            ]
        )
        == 0
    )
    return {"traces": traces, "export": root / "export", "data": root / "data"}


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "data.jsonl").read_text().splitlines()]


def test_export_writes_triage_rows_only_with_a_gold_specialty(recorded):
    store = TraceStore(recorded["traces"])
    triage = {r["question"]: r for r in rows(recorded["export"] / "triage")}
    assert {q: r["gold_specialty"] for q, r in triage.items()} == {
        RUNS[0][0]: "Pathologist",
        RUNS[3][0]: "Endocrinologist",
        RUNS[4][0]: "Surgeon",
    }
    assert triage[RUNS[4][0]]["label_source"] == "input gold_specialty"
    assert "subject 'Pathology'" in triage[RUNS[0][0]]["label_source"]
    for row in triage.values():  # the exact messages the graph sent the triage doctor
        (event,) = store.events(run_id=row["run_id"], agent="triage")
        assert row["prompt"] == to_chat(event["messages"]) and row["event_id"] == event["event_id"]
        assert row["specialties"] == event["inputs"]["specialties"]
    from datasets import load_from_disk

    assert len(load_from_disk(str(recorded["export"] / "triage" / "dataset"))) == 3


def test_each_triage_row_carries_a_reference_reply_that_reads_back_as_its_gold(recorded):
    """The SFT warm start's target: a well-formed reply naming the gold specialty as the run listed it."""
    for row in rows(recorded["export"] / "triage"):
        parsed = triage.parse_triage(row["reference_reply"], row["specialties"], fallback="(none)")
        assert parsed["ok"] and parsed["well_formed"] and parsed["specialty"] == row["gold_specialty"]
        columns = {"gold_specialty": [row["gold_specialty"]], "specialties": [row["specialties"]]}
        completion = [[{"role": "assistant", "content": row["reference_reply"]}]]
        assert triage_correctness_reward(completion, **columns) == triage_format_reward(completion, **columns) == [1.0]


def test_export_puts_attending_prompts_with_frozen_opinions_in_their_bucket(recorded):
    store = TraceStore(recorded["traces"])
    by_bucket = {b: {r["question"]: r for r in rows(recorded["export"] / b)} for b in ("easy", "medium", "hard")}
    assert {b: sorted(qs) for b, qs in by_bucket.items()} == {
        "easy": sorted([RUNS[0][0], RUNS[5][0], RUNS[6][0]]),
        "medium": sorted([RUNS[1][0], RUNS[3][0]]),
        "hard": sorted([RUNS[2][0], RUNS[4][0]]),
    }
    thyroid = by_bucket["medium"][RUNS[3][0]]
    assert thyroid["agreement"] == pytest.approx(1 / 3) and thyroid["gold"] == "B"
    assert thyroid["options"] == OPTIONS and thyroid["bucket"] == "medium"
    assert sorted(thyroid["specialist_answers"]) == ["A", "A", "B"]
    for bucket, found in by_bucket.items():
        for row in found.values():
            (event,) = store.events(run_id=row["run_id"], agent="attending")
            assert row["prompt"] == to_chat(event["messages"]) and row["bucket"] == bucket
            case = row["prompt"][-1]["content"]  # the real case (the worked example comes before it)
            opinions = re.findall(r"^Specialist \d+ \(([^)]+)\): answer (\S+) — ", case, re.MULTILINE)
            assert sorted(opinions) == sorted((row["specialty"], a) for a in row["specialist_answers"])


def test_each_attending_row_carries_a_reference_reply_and_every_bucket_is_in_one_sft_dataset(recorded):
    """The attending's SFT warm start: a reply that scores full marks (its gold answer, well formed), naming the
    specialists who gave it; the buckets' rows together in attending/, what the sft_attending preset reads."""
    from datasets import load_from_disk

    bucketed = [row for b in ("easy", "medium", "hard") for row in rows(recorded["export"] / b)]
    together = rows(recorded["export"] / "attending")
    assert sorted(r["run_id"] for r in together) == sorted(r["run_id"] for r in bucketed)
    assert len(load_from_disk(str(recorded["export"] / "attending" / "dataset"))) == len(bucketed)
    for row in together:
        completion = [[{"role": "assistant", "content": row["reference_reply"]}]]
        columns = {"gold": [row["gold"]], "options": [row["options"]]}
        assert correctness_reward(completion, **columns) == format_reward(completion, **columns) == [1.0]
        right = [str(i) for i, a in enumerate(row["specialist_answers"], 1) if a == row["gold"]]
        named = re.findall(r"\d", row["reference_reply"].split("</think>")[0])
        assert named == [*right, *right]  # "Specialists 1 and 3 are right; I agree with 1 and 3", or none named
    assert load_config("sft_attending", SFTTrainingConfig).dataset.endswith("export/attending/dataset")


def test_export_summary_counts_what_was_left_out_and_reruns_idempotently(recorded, capsys):
    from ermedrag import cli

    argv = [
        "export",
        "mmedagent",
        "--trace-db",
        str(recorded["traces"]),
        "--data",
        str(recorded["data"]),
        "--out",
        str(recorded["export"]),
    ]
    assert cli.main(argv) == 0
    line = capsys.readouterr().out
    assert (
        "8 finished runs → triage 3 rows (5 left out: 3 no gold specialty, 1 no triage event, "
        "1 not in specialties; labels: the runs' gold_specialty and 4 benchmark questions)" in line
    )
    assert "attending easy 3, medium 2, hard 2 (1 without a bucket: no gold answer)" in line
    assert len(rows(recorded["export"] / "triage")) == 3  # nothing doubled by the rerun


# ------------------------------------------------------------------------------------------- rewards


def test_triage_rewards_paper_and_gated():
    good = "<think>Biopsy.</think><answer>Pathologist</answer>"
    sloppy = "Pathologist, I think. <answer>a pathologist</answer>"
    wrong = "<think>X-ray.</think><answer>Radiologist</answer>"
    completions = [[{"role": "assistant", "content": t}] for t in (good, sloppy, wrong, "", "x" * 300_000)]
    columns = {"gold_specialty": ["pathologist"] * 5, "specialties": [["Pathologist", "Radiologist"]] * 5}
    assert triage_correctness_reward(completions, **columns) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert well_formed_triage_correctness_reward(completions, **columns) == [1.0, 0.0, 0.0, 0.0, 0.0]
    # a gold specialty outside the row's list, or missing columns, is never a hit
    outside = triage_correctness_reward(completions[:1], gold_specialty=["Surgeon"], specialties=[["Pathologist"]])
    assert outside == [0.0]
    assert triage_correctness_reward(completions[:1]) == [0.0]
    assert triage_correctness_reward(completions[:1], gold_specialty=[None], specialties=["Pathologist"]) == [0.0]


def test_triage_format_needs_an_answer_naming_a_listed_specialty():
    """Tags around the worked example's specialty (listed nowhere) are not a triage: no format reward for copying."""
    copied = "<think>Chest pain.</think><answer>Cardiologist</answer>"
    wrong = "<think>X-ray.</think><answer>Radiologist</answer>"
    untagged = "Radiologist"
    completions = [[{"role": "assistant", "content": t}] for t in (copied, wrong, untagged, "", "<answer>" * 50_000)]
    columns = {"gold_specialty": ["Pathologist"] * 5, "specialties": [["Pathologist", "Radiologist"]] * 5}
    assert triage_format_reward(completions, **columns) == [0.0, 1.0, 0.0, 0.0, 0.0]  # a wrong triage is still one
    assert format_reward(completions[:2]) == [1.0, 1.0]  # the tags alone cannot tell them apart
    assert triage_format_reward(completions[:2], specialties=[None, "Radiologist"]) == [0.0, 0.0]  # no list: none


# ------------------------------------------------------------------------------------------- schedule


def config(tmp_path: Path, **fields) -> MMedAgentTrainingConfig:
    return MMedAgentTrainingConfig(
        **{
            "model": "m",
            "dataset": str(tmp_path / "export"),
            "output_dir": str(tmp_path / "out"),
            "num_generations": 4,
            **fields,
        }
    )


def test_stage_schedule_sets_gamma_and_beta_per_stage(tmp_path):
    example = load_config(REPO / "training/configs/mmedagent.yaml", MMedAgentTrainingConfig)
    example.output_dir = str(tmp_path / "out")
    got = {n: (stage_config(example, n).to_trl().entropy_coef, stage_config(example, n).to_trl().beta) for n in STAGES}
    assert got == {
        "triage": (0.0, 1e-3),
        "easy": (1e-4, 1e-3),
        "medium": (5e-3, 4e-3),
        "hard": (3e-2, 1e-2),
        "attending": (5e-3, 4e-3),
    }
    assert stage_config(example, "triage").max_completion_length == 128  # the example's triage override
    assert stage_config(example, "easy").dataset == str(Path(example.dataset) / "easy" / "dataset")
    assert stage_config(example, "hard").output_dir == str(tmp_path / "out" / "hard")
    assert stage_config(example, "easy").to_trl().num_generations == 8
    with pytest.raises(ValueError, match=r"resume: true is for one training .*--stages"):
        stage_config(config(tmp_path, resume=True), "easy")

    # per stage, for every stage, or none at all
    tuned = config(tmp_path, beta=0.02, stage_overrides={"hard": {"entropy_coef": "1e-1", "beta": 0}})
    assert [(s.entropy_coef, s.beta) for s in (stage_config(tuned, "medium"), stage_config(tuned, "hard"))] == [
        (5e-3, 0.02),
        (0.1, 0.0),
    ]
    no_bonus = config(tmp_path, entropy_bonus=False)
    assert {stage_config(no_bonus, n).to_trl().entropy_coef for n in STAGES} == {0.0}
    with pytest.raises(ValueError, match="entropy_bonus: false"):
        stage_config(config(tmp_path, entropy_bonus=False, stage_overrides={"hard": {"entropy_coef": 0.1}}), "hard")
    adaptive = stage_config(config(tmp_path, adaptive_entropy=True, entropy_target=0.5), "hard").to_trl()
    assert (adaptive.use_adaptive_entropy, adaptive.entropy_target, adaptive.entropy_coef) == (True, 0.5, 3e-2)

    # rewards: the paper's or the gated ones, by role
    names = lambda c, n: {r.name: r.weight for r in stage_rewards(stage_config(c, n), n)}
    assert names(config(tmp_path), "triage") == {"triage_correctness_ungated": 1.0, "triage_format": 0.5}
    assert names(config(tmp_path), "hard") == {"correctness_ungated": 1.0, "format": 0.5}
    assert names(config(tmp_path, reward="gated"), "easy") == {"correctness": 1.0, "format": 0.5}
    assert names(config(tmp_path, reward="gated"), "triage") == {"triage_correctness": 1.0, "triage_format": 0.5}

    for bad, match in (
        ({"reward": "other"}, "paper, gated"),
        ({"rewards": {"format": 1}}, "per stage"),
        ({"trl_overrides": {"entropy_coef": 0.1}}, "may not set"),
        ({"stage_overrides": {"hard": {"model": "x"}}}, "may not set"),
        ({"stage_overrides": {"4": {}}}, "unknown stage"),
        ({"stage_overrides": {"triage": {"rewards": {"correctness": 1}}}}, "unknown reward"),
    ):
        with pytest.raises(ValueError, match=match):
            stage_config(config(tmp_path, **bad), "hard" if "triage" not in str(bad) else "triage").to_trl()


def test_stage_lists_follow_the_curriculum_switch(tmp_path):
    curriculum, flat = config(tmp_path), config(tmp_path, curriculum=False)
    assert parse_stages(curriculum, None) == ["triage", "easy", "medium", "hard"]
    assert parse_stages(curriculum, "hard,medium") == ["medium", "hard"]
    assert parse_stages(flat, None) == ["triage", "attending"]
    assert stage_config(flat, "attending").dataset == str(tmp_path / "out" / "attending" / "train_dataset")
    for conf, stages, match in (
        (curriculum, "easy,hard", "consecutive"),
        (curriculum, "attending", "curriculum"),
        (flat, "easy", "curriculum: false"),
        (curriculum, "", "among"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_stages(conf, stages)
    with pytest.raises(FileNotFoundError, match="export the runs first"):
        train_mmedagent(curriculum, stages="triage")


def test_cli_train_dispatches_mmedagent(monkeypatch):
    import ermedrag.training.mmedagent.train
    from ermedrag import cli

    seen = {}
    monkeypatch.setattr(
        ermedrag.training.mmedagent.train,
        "train_mmedagent",
        lambda config, stages: seen.update(config=config, stages=stages) or {},
    )
    assert cli.main(["train", "mmedagent", "--config", "x.yaml", "--stages", "triage,easy"]) == 0
    assert seen == {"config": "x.yaml", "stages": "triage,easy"}
    assert cli.main(["train", "mmedagent", "--config", "x.yaml"]) == 0 and seen["stages"] is None


# ------------------------------------------------------------------------------- training (tiny model)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models run faster on one thread (`tests.conftest.one_torch_thread`)."""


def tiny_config(model: str, dataset: Path, output_dir: Path, **fields) -> MMedAgentTrainingConfig:
    base = {
        "model": model,
        "dataset": str(dataset),
        "output_dir": str(output_dir),
        "learning_rate": 1e-3,
        "max_steps": 1,
        "lora_r": 8,
        "lora_alpha": 16,
        "logging_steps": 1,
        "save_steps": 1000,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 12,
    }
    return MMedAgentTrainingConfig(**{**base, **fields})


def batch(tokenizer, prompt: str, completions: list[str]) -> dict[str, torch.Tensor]:
    """A GRPO batch as `_generate_and_score_completions` hands it to the loss: one prompt, right-padded
    completions, advantages of both signs."""
    prompt_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]] * len(completions))
    encoded = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    width = max(map(len, encoded))
    completion_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in encoded])
    completion_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in encoded])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -1.0]),
        "num_items_in_batch": completion_mask.sum(),
    }


def mean_entropy(model, inputs) -> float:
    """H̄ computed here, independently of TRL: the mean entropy of the next-token distribution over the
    completion tokens."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, inputs["prompt_ids"].size(1) - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    keep = inputs["completion_mask"].float()
    return float((entropy * keep).sum() / keep.sum())


def loss_and_grads(staged: MMedAgentTrainingConfig, stage: str) -> tuple[float, dict[str, torch.Tensor], float, float]:
    from ermedrag.training.trainers import build_grpo_trainer

    trainer, _ = build_grpo_trainer(staged, stage_rewards(staged, stage))
    trainer.model.eval()  # no dropout, no accumulation scaling: the loss is a pure function of the batch
    inputs = batch(
        trainer.processing_class,
        "<|im_start|>user\nWhich drug first?<|im_end|>\n<|im_start|>assistant\n",
        ["<think>Metformin lowers glucose.</think><answer>A</answer>", "<think>Insulin.</think><answer>B"],
    )
    with torch.no_grad():  # the reference (β > 0): the start model, i.e. this policy before any step
        inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].size(1),
        )
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, mean_entropy(trainer.model, inputs), trainer.entropy_coef


def test_entropy_bonus_changes_the_loss_by_gamma_times_entropy(tiny_model, tmp_path):
    """The hard stage as configured (γ = 3e-2, β = 1e-2) against the same stage with entropy_bonus: false: the same
    start model (LoRA starts as the identity), so the loss differs by exactly γ·H̄ and the gradient differs."""
    with_bonus = stage_config(tiny_config(tiny_model, tmp_path / "d", tmp_path / "a"), "hard")
    without = stage_config(tiny_config(tiny_model, tmp_path / "d", tmp_path / "b", entropy_bonus=False), "hard")
    from datasets import Dataset

    for staged in (with_bonus, without):  # a one-row dataset: the trainer needs one to build
        Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}], "gold": "A"}]).save_to_disk(staged.dataset)
    loss, grads, entropy, gamma = loss_and_grads(with_bonus, "hard")
    loss0, grads0, entropy0, gamma0 = loss_and_grads(without, "hard")
    assert (gamma, gamma0) == (3e-2, 0.0) and entropy == pytest.approx(entropy0) and entropy > 0
    assert loss0 - loss == pytest.approx(gamma * entropy, rel=1e-4)
    assert grads.keys() == grads0.keys() and grads
    assert any(not torch.allclose(grads[n], grads0[n]) for n in grads)


def test_four_stages_chain_end_to_end(recorded, tiny_model, tmp_path):
    """Export of scripted runs → triage, easy, medium, hard on the tiny model, one step each (about 12 s on one
    thread); then the hard stage rerun alone from medium's model."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    conf = tiny_config(tiny_model, recorded["export"], out)
    with pytest.raises(FileNotFoundError, match="run stage medium first"):
        train_mmedagent(conf, stages="hard")
    result = train_mmedagent(conf, stages="triage,easy,medium,hard")
    stages = result["stages"]
    assert stages["triage"]["start_model"] == stages["easy"]["start_model"] == tiny_model
    assert stages["medium"]["start_model"] == str(out / "easy" / "merged")
    assert stages["hard"]["start_model"] == str(out / "medium" / "merged")
    assert result["triage_model"] == str(out / "triage" / "merged")
    assert result["attending_model"] == str(out / "hard" / "merged")
    assert stages["triage"]["reward_functions"] == ["triage_correctness_reward", "triage_format_reward"]
    assert stages["hard"]["reward_functions"] == ["correctness_reward", "format_reward"]
    first_steps = {}
    for name, gamma in (("triage", 0.0), ("easy", 1e-4), ("medium", 5e-3), ("hard", 3e-2)):
        steps = [r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        first_steps[name] = steps[0]
        assert len(steps) == 1 and math.isfinite(steps[0]["loss"]) and "entropy" in steps[0]
        assert stages[name]["entropy_coef"] == gamma
        record = json.loads((out / name / "mmedagent_stage.json").read_text())
        assert record["entropy_coef"] == gamma and record["beta"] == STAGES[name].beta
        AutoModelForCausalLM.from_pretrained(out / name / "merged")
    hard_step = first_steps["hard"]
    # TRL applied the stage's γ, or 0 on a step without a reward signal (`entropy_bonus_on_silent_steps`: false)
    assert hard_step["entropy_coef"] == (0.0 if hard_step["entropy_bonus_held"] else 3e-2)

    rerun = train_mmedagent(conf, stages=["hard"])
    assert rerun["stages"]["hard"]["start_model"] == str(out / "medium" / "merged")
    summary = json.loads((out / "mmedagent_summary.json").read_text())
    assert sorted(summary["stages"]) == ["easy", "hard", "medium", "triage"]
    assert summary["triage_model"] == str(out / "triage" / "merged")  # kept from the earlier run


def test_the_triage_warm_starts_with_sft_then_its_grpo_stage_goes_on_from_it(recorded, tiny_model, tmp_path):
    """What a user runs: `ermedrag train sft` on the export's triage/ (its reference replies), then the triage's
    GRPO stage from the merged warm start while the attending's curriculum starts from the base model."""
    from ermedrag.cli import main

    sft = tmp_path / "sft_triage.yaml"
    sft.write_text(
        f"model: {tiny_model}\ndataset: {recorded['export'] / 'triage' / 'dataset'}\noutput_dir: {tmp_path / 'sft'}\n"
        "max_steps: 1\nper_device_train_batch_size: 2\nlora_r: 8\nlora_alpha: 16\n"
    )
    assert main(["train", "sft", "--config", str(sft)]) == 0
    warm = tmp_path / "sft" / "merged"
    conf = tiny_config(str(warm), recorded["export"], tmp_path / "run", attending_start=tiny_model)
    stages = train_mmedagent(conf, stages="triage,easy")["stages"]
    assert stages["triage"]["start_model"] == str(warm) and stages["easy"]["start_model"] == tiny_model


def test_no_curriculum_ablation_trains_one_stage_on_every_bucket(recorded, tiny_model, tmp_path):
    conf = tiny_config(tiny_model, recorded["export"], tmp_path / "run")
    flat = dataclasses.replace(conf, curriculum=False, output_dir=str(tmp_path / "flat"))
    single = train_mmedagent(flat, stages="attending")["stages"]["attending"]
    assert single["start_model"] == tiny_model
    from datasets import load_from_disk

    combined = load_from_disk(single["dataset"])
    assert len(combined) == 7 and set(combined["bucket"]) == {"easy", "medium", "hard"}  # every bucket's rows
    assert single["entropy_coef"] == 5e-3 and single["beta"] == 4e-3
