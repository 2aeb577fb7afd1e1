"""GRPO throughput on one GPU: the project's respondent GRPO loop on a randomly initialised Qwen2-style model.

Nothing is downloaded: the tokenizer is the offline byte-level BPE of ermedrag/testing.py (with its ChatML
template), the model is built from a config (random weights) and saved to a work folder so that TRL loads it
by path exactly as `training.trainers.train_grpo` does in real runs, and the prompts are synthetic respondent
prompts (`agents.respondent.build_messages`, made-up questions, options and evidence triplets, gold letters).
Training is `train_grpo` with the respondent's rewards (`training.rewards`, `rewards` unset); precision is the
project's automatic choice (bf16 on CUDA).

Reports wall time per optimizer step, time spent generating, generated tokens per second, peak GPU memory and
the device, as JSON on stdout and in `--out` (default benches/results/gpu_grpo.json on CUDA; CPU runs go to a
temporary file so that no CPU figure is taken for a GPU one). See benches/gpu/README.md.

    python3 benches/gpu/grpo_gpu.py --size medium --steps 20             # on the GPU machine
    .venv/bin/python benches/gpu/grpo_gpu.py --allow-cpu --size tiny --steps 2   # check the script here

With a random model almost every completion runs to --max-completion-length (EOS is one token among the
vocabulary) and the rewards are near zero: the figures are throughput, not learning.
"""

from __future__ import annotations

import time

STARTED = time.time()  # the --max-minutes budget counts from here, imports included

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from ermedrag.offline import go_offline  # noqa: E402
from ermedrag.tools.machine import cpu_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
go_offline()  # no network on the GPU machine: never let a library wait on a hub or a tracer

import torch  # noqa: E402

DEFAULT_OUT = REPO / "benches" / "results" / "gpu_grpo.json"
CPU_OUT = Path(tempfile.gettempdir()) / "gpu_grpo_cpu.json"
QWEN2_VOCAB = 151936  # Qwen2/2.5's embedding rows: gives the LM head and the log-prob pass their real cost

# Qwen2-style shapes. `vocab_size: None` = the offline tokenizer's own size (~780).
SIZES: dict[str, dict[str, Any]] = {
    # ermedrag/testing.py's model: for checking the script on CPU
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=None,
    ),
    # ~192M parameters with the Qwen2 vocabulary (~75M without the tied embedding)
    "small": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=QWEN2_VOCAB,
    ),
    # Qwen2.5-0.5B's shape: ~494M parameters (~358M without the tied embedding)
    "medium": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=QWEN2_VOCAB,
    ),
}


def log(message: str) -> None:
    print(f"[grpo_gpu {time.time() - STARTED:7.1f}s] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model shape (see SIZES)")
    p.add_argument(
        "--steps", type=int, default=20, help="optimizer steps (upper bound; --max-minutes may stop earlier)"
    )
    p.add_argument(
        "--prompts-per-step",
        type=int,
        default=8,
        help="prompts per step; completions per step = this x --num-generations (1 on CPU)",
    )
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-completion-length", type=int, default=256, help="max new tokens per completion")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="rows in the synthetic dataset (default: max(64, prompts-per-step x steps))",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="model vocabulary rows (default: the size's; 0 = the tokenizer's own; ids past the "
        "tokenizer decode to nothing)",
    )
    p.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter (r 16, all-linear) instead of the full model"
    )
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 loads a reference model from the path)")
    p.add_argument("--learning-rate", type=float, default=None, help="default 1e-6 full, 1e-5 LoRA")
    p.add_argument(
        "--gradient-checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto = the project's default (on with CUDA)",
    )
    p.add_argument(
        "--vllm",
        choices=("colocate",),
        default=None,
        help="generate with vLLM in this process (needs vllm installed; off by default)",
    )
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=9.0,
        help="wall-clock budget from start to the JSON: training stops early when the next step would not fit",
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON summary path (default {DEFAULT_OUT.relative_to(REPO)} on CUDA, {CPU_OUT} on CPU)",
    )
    p.add_argument("--work-dir", type=Path, default=None, help="model, dataset and run folder (default: a temp dir)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder (metrics.jsonl, curves.png)")
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA, run a smoke check on CPU (forces --size tiny, at most 2 steps)",
    )
    return p.parse_args(argv)


# --- model and data ---------------------------------------------------------------------------------------


