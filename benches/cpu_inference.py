"""CPU inference of the offline model where users feel it: single-stream tokens/s, the extractor fan-out, the demo.

    .venv/bin/python benches/cpu_inference.py            # ≈ 12 min on 2 idle cores → results/cpu_inference.json
    .venv/bin/python benches/cpu_inference.py --quick    # one question, fewer tokens: checks the script

Every configuration runs in a fresh child process (this parent imports only the standard library), one after
another on the same machine, so the figures are side by side:

- `before`: the offline model as it ran before this bench's levers, in float32 (`ERMEDRAG_DTYPE=float32`);
- `after`: the defaults (`tools.precision`: bfloat16 where the CPU has AVX512-BF16/AMX, as this one does);
- `after-prefix_sharing`: `after` with the batch's shared prompt prefix computed per row again (fan-out only);
- `after+int8_output_layer`: `after` with the output layer computed from int8 weights (`int8_output_layer`:
  one scale per vocabulary row, torch's weight-only int8 kernel); Gemma's 262k-vocabulary head is 63% of the
  weights, read at every token. With `after` it also decodes the agreement prompts, and the summary counts how
  many greedy outputs came out the same. Not kept (benches/README.md): it lives only here;
- levers on top of `after`, tokens/s only: eager attention instead of SDPA, a static KV cache, and that cache
  with `torch.compile` (its compilation time is `warm_up_s`);
- `llamacpp`: another runtime, `ERMEDRAG_MODEL=llamacpp:gemma3-270m` (tools.llamacpp: the packaged GGUF's Q4_K_M
  weights through llama-cpp-python 0.3.36, the hf tokenizer and per-token statistics, concurrent calls decoded
  together). Every measurement, with the agreement against `after`; its single-stream and agreement calls read
  their prompt whole (`forget_cache`), as the transformers configurations do.

Per configuration:
- `tokens_per_s`: greedy decoding of 64 tokens (forced: `min_new_tokens`) after a real extractor prompt through
  `model.generate`, median of 3; `prefill_s` the prompt pass alone (1 new token); `decode_tokens_per_s` the
  63 further tokens over the time they added.
- `extract_fanout_ratio`: the ER-MedRAG graph's extract stage (`timings.extract_s`: from the end of retrieval to
  the start of the respondent) with `snippets_k` 4 over the same with 1, same question (the starter knowledge
  base, whose top snippet is the first of the four), median over the questions; the design goal is ≤ 1.3×,
  the issue's target ≤ 1.5×.
- `demo_s`: wall time of `python -m ermedrag demo` (model load, index open, the answer), once.
- agreement (`after` and `after+int8_output_layer`): greedy decoding, single-stream, of 64 tokens after each of
  24 extractor prompts (the starter knowledge base's first 24 passages, each with one of the three questions in
  turn); the summary's `greedy_agreement` counts outputs identical to `after`'s and the mean share of each
  output's tokens before the first difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ermedrag.offline import offline_env
from ermedrag.tools.machine import describe_machine

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    (
        "A 52-year-old man is newly diagnosed with type 2 diabetes; his kidney function is normal. "
        "Which drug should he start first?",
        {"A": "Insulin glargine", "B": "Glipizide", "C": "Metformin", "D": "Pioglitazone"},
    ),
    (
        "A woman develops hives, wheeze and low blood pressure minutes after a bee sting. What is the first treatment?",
        {"A": "Oral antihistamine", "B": "Intramuscular epinephrine", "C": "Inhaled salbutamol", "D": "IV fluids"},
    ),
    (
        "A healthy 30-year-old has community-acquired pneumonia and no risk factors. Which antibiotic first?",
        {"A": "Amoxicillin", "B": "Vancomycin", "C": "Meropenem", "D": "Ciprofloxacin"},
    ),
]
# name: (environment, what the child measures)
CONFIGURATIONS = {
    "before": ({"ERMEDRAG_DTYPE": "float32"}, ("tokens", "fanout", "demo")),
    "after": ({}, ("tokens", "fanout", "demo", "agreement")),
    "after-prefix_sharing": ({"ERMEDRAG_HF_SHARE_PREFIX": "0"}, ("fanout",)),
    "after+int8_output_layer": ({"BENCH_OUTPUT_LAYER": "int8"}, ("tokens", "fanout", "agreement")),
    "after+eager_attention": ({"BENCH_ATTENTION": "eager"}, ("tokens",)),
    "after+static_cache": ({"BENCH_CACHE": "static"}, ("tokens",)),
    "after+static_cache+compile": ({"BENCH_CACHE": "static", "BENCH_COMPILE": "1"}, ("tokens",)),
    "llamacpp": ({"ERMEDRAG_MODEL": "llamacpp:gemma3-270m"}, ("tokens", "fanout", "demo", "agreement")),
}
# Configurations summarised against `before` and `after`, with their greedy agreement with `after`.
COMPARED = ("after+int8_output_layer", "llamacpp")


def child(parts: list[str], quick: bool) -> dict:
    """Runs in the fresh process: the measurements `parts` names, on the default offline model (or, with
    ERMEDRAG_MODEL=llamacpp:..., on the offline GGUF through llama.cpp)."""
    if os.environ.get("ERMEDRAG_MODEL", "").startswith("llamacpp:"):
        out = llamacpp_measurements(parts, quick)
    else:
        out = hf_measurements(parts, quick)
    if "fanout" in parts:
        out.update(extract_fanout(quick))
    return out


def speed_prompt(tokenizer) -> list[int]:
    """The single-stream prompt: a real extractor prompt (instructions, question, a 3-sentence snippet)."""
    from ermedrag.agents import extractor

    question, _ = QUESTIONS[0]
    snippet = (
        "Metformin is the usual first drug for type 2 diabetes with normal kidney function; it lowers "
        "hepatic glucose output, rarely causes hypoglycaemia and is weight neutral. "
    ) * 3
    return list(
        tokenizer.apply_chat_template(
            extractor.build_messages(question, snippet), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def speed(timed, new_tokens: int) -> dict:
    """Single-stream figures from `timed(n)`: the seconds one greedy call takes to write exactly n tokens."""
    prefill = statistics.median(timed(1) for _ in range(3))
    total = statistics.median(timed(new_tokens) for _ in range(3))
    return dict(
        new_tokens=new_tokens,
        prefill_s=round(prefill, 3),
        generate_s=round(total, 3),
        tokens_per_s=round(new_tokens / total, 2),
        decode_tokens_per_s=round((new_tokens - 1) / (total - prefill), 2) if total > prefill else None,
    )


def hf_measurements(parts: list[str], quick: bool) -> dict:
    import torch

    from ermedrag.tools.models.hf import load_hf_model
    from ermedrag.tools.models.offline import offline_model_dir

    out: dict = {"torch_threads": torch.get_num_threads()}
    tokenizer, model = load_hf_model(str(offline_model_dir()))  # the graph's calls below share this model
    out["dtype"] = str(model.dtype).removeprefix("torch.")
    if os.environ.get("BENCH_OUTPUT_LAYER") == "int8":
        model.set_output_embeddings(int8_output_layer(model.get_output_embeddings().weight))
    if "tokens" in parts:
        if os.environ.get("BENCH_ATTENTION"):
            model.set_attn_implementation(os.environ["BENCH_ATTENTION"])
        ids = torch.tensor([speed_prompt(tokenizer)])
        extra = {"cache_implementation": os.environ["BENCH_CACHE"]} if os.environ.get("BENCH_CACHE") else {}

        def timed(tokens: int) -> float:
            started = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    ids,
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    **extra,
                )
            return time.perf_counter() - started

        if os.environ.get("BENCH_COMPILE"):
            model.forward = torch.compile(model.forward, dynamic=False)
        compile_started = time.perf_counter()
        timed(4)  # warm-up (and, with torch.compile, the compilation)
        out["warm_up_s"] = round(time.perf_counter() - compile_started, 1)
        out.update(prompt_tokens=int(ids.shape[1]), **speed(timed, 16 if quick else 64))
    if "agreement" in parts:
        out["greedy_ids"] = greedy_outputs(
            tokenizer, hf_greedy(tokenizer, model), 16 if quick else 64, 3 if quick else 24
        )
    return out


def llamacpp_measurements(parts: list[str], quick: bool) -> dict:
    """The same figures through the llamacpp: backend's own call (`LlamaCppGenerator.generate`: llama.cpp's
    forward passes plus this backend's per-token statistics), its kept prefix emptied before every timed call."""
    from ermedrag.tools.models.hf_batching import GenerationParams
    from ermedrag.tools.models.llamacpp import cpu_threads, llamacpp_generator

    generator = llamacpp_generator(os.environ["ERMEDRAG_MODEL"].removeprefix("llamacpp:"))
    out: dict = {"llamacpp_threads": cpu_threads(), "weights": "GGUF Q4_K_M"}
    eos_ids = generator.eos_ids
    if "tokens" in parts:
        ids = speed_prompt(generator.tokenizer)

        def timed(tokens: int) -> float:
            generator.forget_cache()  # the whole prompt read, as the hf configurations do
            generator.eos_ids = set()  # exactly `tokens` tokens, as min_new_tokens does for hf
            started = time.perf_counter()
            generator.generate(ids, GenerationParams(max_new_tokens=tokens))
            elapsed = time.perf_counter() - started
            generator.eos_ids = eos_ids
            return elapsed

        warm_up_started = time.perf_counter()
        timed(4)
        out["warm_up_s"] = round(time.perf_counter() - warm_up_started, 1)
        out.update(prompt_tokens=len(ids), **speed(timed, 16 if quick else 64))
    if "agreement" in parts:

        def greedy(ids: list[int], new_tokens: int) -> list[int]:
            generator.forget_cache()
            return generator.generate(ids, GenerationParams(max_new_tokens=new_tokens)).token_ids

        out["greedy_ids"] = greedy_outputs(generator.tokenizer, greedy, 16 if quick else 64, 3 if quick else 24)
    return out


