"""Reports: result folders → report.md, summary.json and PNG plots, one row (one bar colour) per configuration.

A configuration is everything the runner keys a result by (`config_key`: the graph, every setting it uses, the
samples per question). Tables and plots never pool two configurations: the report says up front what differs
between the ones it compares, labels each by its system and those differing settings, and lists the full
settings per label at the end. Rows answered with permuted options (`order` > 0) feed only the position-bias
section; every other number uses the original option order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ermedrag.evals.panel import panel_section, panel_summary
from ermedrag.evals.metrics import NEEDS_SAMPLES, original_order_rows
from ermedrag.evals.report.results import (
    LoadedResults,
    load_results,
    load_rows,
    Comparison,
    compare_configurations,
    comparison_header,
    Summaries,
    summaries,
    ALL,
    shown_value,
)
from ermedrag.evals.report.plots import plot_report, unplotted
from ermedrag.evals.report.evidence import evidence_section, evidence_summary, plot_risk_coverage

LATENCY_NOTE = (
    "Stage time = wall time of a graph node, including time spent waiting for a batch; model time = "
    "the model's own compute over the run's calls (apportioned across a batch on a batched backend); "
    "wait = time those calls queued before computing. Means per answered question; "
    "“–”: not recorded in these results (older runs)."
)


# ------------------------------------------------------------------------------------------------ loading


# ------------------------------------------------------------------------------------------------ configurations


# ------------------------------------------------------------------------------------------------ summaries


# ------------------------------------------------------------------------------------------------ markdown


def _cell(s: dict[str, Any] | None) -> str:
    if not s or not s["n"]:
        return "–"
    low, high = s["ci95"]
    return f"{100 * s['accuracy']:.1f} [{100 * low:.0f}–{100 * high:.0f}] (n={s['n']})"


def _md(text: str) -> str:
    """Text in a markdown table cell: a `|` in a setting's value must not split the cell."""
    return text.replace("|", "\\|")


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def _entropy_cell(s: dict[str, Any] | None) -> str:
    if not s or not s["n"]:
        return "–"
    return _num(s["answer_entropy"]) if s["answer_entropy"] is not None else f"– ({s['answer_entropy_note']})"


def _per_benchmark_table(title: str, comparison: Comparison, sums: Summaries, cell: Any) -> list[str]:
    lines = [
        "",
        f"### {title}",
        "",
        "| configuration | " + " | ".join(sums.benchmarks) + f" | {ALL} |",
        "|---|" + "---|" * (len(sums.benchmarks) + 1),
    ]
    for c in comparison.configurations:
        cells = [cell(sums.by_benchmark[c.key].get(b)) for b in sums.benchmarks] + [cell(sums.overall[c.key])]
        lines.append(f"| {_md(c.label)} | " + " | ".join(cells) + " |")
    return lines


def _stages(s: dict[str, Any]) -> str:
    shown = [f"{k}={v:.2f}" for k, v in s["stage_seconds"].items() if v is not None]
    return ", ".join(shown) or "–"


