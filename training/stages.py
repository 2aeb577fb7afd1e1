"""What staged trainers share (Med-R³'s three stages, MMedAgent-RL's triage → easy → medium → hard): a stage
folds its LoRA adapter into a merged model and records where it is; the next stage starts from that record."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path


def merge_adapter(adapter_dir: Path, merged_dir: Path, dtype: str) -> None:
    """Fold the stage's LoRA adapter into its base weights; save model and tokenizer to `merged_dir`."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=dtype)
    merged = model.merge_and_unload()
    if merged_dir.exists():
        shutil.rmtree(merged_dir)
    merged.save_pretrained(str(merged_dir))
    AutoTokenizer.from_pretrained(str(adapter_dir)).save_pretrained(str(merged_dir))
    del model, merged
    gc.collect()


def recorded_stage_model(record: Path, stage: str, previous: str) -> str:
    """The merged model `previous` recorded in `record`, where `stage` starts; an error that says which stage
    to run first when the record or its model is missing."""
    if not record.is_file():
        raise FileNotFoundError(f"stage {stage} starts from stage {previous}'s model, but {record} does not exist: "
                                f"run stage {previous} first (--stages {previous},{stage})")
    model_dir = json.loads(record.read_text(encoding="utf-8"))["model_dir"]
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"stage {previous}'s model {model_dir} (from {record}) is missing: rerun stage "
                                f"{previous}")
    return model_dir
