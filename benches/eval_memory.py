"""Peak memory (RSS) of an `ermedrag eval` on the offline model, measured from outside.

    .venv/bin/python benches/eval_memory.py               # 4 systems × 8 MedQA questions → results/eval_memory.json
    .venv/bin/python benches/eval_memory.py --one-batch   # also: one hf generation batch, before vs after

How it measures: the eval runs as a fresh child process of this script, and the peak is the child's own
`ru_maxrss` as `os.wait4` returns it for that child (with whatever it spawned and waited for). On Linux a child
starts with its parent's memory high-water mark (fork copies the parent, and exec keeps the mark), so the
parent must stay tiny: this script imports only the standard library (never torch, transformers or ermedrag)
and records its own peak beside the result (`parent_rss_mb`); the figure is the child's only if it is far above.

`--one-batch` runs one batch of 8 prompts through the offline model twice, each in a fresh child: the way the
hf backend loaded and generated before (tokenizer first; `generate` returning every step's full-vocabulary
logits, reduced afterwards, in a worker thread) and the way it does now (`load_hf_model`, `BatchingGenerator`:
statistics reduced while generating). It reports each child's peak RSS after loading and after the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from ermedrag.offline import offline_env
from ermedrag.tools.machine import describe_machine

REPO = Path(__file__).resolve().parents[1]
TARGET_MB = 2560
# Measured on main 9d103d9 by an earlier session (issue 13): the same eval, 8 questions × 4 systems.
BEFORE_MB = 8100
SYSTEMS = "cot,vanilla_rag,er_medrag,med_r3"


def default_data() -> Path:
    shared = os.environ.get("ERMEDRAG_SHARED_DATA")
    return (Path(shared) if shared else REPO.parent / "shared" / "data") / "benchmarks"


def rss_mb(kilobytes: int) -> float:
    """ru_maxrss is in kilobytes on Linux (bytes on macOS)."""
    return round(kilobytes / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)


def run_measured(command: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, float, float, str]:
    """Run `command` as a fresh child; (exit code, its peak RSS in MB, seconds, the tail of its output)."""
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = started + timeout_s
        while True:  # wait4 gives this child's own rusage (RUSAGE_CHILDREN would mix in every child so far)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not wait for it again
        seconds = time.perf_counter() - started
        log.seek(0)
        tail = log.read()[-3000:]
    return proc.returncode, rss_mb(usage.ru_maxrss), round(seconds, 1), tail


def measure_eval(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="eval-memory-") as tmp:
        command = [
            sys.executable,
            "-m",
            "ermedrag",
            "eval",
            "--system",
            args.system,
            "--bench",
            args.bench,
            "--limit",
            str(args.limit),
            "--data",
            str(args.data),
            "--out",
            str(Path(tmp) / "results"),
            "--trace-db",
            str(Path(tmp) / "traces.sqlite"),
        ]
        shown = (
            f"ermedrag eval --system {args.system} --bench {args.bench} --limit {args.limit} "
            f"--data {args.data} --out TMP/results --trace-db TMP/traces.sqlite"
        )
        code, peak, seconds, tail = run_measured(
            command, offline_env({"ERMEDRAG_HOME": args.ermedrag_home} if args.ermedrag_home else None), args.timeout
        )
    if code != 0:
        raise SystemExit(f"the eval failed (exit {code}); its output ends:\n{tail}")
    return {
        "peak_rss_mb": peak,
        "command": shown,
        "seconds": seconds,
        "exit_code": code,
        "output_tail": tail.strip().splitlines()[-6:],
    }


# ------------------------------------------------------------------------------ one generation batch (child)

BATCH_PROMPTS = [
    "A 45-year-old man presents with crushing chest pain radiating to the left arm. The most likely diagnosis",
    "Metformin is the first-line drug for type 2 diabetes because",
    "The mechanism of action of warfarin is",
    "A 5-year-old child has a barking cough and inspiratory stridor. The treatment",
    "Heparin prevents venous thromboembolism by",
    "The most common cause of community-acquired pneumonia in adults is",
    "Hypothyroidism presents with fatigue, weight gain and",
    "The first step in managing diabetic ketoacidosis is",
]


def one_batch_child(variant: str, new_tokens: int) -> None:
    """Run in a fresh child: load the offline model and run one batch, the `variant` way; print JSON."""
    import threading

    import torch

    from ermedrag.tools.models.offline import offline_model_dir

    path = str(offline_model_dir())
    if variant == "streaming":
        from ermedrag.tools.models.hf import hf_generator
        from ermedrag.tools.models.hf_batching import GenerationParams

        generator = hf_generator(path, "cpu")
        tokenizer, model = generator.tokenizer, generator.model
    else:  # loaded as before: tokenizer first, glibc's default allocation thresholds
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Plain text continued by the base model, and no end of turn: every row writes the whole budget.
    model.generation_config.eos_token_id = None
    prompts = [tokenizer(p)["input_ids"] for p in BATCH_PROMPTS]
    loaded_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before_batch_mb = proc_status_mb("VmRSS")
    reset_peak_rss()
    written: list[int] = []

    def generate_before() -> None:
        """How the hf backend generated before: every step's [batch, vocab] logits kept, reduced afterwards."""
        pad, width = tokenizer.pad_token_id, max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=False,
                max_new_tokens=new_tokens,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=pad,
            )
            new = out.sequences[:, width:]
            for step, logits in enumerate(out.logits):
                logp = torch.log_softmax(logits.float(), dim=-1)
                logp.gather(1, new[:, step : step + 1])
                (logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(-1)
        written.extend(len(row) for row in new.tolist())

    started = time.perf_counter()
    if variant == "streaming":  # generates in the batching thread
        rows = generator.generate_many(prompts, GenerationParams(max_new_tokens=new_tokens))
        written.extend(len(r.token_ids) for r in rows)
    else:  # in a thread of its own too, as the batching thread ran it
        worker = threading.Thread(target=generate_before)
        worker.start()
        worker.join()
    seconds = time.perf_counter() - started
    # ru_maxrss forgets the load's peak once the high-water mark is reset: the process's peak is the larger one.
    batch_peak_mb = proc_status_mb("VmHWM") or rss_mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    print(
        json.dumps(
            {
                "variant": variant,
                "peak_rss_after_load_mb": rss_mb(loaded_kb),
                "rss_before_batch_mb": before_batch_mb,
                "peak_rss_during_batch_mb": batch_peak_mb,
                "batch_added_mb": round(batch_peak_mb - before_batch_mb, 1) if before_batch_mb else None,
                "peak_rss_mb": max(rss_mb(loaded_kb), batch_peak_mb),
                "tokens_written": written,
                "seconds": round(seconds, 1),
            }
        )
    )


def proc_status_mb(field: str) -> float | None:
    """A memory line of /proc/self/status (Linux), in MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> None:
    """Start VmHWM afresh from the current RSS (Linux: writing 5 to clear_refs), so it measures the batch alone."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def measure_one_batch(args: argparse.Namespace) -> dict:
    results = {}
    for variant in ("full_logits_before", "streaming"):
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--one-batch-child",
            variant,
            "--new-tokens",
            str(args.new_tokens),
        ]
        # (Its wait4 peak is not reported: the child resets its high-water mark before the batch.)
        code, _, _, tail = run_measured(command, offline_env({"ERMEDRAG_TORCH_THREADS": "1"}), args.timeout)
        if code != 0:
            raise SystemExit(f"the one-batch child {variant} failed (exit {code}):\n{tail}")
        results[variant] = json.loads(tail.strip().splitlines()[-1])
    return {"batch": len(BATCH_PROMPTS), "new_tokens": args.new_tokens, "vocab": 262144, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default=SYSTEMS)
    parser.add_argument("--bench", default="medqa")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--data", type=Path, default=default_data())
    parser.add_argument("--ermedrag-home", default=None, help="ERMEDRAG_HOME for the child (default: inherited)")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds before the child is killed")
    parser.add_argument("--one-batch", action="store_true", help="also measure one generation batch, before/after")
    parser.add_argument("--no-eval", action="store_true", help="skip the eval (with --one-batch)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per row in --one-batch")
    parser.add_argument("--one-batch-child", choices=("full_logits_before", "streaming"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "benches" / "results" / "eval_memory.json")
    args = parser.parse_args()
    if args.one_batch_child:
        one_batch_child(args.one_batch_child, args.new_tokens)
        return

    result: dict = {}
    at_start = describe_machine()
    if not args.no_eval:
        result |= measure_eval(args)
    result |= {
        "target_mb": TARGET_MB,
        "before_mb": BEFORE_MB,
        "before_note": f"the same eval ({SYSTEMS}, medqa, --limit 8) on main 9d103d9, from issue 13",
    }
    if args.one_batch:
        result["one_batch"] = measure_one_batch(args)
    result |= {
        "parent_rss_mb": rss_mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
        "bench_command": "python benches/eval_memory.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": at_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
