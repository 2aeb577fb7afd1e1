"""`--config` takes a preset's name (a YAML shipped in the package) as well as a path (issue 38)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ermedrag.training.config import DPOTrainingConfig, GRPOTrainingConfig, load_config, presets

REPO = Path(__file__).resolve().parents[2]


def test_presets_are_the_shipped_yaml_files():
    assert presets() == sorted(p.stem for p in (REPO / "training/configs").glob("*.yaml"))
    assert {"dpo_extractor", "grpo_respondent", "med_r3", "mmedagent"} <= set(presets())


def test_a_preset_by_name_loads_the_same_config_as_its_path():
    by_path = load_config(REPO / "training/configs/dpo_extractor.yaml", DPOTrainingConfig)
    assert load_config("dpo_extractor", DPOTrainingConfig) == by_path
    assert load_config("dpo_extractor.yaml", DPOTrainingConfig) == by_path


def test_a_preset_loads_from_a_directory_outside_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = load_config(REPO / "training/configs/grpo_respondent.yaml", GRPOTrainingConfig)
    assert load_config("grpo_respondent", GRPOTrainingConfig) == expected
    # The repository path the docs show names the preset too where there is no such file.
    assert load_config("training/configs/grpo_respondent.yaml", GRPOTrainingConfig) == expected


def test_a_file_wins_over_a_preset_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dpo_extractor").write_text("model: m\ndataset: d\noutput_dir: o\nbeta: 0.3\n")
    assert load_config("dpo_extractor", DPOTrainingConfig).beta == 0.3
    path = tmp_path / "mine.yaml"
    path.write_text("model: m\ndataset: d\noutput_dir: o\n")
    assert load_config(path, DPOTrainingConfig).model == "m"


@pytest.mark.parametrize("spec", ["dpo_extractr", "elsewhere/dpo_extractor.yaml", "absent.yaml"])
def test_neither_a_file_nor_a_preset_is_one_error_listing_the_presets(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_config(spec, DPOTrainingConfig)
    message = str(err.value)
    assert message.startswith(f"training config not found: {spec} is neither a file nor a preset")
    assert "presets: dpo_extractor, grpo_respondent, med_r3, mmedagent" in message