def markdown_report(
    rows: list[dict[str, Any]], comparison: Comparison | None = None, warnings: Sequence[str] = ()
) -> str:
    comparison = comparison or compare_configurations(rows)
    main = original_order_rows(rows)
    sums = summaries(main, comparison)
    configs = comparison.configurations
    lines = ["# Evaluation report", "", *comparison_header(comparison), ""]
    lines += [f"**Warning:** {w}" for w in warnings] + ([""] if warnings else [])
    if len(main) < len(rows):
        lines += [
            f"{len(rows) - len(main)} answers to permuted options are left out of these tables (see position bias).",
            "",
        ]
    lines += [
        "## Accuracy",
        "",
        "Accuracy % with Wilson 95% interval and number of answers, one row per configuration.",
        "",
        "| configuration | model | " + " | ".join(sums.benchmarks) + f" | {ALL} |",
        "|---|---|" + "---|" * (len(sums.benchmarks) + 1),
    ]
    for c in configs:
        cells = [_cell(sums.by_benchmark[c.key].get(b)) for b in sums.benchmarks]
        lines.append(f"| {_md(c.label)} | {_md(c.model)} | " + " | ".join(cells) + f" | {_cell(sums.overall[c.key])} |")
    lines += [
        "",
        "## Answers",
        "",
        "| configuration | invalid rate | well-formed rate | extracted rate | "
        "answer entropy (nats) | token entropy (nats) | output tokens / q |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        s = sums.overall[c.key]
        lines.append(
            f"| {_md(c.label)} | {_num(s['invalid_rate'])} | {_num(s['well_formed_rate'])} | "
            f"{_num(s['extracted_rate'])} | {_entropy_cell(s)} | {_num(s['token_entropy'])} | "
            f"{_num(s['mean_output_tokens'], '{:.0f}')} |"
        )
    if any(s["answer_entropy"] is not None for s in sums.overall.values()):
        lines += _per_benchmark_table("Answer entropy per benchmark (nats)", comparison, sums, _entropy_cell)
    else:
        lines += ["", f"Answer entropy: – for every configuration ({NEEDS_SAMPLES}, with --temperature > 0)."]
    if any(s["token_entropy"] is not None for s in sums.overall.values()):
        lines += _per_benchmark_table(
            "Token entropy per benchmark (nats)", comparison, sums, lambda s: _num(s["token_entropy"]) if s else "–"
        )
    for line in unplotted(comparison, sums):  # plot_report leaves these files out: say why where they'd be looked for
        lines += ["", line]
    lines += [
        "",
        "## Latency",
        "",
        LATENCY_NOTE,
        "",
        "| configuration | wall s / q | model s / q | wait s / q | stage s / q |",
        "|---|---|---|---|---|",
    ]
    for c in configs:
        s = sums.overall[c.key]
        lines.append(
            f"| {_md(c.label)} | {_num(s['mean_seconds'], '{:.2f}')} | {_num(s['mean_model_seconds'], '{:.2f}')} "
            f"| {_num(s['mean_wait_seconds'], '{:.2f}')} | {_stages(s)} |"
        )
    lines += [
        "",
        "## Configurations",
        "",
        "| label | config_key | system | model | samples | settings |",
        "|---|---|---|---|---|---|",
    ]
    for c in configs:
        settings = ", ".join(f"{k}={shown_value(v)}" for k, v in sorted(c.settings.items())) or "–"
        lines.append(
            f"| {_md(c.label)} | `{_md(c.key)}` | {_md(c.system)} | {_md(c.model) or '–'} | {c.samples} | "
            f"{_md(settings)} |"
        )
    lines += ["", "Metric definitions: see `evals/metrics.py`. Answer entropy needs `--samples` > 1."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ plots


# ------------------------------------------------------------------------------------------------ sections


def rag_quality_section(
    result_dirs: list[str],
    trace_db: str,
    corpus_dir: str | None,
    qrels: str | None,
    judge: str | None,
    base_url: str | None,
    out: Path,
) -> str:
    """ID-based context precision/recall (ragas, offline) and, with a judge model, faithfulness/relevancy."""
    from ermedrag.evals.rag_quality import empty_reason, judge_metrics, judge_samples, rag_quality

    quality = rag_quality(result_dirs, trace_db, qrels_path=qrels, corpus_dir=corpus_dir)
    lines = [
        "",
        "## RAG quality",
        "",
        "Context precision/recall of retrieved passages against gold evidence "
        "(ragas ID-based metrics; PubMedQA: the question's abstract, BioASQ: its gold snippets).",
        "",
    ]
    reason = empty_reason(quality)
    if reason:  # one line instead of a table with no rows
        lines.append(reason)
    else:
        lines += ["| system | benchmark | n | context precision | context recall |", "|---|---|---|---|---|"]
    for g in quality["groups"]:
        lines.append(
            f"| {g['system']} | {g['benchmark']} | {g['n']} | {_num(g['context_precision'])} | "
            f"{_num(g['context_recall'])} |"
        )
    if not judge:
        lines += ["", "Faithfulness and answer relevancy: not judged (pass --judge MODEL to have a model judge them)."]
    elif samples := judge_samples(load_rows(result_dirs), trace_db):
        quality["judge"] = judge_metrics(samples, judge, base_url)
        judged = quality["judge"]["summary"].items()
        lines += ["", f"Judge {judge}: " + ", ".join(f"{k}={_num(v['mean'])} (n={v['n']})" for k, v in judged)]
    else:
        why = f"no run of these results has retrieved contexts and a respondent call in the trace database {trace_db}"
        quality["judge"] = {"judge": judge, "rows": [], "summary": {}, "not_judged": why}
        lines += ["", f"Judge {judge}: nothing to judge ({why})."]
    (out / "rag_quality.json").write_text(json.dumps(quality, indent=2, default=str))
    return "\n".join(lines) + "\n"


def position_bias(rows: list[dict[str, Any]]) -> tuple[str, Any]:
    """The position-bias section and its summary, when that module is installed (it reads permuted rows)."""
    try:
        from ermedrag.evals.position_bias import position_bias_section, position_bias_summary
    except ImportError:
        return "", None
    return position_bias_section(rows), position_bias_summary(rows)


def load_warnings(loaded: LoadedResults) -> list[str]:
    warnings = [
        f"dropped {n} duplicate rows from {folder} (same configuration, benchmark, question, sample and "
        "option order as a row loaded before it; the first is kept)."
        for folder, n in loaded.duplicates.items()
    ]
    warnings += [
        f"skipped {n} rows without a benchmark or question id in {folder}." for folder, n in loaded.malformed.items()
    ]
    return warnings


def summary_record(comparison: Comparison, sums: Summaries, loaded: LoadedResults) -> dict[str, Any]:
    main = original_order_rows(loaded.rows)
    return {
        "configurations": {
            c.label: {
                "config_key": c.key,
                "system": c.system,
                "model": c.model,
                "samples": c.samples,
                "settings": c.settings,
                "overall": sums.overall[c.key],
                "by_benchmark": sums.by_benchmark[c.key],
            }
            for c in comparison.configurations
        },
        "differs_in": list(comparison.differs),
        "differences": comparison.differs,
        "shares": comparison.shares,
        "system_specific": comparison.own,
        # counts only: pooling configurations' accuracies would hide what differs between them
        "overall": {
            "n": len(main),
            "questions": len({(r["benchmark"], r["question_id"]) for r in main}),
            "configurations": len(comparison.configurations),
            "permuted_rows": len(loaded.rows) - len(main),
        },
        "duplicates_dropped": loaded.duplicates_dropped,
        "duplicates_by_folder": loaded.duplicates,
    }


def write_report(
    result_dirs: list[str],
    out_dir: str | Path,
    *,
    trace_db: str | None = None,
    corpus_dir: str | None = None,
    qrels: str | None = None,
    judge: str | None = None,
    base_url: str | None = None,
) -> dict[str, Any]:
    loaded = load_results(result_dirs)
    rows = loaded.rows
    if not rows:
        raise ValueError(f"no results in {', '.join(map(str, result_dirs))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    comparison = compare_configurations(rows)
    warnings = load_warnings(loaded)
    text = markdown_report(rows, comparison, warnings)
    bias_text, bias_summary = position_bias(rows)
    if bias_text:
        text += "\n" + bias_text.rstrip("\n") + "\n"
    labels = {c.key: c.label for c in comparison.configurations}
    text += panel_section(rows, labels)
    main_rows = original_order_rows(rows)
    evidence = evidence_summary(main_rows, qrels, corpus_dir)
    text += evidence_section(evidence, labels)
    if trace_db:
        text += rag_quality_section(result_dirs, trace_db, corpus_dir, qrels, judge, base_url, out)
    (out / "report.md").write_text(text, encoding="utf-8")
    sums = summaries(original_order_rows(rows), comparison)
    record = {
        **summary_record(comparison, sums, loaded),
        "position_bias": bias_summary,
        "panel": panel_summary(rows),
        "evidence": evidence,
    }
    (out / "summary.json").write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
    plots = plot_report(rows, out, comparison)
    risk_plot = plot_risk_coverage(main_rows, labels, out)
    plots += [risk_plot] if risk_plot else []
    return {
        "report": str(out / "report.md"),
        "plots": [str(p) for p in plots],
        "rows": len(rows),
        "configurations": [c.label for c in comparison.configurations],
        "duplicates_dropped": loaded.duplicates_dropped,
        "warnings": warnings,
    }