def extract_fanout(quick: bool) -> dict:
    """The graph's extract stage with 4 snippets over 1, per question, through the default model settings
    (ERMEDRAG_MODEL picks the backend)."""
    import tempfile

    from ermedrag.graphs.registry import load_graph
    from ermedrag.tools.data.starter_kb import starter_index_dir

    starter_index_dir(progress=False)
    graph = load_graph("er_medrag")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp:
        context = {"trace_db": str(Path(tmp) / "traces.sqlite")}
        graph.invoke(
            {"question": "What treats anaphylaxis?", "options": None}, context={**context, "snippets_k": 1}
        )  # warm-up: index, encoder, first batch
        for question, options in QUESTIONS[:1] if quick else QUESTIONS:
            row = {"question": question[:60]}
            for k in (1, 4):
                started = time.perf_counter()
                state = graph.invoke({"question": question, "options": options}, context={**context, "snippets_k": k})
                row[f"k{k}"] = {
                    "extract_s": round(state["timings"]["extract_s"], 2),
                    "total_s": round(time.perf_counter() - started, 2),
                    "snippets": [s["id"] for s in state["snippets"]],
                }
            row["same_first_snippet"] = row["k1"]["snippets"][:1] == row["k4"]["snippets"][:1]
            # The stage is timed on the wall clock (it lives in the graph's state, across processes): a clock
            # step while it ran makes it longer than the whole call, measured on the monotonic clock.
            row["clock_step"] = any(row[f"k{k}"]["extract_s"] > row[f"k{k}"]["total_s"] for k in (1, 4))
            row["ratio"] = round(row["k4"]["extract_s"] / max(row["k1"]["extract_s"], 1e-9), 2)
            runs.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    kept = [r for r in runs if not r["clock_step"]] or runs
    return {
        "fanout_runs": runs,
        "extract_fanout_ratio": round(statistics.median(r["ratio"] for r in kept), 2),
        "extract_s_k1": round(statistics.median(r["k1"]["extract_s"] for r in kept), 2),
        "extract_s_k4": round(statistics.median(r["k4"]["extract_s"] for r in kept), 2),
    }


