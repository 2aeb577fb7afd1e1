"""What staged trainers share (Med-R³'s three stages, MMedAgent-RL's triage → easy → medium → hard): a stage
folds its LoRA adapter into a merged model and records where it is; the next stage starts from that record."""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path
from typing import Any

MERGED_DIR = "merged"


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


def refuse_resume(staged: Any) -> None:
    """`resume` goes on with one training. A staged run rerun with it would also go on with its finished stages
    from their last checkpoints, merge them again, and start the next stage's checkpoints on a changed model."""
    if staged.resume:
        raise ValueError(
            "resume: true is for one training (ermedrag train dpo|grpo); rerun a staged run from the "
            "stage that stopped instead (--stages with that stage and the ones after it)"
        )


def recorded_stage_model(record: Path, stage: str, previous: str) -> str:
    """The merged model `previous` recorded in `record`, where `stage` starts; an error that says which stage
    to run first when the record or its model is missing."""
    if not record.is_file():
        raise FileNotFoundError(
            f"stage {stage} starts from stage {previous}'s model, but {record} does not exist: "
            f"run stage {previous} first (--stages {previous},{stage})"
        )
    model_dir = json.loads(record.read_text(encoding="utf-8"))["model_dir"]
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(
            f"stage {previous}'s model {model_dir} (from {record}) is missing: rerun stage {previous}"
        )
    return model_dir


def stage_model(staged: Any, process: Any) -> tuple[Path, Path]:
    """After a stage trained: its output folder and the model the next stage starts from (with LoRA, the adapter
    merged into `OUTPUT/merged/` by the main process while the others wait)."""
    output_dir = Path(staged.output_dir)
    if not staged.use_lora:
        return output_dir, output_dir
    model_dir = output_dir / MERGED_DIR
    if process.is_main_process:
        merge_adapter(output_dir, model_dir, staged.resolved_dtype())
    process.wait_for_everyone()
    return output_dir, model_dir


def write_stage_record(path: Path, summary: dict[str, Any], keys: tuple[str, ...], process: Any) -> None:
    """The stage's record (`keys` of its summary, and when it finished), written once, by the main process."""
    if process.is_main_process:
        record = {key: summary[key] for key in keys}
        path.write_text(json.dumps({**record, "finished_at": time.time()}, indent=2), encoding="utf-8")