def build_model(directory: Path, size: str, vocab_size: int | None, *, on_cuda: bool, seed: int) -> dict[str, Any]:
    """Write the offline tokenizer and a random Qwen2 causal LM (bf16 on CUDA) to `directory`."""
    from transformers import Qwen2ForCausalLM

    from ermedrag.testing.tiny_model import build_tokenizer, qwen2_for

    tokenizer = build_tokenizer()
    shape = dict(SIZES[size])
    preset_vocab = shape.pop("vocab_size")
    # None: the size's preset; 0: the tokenizer's own size
    vocab = (preset_vocab if vocab_size is None else vocab_size) or len(tokenizer)
    if vocab < len(tokenizer):
        raise SystemExit(f"--vocab-size {vocab} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config, generation = qwen2_for(tokenizer, vocab_size=vocab, max_position_embeddings=4096, **shape)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    torch.manual_seed(seed)
    with torch.device("cuda" if on_cuda else "cpu"):
        model = Qwen2ForCausalLM(config)
    model.to(dtype)
    model.generation_config = generation
    total = sum(p.numel() for p in model.parameters())  # the tied head counts once
    embedding = model.get_input_embeddings().weight.numel()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    if on_cuda:
        torch.cuda.empty_cache()
    return {
        "size": size,
        "architecture": "Qwen2ForCausalLM (random init)",
        "parameters": total,
        "non_embedding_parameters": total - embedding,
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "layers": shape["num_hidden_layers"],
        "attention_heads": shape["num_attention_heads"],
        "kv_heads": shape["num_key_value_heads"],
        "vocab_size": vocab,
        "tokenizer_tokens": len(tokenizer),
        "saved_dtype": str(dtype).removeprefix("torch."),
    }


_CONDITIONS = [
    "community-acquired pneumonia",
    "type 2 diabetes",
    "atrial fibrillation",
    "hypothyroidism",
    "migraine",
    "gout flare",
    "iron deficiency anaemia",
    "peptic ulcer disease",
    "asthma exacerbation",
    "heart failure",
    "urinary tract infection",
    "hypertension",
    "deep vein thrombosis",
    "rheumatoid arthritis",
    "epilepsy",
]
_DRUGS = [
    "amoxicillin",
    "metformin",
    "apixaban",
    "levothyroxine",
    "sumatriptan",
    "colchicine",
    "ferrous sulfate",
    "omeprazole",
    "salbutamol",
    "furosemide",
    "nitrofurantoin",
    "amlodipine",
    "enoxaparin",
    "methotrexate",
    "levetiracetam",
]
_SYMPTOMS = [
    "fever and a productive cough",
    "polyuria and fatigue",
    "palpitations",
    "weight gain and cold intolerance",
    "a throbbing unilateral headache",
    "a hot swollen first toe",
    "pallor and exertional dyspnoea",
    "epigastric pain",
    "wheeze and breathlessness",
    "ankle oedema and orthopnoea",
    "dysuria",
    "persistent headaches",
    "a swollen painful calf",
    "morning joint stiffness",
    "recurrent seizures",
]


def synthetic_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Respondent GRPO rows in the export's layout: prompt (chat), question, options, gold, triplets."""
    from ermedrag.agents.base import to_chat
    from ermedrag.agents.extractor import render_triplets
    from ermedrag.agents.respondent import build_messages

    rows = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        c = rng.randrange(len(_CONDITIONS))
        wrong = rng.sample([d for j, d in enumerate(_DRUGS) if j != c], 3)
        gold = rng.choice("ABCD")
        drugs = wrong[:]
        drugs.insert("ABCD".index(gold), _DRUGS[c])
        options = dict(zip("ABCD", (d.capitalize() for d in drugs)))
        question = (
            f"A {rng.randint(18, 85)}-year-old {rng.choice(['man', 'woman'])} presents with "
            f"{_SYMPTOMS[c]} and is diagnosed with {_CONDITIONS[c]}. Which drug is the first-line treatment?"
        )
        triplets = [
            {
                "condition": _CONDITIONS[c],
                "relation": "treated with",
                "conclusion": _DRUGS[c],
                "snippet_id": f"syn-{i}-0",
            }
        ]
        for k, d in enumerate(rng.sample(range(len(_CONDITIONS)), 2), 1):  # distractor evidence
            triplets.append(
                {
                    "condition": _CONDITIONS[d],
                    "relation": "treated with",
                    "conclusion": _DRUGS[d],
                    "snippet_id": f"syn-{i}-{k}",
                }
            )
        rng.shuffle(triplets)
        messages = build_messages(question, options, render_triplets(triplets))
        rows.append(
            {
                "prompt": to_chat(messages),  # as training.export writes prompts
                "question": question,
                "options": options,
                "gold": gold,
                "triplets": triplets,
            }
        )
    return rows


# --- timing ----------------------------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_timer(deadline: float, reserve_s: float):
    """A TrainerCallback timing each optimizer step (CUDA-synchronised) and stopping before the deadline."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps: dict[int, dict[str, Any]] = {}
            self.generation_s = 0.0  # accumulated by the trainer's generation wrapper within the current step
            self.generation_calls = 0
            self.stopped_by_time = False
            self.trainer = None
            self._t0 = None

        def on_train_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            self.generation_s, self.generation_calls = 0.0, 0
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            seconds = time.perf_counter() - self._t0
            record = self.steps.setdefault(state.global_step, {"step": state.global_step})
            record.update(seconds=seconds, generation_seconds=self.generation_s if self.generation_calls else None)
            recent = [r["seconds"] for r in list(self.steps.values())[-3:]]
            next_step = max(recent) * 1.15
            if state.global_step < state.max_steps and time.time() + next_step + reserve_s > deadline:
                control.should_training_stop = True
                self.stopped_by_time = True
                log(
                    f"time budget: stopping after step {state.global_step} "
                    f"(next step ~{next_step:.1f}s, {deadline - time.time():.0f}s left)"
                )

        def logs_by_step(self) -> dict[int, dict[str, float]]:
            # From the trainer's log_history: exact numbers (the progress callback formats the dict that
            # on_log receives into strings in place).
            history = getattr(getattr(self.trainer, "state", None), "log_history", None) or []
            return {h["step"]: h for h in history if "step" in h and "loss" in h}

    return StepTimer()


def timed_trainer_class(base, timer):
    """`base` (trl.GRPOTrainer) with the timer among its callbacks and its generation call timed."""

    class TimedGRPOTrainer(base):
        def __init__(self, *args, callbacks=None, **kwargs):
            super().__init__(*args, callbacks=[*(callbacks or []), timer], **kwargs)
            timer.trainer = self

    if hasattr(base, "_generate_single_turn"):  # TRL 1.x: one call per generation batch (transformers or vLLM)

        def _generate_single_turn(self, *args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            try:
                return base._generate_single_turn(self, *args, **kwargs)
            finally:
                _sync()
                timer.generation_s += time.perf_counter() - t0
                timer.generation_calls += 1

        TimedGRPOTrainer._generate_single_turn = _generate_single_turn
    return TimedGRPOTrainer


# --- report ----------------------------------------------------------------------------------------------


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _rate(tokens: float, seconds: float) -> float | None:
    return round(tokens / seconds, 1) if seconds > 0 else None


def step_report(timer, completions_per_step: int) -> dict[str, Any]:
    steps = [timer.steps[k] for k in sorted(timer.steps) if "seconds" in timer.steps[k]]
    logs_by_step = timer.logs_by_step()
    previous_tokens = 0.0
    per_step = []
    for record in steps:
        logs = logs_by_step.get(record["step"], {})
        mean_length = logs.get("completions/mean_length")
        generated = mean_length * completions_per_step if mean_length is not None else None
        total_tokens = logs.get("num_tokens")  # cumulative prompt + completion tokens (TRL)
        processed = total_tokens - previous_tokens if total_tokens is not None else None
        previous_tokens = total_tokens if total_tokens is not None else previous_tokens
        per_step.append(
            {
                "step": record["step"],
                "seconds": round(record["seconds"], 3),
                "generation_seconds": round(record["generation_seconds"], 3)
                if record.get("generation_seconds")
                else None,
                "completion_mean_length": mean_length,
                "generated_tokens": generated,
                "prompt_plus_completion_tokens": processed,
                "reward": logs.get("reward"),
                "loss": logs.get("loss"),
                "trainer_step_time": logs.get("step_time"),  # transformers' own figure, unsynchronised
            }
        )
    # The first step carries one-off costs (CUDA context, cuBLAS handles, allocator growth): report it apart.
    steady = per_step[1:] if len(per_step) > 1 else per_step
    seconds = [s["seconds"] for s in steady]
    gen_seconds = [s["generation_seconds"] for s in steady if s["generation_seconds"]]
    generated = [s["generated_tokens"] for s in steady if s["generated_tokens"] is not None]
    processed = [s["prompt_plus_completion_tokens"] for s in steady if s["prompt_plus_completion_tokens"] is not None]
    total_s = sum(seconds)
    report = {
        "steps_timed": len(per_step),
        "steady_steps": len(steady),
        "first_step_seconds": per_step[0]["seconds"] if per_step else None,
        "step_seconds_mean": round(statistics.fmean(seconds), 3) if seconds else None,
        "step_seconds_median": round(statistics.median(seconds), 3) if seconds else None,
        "step_seconds_min": round(min(seconds), 3) if seconds else None,
        "step_seconds_max": round(max(seconds), 3) if seconds else None,
        "generation_seconds_mean": round(statistics.fmean(gen_seconds), 3) if gen_seconds else None,
        "generation_share": round(sum(gen_seconds) / total_s, 3) if gen_seconds and total_s else None,
        "generated_tokens_per_step_mean": round(statistics.fmean(generated), 1) if generated else None,
        # end to end: generated tokens over the whole step (generation + scoring + forward/backward + update)
        "generated_tokens_per_s": _rate(sum(generated), total_s) if generated else None,
        # generation alone: generated tokens over the time inside the generate call
        "generation_tokens_per_s": _rate(sum(generated), sum(gen_seconds))
        if generated and gen_seconds and len(gen_seconds) == len(generated)
        else None,
        # everything the step processed (prompt + completion tokens of all completions) per second
        "prompt_plus_completion_tokens_per_s": _rate(sum(processed), total_s) if processed else None,
    }
    return {"summary": report, "per_step": per_step}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_cuda = torch.cuda.is_available()
    notes = []
    if not on_cuda:
        if not args.allow_cpu:
            print(
                "grpo_gpu: no CUDA device found (torch.cuda.is_available() is False). This benchmark is meant "
                "for the GPU machine; to check the script on CPU, pass --allow-cpu (runs --size tiny, 2 steps).",
                file=sys.stderr,
            )
            return 2
        if args.size != "tiny" or args.steps > 2 or args.prompts_per_step != 1:
            notes.append("CPU check: forced --size tiny, --steps <= 2, --prompts-per-step 1")
        args.size, args.steps, args.prompts_per_step = "tiny", min(args.steps, 2), 1
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.vllm and importlib.util.find_spec("vllm") is None:
        print("grpo_gpu: --vllm colocate needs the vllm package, which is not installed here.", file=sys.stderr)
        return 2
    if args.vllm:
        # colocate mode outside `accelerate launch`: vLLM's distributed init reads these
        for name, value in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29531"),
        ):
            os.environ.setdefault(name, value)
    vocab_size = args.vocab_size
    if args.vllm and vocab_size is None:
        vocab_size = 0  # the tokenizer's own size: vLLM detokenises every id it samples
        notes.append("--vllm: vocabulary = the tokenizer's (no ids vLLM could not detokenise)")
    out_path = args.out or (DEFAULT_OUT if on_cuda else CPU_OUT)
    deadline = STARTED + args.max_minutes * 60
    completions_per_step = args.prompts_per_step * args.num_generations
    n_prompts = args.prompts or max(64, args.prompts_per_step * args.steps)

    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device = {
        "cuda": on_cuda,
        "name": torch.cuda.get_device_name(0) if on_cuda else cpu_model(),
        "count": torch.cuda.device_count() if on_cuda else 0,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if on_cuda else None,
        "total_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if on_cuda else None,
        "torch_cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
    }
    log(
        f"device: {device['name']} (cuda={on_cuda}); size {args.size}, {args.steps} steps, "
        f"{completions_per_step} completions/step x {args.max_completion_length} tokens max"
    )

    own_work = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="grpo_gpu_")) if own_work else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        model_info = build_model(work / "model", args.size, vocab_size, on_cuda=on_cuda, seed=args.seed)
        log(
            f"model: {model_info['parameters'] / 1e6:.1f}M parameters "
            f"({model_info['non_embedding_parameters'] / 1e6:.1f}M non-embedding), vocab {model_info['vocab_size']}, "
            f"built and saved in {time.perf_counter() - t:.1f}s"
        )

        from datasets import Dataset

        rows = synthetic_rows(n_prompts, args.seed)
        Dataset.from_list(rows).save_to_disk(str(work / "dataset"))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(work / "model")
        prompt_tokens = [
            len(
                tok(
                    tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False,
                )["input_ids"]
            )
            for r in rows[:32]
        ]
        log(f"dataset: {n_prompts} respondent prompts, ~{statistics.fmean(prompt_tokens):.0f} prompt tokens each")

        import trl

        from ermedrag.training.config import GRPOTrainingConfig
        from ermedrag.training.trainers import train_grpo

        gradient_checkpointing = {"auto": None, "on": True, "off": False}[args.gradient_checkpointing]
        config = GRPOTrainingConfig(
            model=str(work / "model"),
            dataset=str(work / "dataset"),
            output_dir=str(work / "run"),
            use_lora=args.lora,
            learning_rate=args.learning_rate or (1e-5 if args.lora else 1e-6),
            max_steps=args.steps,
            per_device_train_batch_size=completions_per_step,
            gradient_accumulation_steps=1,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            beta=args.beta,
            bf16=None,  # project default: bf16 on CUDA, float32 on CPU
            dtype=None,
            gradient_checkpointing=gradient_checkpointing,
            seed=args.seed,
            logging_steps=1,
            save_steps=10**9,  # no checkpoints: only the final save that train_grpo always does
            save_total_limit=None,
            report_to="none",
            use_vllm=bool(args.vllm),
            vllm_mode=args.vllm or "colocate",
            vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        )
        # Time after training for the final save (~2 bytes/parameter in bf16), the plot and this report.
        reserve_s = 20 + model_info["parameters"] * 2 / 2e8
        timer = make_timer(deadline, reserve_s)
        original = trl.GRPOTrainer
        trl.GRPOTrainer = timed_trainer_class(original, timer)  # train_grpo imports it from trl at call time
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        log(f"training (budget: {deadline - time.time():.0f}s left, {reserve_s:.0f}s kept for the save)")
        try:
            summary = train_grpo(config)  # rewards unset: the respondent's defaults
        finally:
            trl.GRPOTrainer = original
        _sync()

        steps = step_report(timer, completions_per_step)
        memory = None
        if on_cuda:
            memory = {
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            }
        result = {
            "benchmark": "grpo_gpu",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": shlex.join(
                [
                    "python",
                    str(Path(sys.argv[0]).resolve().relative_to(REPO))
                    if Path(sys.argv[0]).resolve().is_relative_to(REPO)
                    else sys.argv[0],
                    *sys.argv[1:],
                ]
            ),
            "device": device,
            "versions": {
                "python": platform.python_version(),
                **{
                    name: _version(name)
                    for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "vllm")
                },
            },
            "model": model_info,
            "run": {
                "steps_requested": args.steps,
                "steps_done": summary["steps"],
                "stopped_by_time_budget": timer.stopped_by_time,
                "max_minutes": args.max_minutes,
                "prompts_per_step": args.prompts_per_step,
                "num_generations": args.num_generations,
                "completions_per_step": completions_per_step,
                "max_completion_length": args.max_completion_length,
                "prompt_tokens_mean": round(statistics.fmean(prompt_tokens), 1),
                "dataset_prompts": n_prompts,
                "lora": args.lora,
                "beta": args.beta,
                "bf16": config.resolved_bf16(),
                "dtype": config.resolved_dtype(),
                "gradient_checkpointing": on_cuda if gradient_checkpointing is None else gradient_checkpointing,
                "use_vllm": bool(args.vllm),
                "loss_type": config.loss_type,
                "reward_functions": summary.get("reward_functions"),
                "train_wall_seconds": summary["wall_seconds"],  # trainer.train() + final save + plot
            },
            "timing": steps["summary"],
            "memory": memory,
            "final_metrics": summary.get("final_metrics"),
            "per_step": steps["per_step"],
            "total_wall_seconds": round(time.time() - STARTED, 1),
            "notes": notes + ([] if on_cuda else ["CPU smoke check: not a GPU figure"]),
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(json.dumps({k: result[k] for k in ("device", "model", "run", "timing", "memory")}, indent=2))
        log(f"wrote {out_path}")
        if args.keep_work:
            log(f"work folder kept: {work} (run/metrics.jsonl, run/curves.png)")
        return 0
    finally:
        if own_work and not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
