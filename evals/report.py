"""Reports: result folders → a markdown table (system × benchmark) and PNG plots, comparable across runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from ermedrag.evals.metrics import group_summaries, summarise
from ermedrag.evals.runner import RESULTS
from ermedrag.tools.jsonl import read_records


def load_rows(result_dirs: Iterable[str | Path]) -> list[dict[str, Any]]:
    rows = []
    for folder in result_dirs:
        path = Path(folder) / RESULTS
        if not path.exists():
            raise FileNotFoundError(f"no {RESULTS} in {folder} (run `ermedrag eval --out {folder}` first)")
        rows.extend(read_records(path))
    return rows


def _cell(s: dict[str, Any]) -> str:
    low, high = s["ci95"]
    return f"{100 * s['accuracy']:.1f} [{100 * low:.0f}–{100 * high:.0f}] (n={s['n']})"


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown_report(rows: list[dict[str, Any]]) -> str:
    by_cell = group_summaries(rows, "system", "model", "benchmark")
    by_system = group_summaries(rows, "system", "model")
    benchmarks = sorted({r["benchmark"] for r in rows})
    lines = ["# Evaluation report", "",
             "Accuracy % with Wilson 95% interval and number of answers, per system and benchmark.", "",
             "| system | model | " + " | ".join(benchmarks) + " | all |",
             "|---|---|" + "---|" * (len(benchmarks) + 1)]
    for (system, model), overall in by_system.items():
        cells = [_cell(by_cell[(system, model, b)]) if (system, model, b) in by_cell else "–" for b in benchmarks]
        lines.append(f"| {system} | {model} | " + " | ".join(cells) + f" | {_cell(overall)} |")
    lines += ["", "| system | model | invalid rate | well-formed rate | answer entropy (nats) | token entropy (nats) "
              "| output tokens / q | seconds / q | stage seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for (system, model), s in by_system.items():
        stages = ", ".join(f"{k}={v:.2f}" for k, v in s["stage_seconds"].items() if v is not None)
        lines.append(f"| {system} | {model} | {_num(s['invalid_rate'])} | {_num(s['well_formed_rate'])} | "
                     f"{_num(s['answer_entropy'])} | {_num(s['token_entropy'])} | "
                     f"{_num(s['mean_output_tokens'], '{:.0f}')} | {_num(s['mean_seconds'], '{:.1f}')} | {stages} |")
    lines += ["", "Entropy definitions: see `evals/metrics.py`. Answer entropy needs `--samples` > 1."]
    return "\n".join(lines) + "\n"


def plot_report(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_cell = group_summaries(rows, "system", "benchmark")
    systems = sorted({k[0] for k in by_cell})
    benchmarks = sorted({k[1] for k in by_cell})
    width = 0.8 / max(len(systems), 1)
    paths = []
    for metric, label, file_name in (("accuracy", "accuracy", "accuracy.png"),
                                     ("token_entropy", "mean token entropy (nats)", "entropy.png")):
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(benchmarks)), 4))
        for i, system in enumerate(systems):
            xs, ys, errs = [], [], [[], []]
            for j, bench in enumerate(benchmarks):
                s = by_cell.get((system, bench))
                if s and s[metric] is not None:
                    xs.append(j + i * width)
                    ys.append(s[metric])
                    low, high = s["ci95"] if metric == "accuracy" else (s[metric], s[metric])
                    # matplotlib refuses negative error bars; rounding must not fail a whole report
                    errs[0].append(max(0.0, s[metric] - low))
                    errs[1].append(max(0.0, high - s[metric]))
            if xs:
                ax.bar(xs, ys, width, label=system, yerr=errs if metric == "accuracy" else None, capsize=2)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(benchmarks))], benchmarks,
                      rotation=20)
        ax.set_ylabel(label)
        if ax.containers:
            ax.legend()
        else:
            ax.text(0.5, 0.5, f"no {label} recorded (needs a backend that returns it)", ha="center",
                    transform=ax.transAxes)
        fig.tight_layout()
        path = out_dir / file_name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def rag_quality_section(result_dirs: list[str], trace_db: str, corpus_dir: str | None, qrels: str | None,
                        judge: str | None, base_url: str | None, out: Path) -> str:
    """ID-based context precision/recall (ragas, offline) and, with a judge model, faithfulness/relevancy."""
    from ermedrag.evals.rag_quality import judge_metrics, judge_samples, rag_quality

    quality = rag_quality(result_dirs, trace_db, qrels_path=qrels, corpus_dir=corpus_dir)
    lines = ["", "## RAG quality", "", "Context precision/recall of retrieved passages against gold evidence "
             "(ragas ID-based metrics; PubMedQA: the question's abstract, BioASQ: its gold snippets).", "",
             "| system | benchmark | n | context precision | context recall |", "|---|---|---|---|---|"]
    for g in quality["groups"]:
        lines.append(f"| {g['system']} | {g['benchmark']} | {g['n']} | {_num(g['context_precision'])} | "
                     f"{_num(g['context_recall'])} |")
    if judge:
        quality["judge"] = judge_metrics(judge_samples(load_rows(result_dirs), trace_db), judge, base_url)
        lines += ["", f"Judge {judge}: " + ", ".join(f"{k}={_num(v['mean'])} (n={v['n']})" for k, v in quality["judge"]["summary"].items())]
    (out / "rag_quality.json").write_text(json.dumps(quality, indent=2, default=str))
    return "\n".join(lines) + "\n"


def write_report(result_dirs: list[str], out_dir: str | Path, *, trace_db: str | None = None,
                 corpus_dir: str | None = None, qrels: str | None = None, judge: str | None = None,
                 base_url: str | None = None) -> dict[str, Any]:
    rows = load_rows(result_dirs)
    if not rows:
        raise ValueError(f"no results in {', '.join(result_dirs)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown_report(rows)
    if trace_db:
        text += rag_quality_section(result_dirs, trace_db, corpus_dir, qrels, judge, base_url, out)
    (out / "report.md").write_text(text, encoding="utf-8")
    summary = {f"{s}|{m}": v for (s, m), v in group_summaries(rows, "system", "model").items()}
    (out / "summary.json").write_text(json.dumps({"overall": summarise(rows), "by_system": summary}, indent=2))
    plots = plot_report(rows, out)
    return {"report": str(out / "report.md"), "plots": [str(p) for p in plots], "rows": len(rows)}