def int8_output_layer(weight, rows_per_chunk: int = 16384):
    """An output layer computing x · Wᵀ from W as int8 rows with a bfloat16 scale each (round to nearest against
    the stored scale), through torch's weight-only int8 kernel; quantized in chunks of rows."""
    import torch

    class Int8OutputLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_features = weight.shape[1]
            self.register_buffer("qweight", torch.empty(weight.shape, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(weight.shape[0], dtype=weight.dtype))
            with torch.no_grad():
                for start in range(0, weight.shape[0], rows_per_chunk):
                    rows = weight[start : start + rows_per_chunk].float()
                    scale = (rows.abs().amax(dim=1).clamp(min=1e-12) / 127).to(weight.dtype)
                    self.scales[start : start + rows_per_chunk] = scale
                    quantized = rows.div_(scale.float()[:, None]).round_().clamp_(-127, 127)
                    self.qweight[start : start + rows_per_chunk] = quantized

        def forward(self, hidden):
            rows = hidden.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
            return torch._weight_int8pack_mm(rows, self.qweight, self.scales).reshape(*hidden.shape[:-1], -1)

    return Int8OutputLayer()


def hf_greedy(tokenizer, model):
    """Greedy token ids of one prompt through `model.generate`, single-stream."""
    import torch

    def greedy(ids: list[int], new_tokens: int) -> list[int]:
        with torch.inference_mode():
            new = model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        return new[0, len(ids) :].tolist()

    return greedy


def greedy_outputs(tokenizer, greedy, new_tokens: int, count: int) -> list[list[int]]:
    """`greedy(ids, new_tokens)` after each agreement prompt, one prompt at a time (see the module's docstring)."""
    from ermedrag.agents import extractor
    from ermedrag.tools.data.starter_kb import PASSAGES

    passages = [json.loads(line) for line in PASSAGES.read_text().splitlines() if line.strip()][:count]
    outputs = []
    for number, passage in enumerate(passages):
        question, _ = QUESTIONS[number % len(QUESTIONS)]
        ids = tokenizer.apply_chat_template(
            extractor.build_messages(question, passage["text"]),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        outputs.append(greedy(list(ids), new_tokens))
    return outputs


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How many outputs are identical, and the mean share of each reference output kept before the first
    differing token."""

    def kept(a: list[int], b: list[int]) -> float:
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return 1.0 if a == b else same / max(len(a), 1)

    return {
        "identical": sum(a == b for a, b in zip(reference, other)),
        "prompts": len(reference),
        "mean_share_before_first_difference": round(statistics.fmean(map(kept, reference, other)), 3),
    }


def compared(results: dict, greedy: dict, name: str) -> dict:
    """A configuration's figures beside `after` (and `before`, when measured)."""
    this, after, before = results[name], results["after"], results.get("before")
    summary = {
        "tokens_per_s": this.get("tokens_per_s"),
        "speedup_over_after": round(this["tokens_per_s"] / after["tokens_per_s"], 2),
        "speedup_over_before": round(this["tokens_per_s"] / before["tokens_per_s"], 2) if before else None,
        "extract_fanout_ratio": this.get("extract_fanout_ratio"),
        "extract_s_k4": this.get("extract_s_k4"),
        "extract_s_k4_over_after": (
            round(this["extract_s_k4"] / after["extract_s_k4"], 2)
            if "extract_s_k4" in this and "extract_s_k4" in after
            else None
        ),
        "demo_s": this.get("demo_s"),
    }
    if name in greedy and "after" in greedy:
        summary["greedy_agreement"] = greedy_agreement(greedy["after"], greedy[name])
    return summary


def run_child(name: str, environment: dict[str, str], parts: tuple[str, ...], quick: bool) -> dict:
    env = offline_env(environment)
    command = [sys.executable, __file__, "--child", ",".join(p for p in parts if p != "demo")]
    if quick:
        command.append("--quick")
    result: dict = {"environment": environment}
    if set(parts) - {"demo"}:
        proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if proc.returncode:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    if "demo" in parts and not quick:
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "ermedrag", "demo"], env=env, cwd=REPO, capture_output=True, text=True, timeout=3600
        )
        result["demo_s"] = round(time.perf_counter() - started, 1)
        result["demo_exit_code"] = proc.returncode
    shown = {k: v for k, v in result.items() if k not in ("fanout_runs", "greedy_ids")}
    print(f"{name}: {json.dumps(shown)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one question, 16 tokens, no demo: checks the script")
    parser.add_argument("--only", default=None, help="comma-separated configurations (default: all)")
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "cpu_inference.json"))
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child.split(","), args.quick)))
        return
    started = time.perf_counter()
    at_start = describe_machine()
    names = args.only.split(",") if args.only else list(CONFIGURATIONS)
    results = {name: run_child(name, *CONFIGURATIONS[name], args.quick) for name in names}
    greedy = {name: result.pop("greedy_ids") for name, result in results.items() if "greedy_ids" in result}
    record: dict = {"configurations": results}
    if {"before", "after"} <= results.keys():
        before, after = results["before"], results["after"]
        record["summary"] = {
            "tokens_per_s": {
                "before": before.get("tokens_per_s"),
                "after": after.get("tokens_per_s"),
                "speedup": round(after["tokens_per_s"] / before["tokens_per_s"], 2),
            },
            "extract_fanout_ratio": {
                "before": before.get("extract_fanout_ratio"),
                "after": after.get("extract_fanout_ratio"),
            },
            "extract_s_k4": {"before": before.get("extract_s_k4"), "after": after.get("extract_s_k4")},
            "demo_s": {"before": before.get("demo_s"), "after": after.get("demo_s")},
        }
    for name in COMPARED:
        if {"after", name} <= results.keys():
            record.setdefault("summary", {})[name] = compared(results, greedy, name)
    record.update(
        command="python benches/cpu_inference.py" + (" --quick" if args.quick else ""),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=at_start,
        seconds=round(time.perf_counter() - started, 1),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} in {record['seconds']} s")


if __name__ == "__main__":
    main()
