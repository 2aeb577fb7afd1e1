"""Reports: result folders → report.md, summary.json and PNG plots, one row (one bar colour) per configuration.

A configuration is everything the runner keys a result by (`config_key`: the graph, every setting it uses, the
samples per question). Tables and plots never pool two configurations: the report says up front what differs
between the ones it compares, labels each by its system and those differing settings, and lists the full
settings per label at the end. Rows answered with permuted options (`order` > 0) feed only the position-bias
section; every other number uses the original option order.
"""

from __future__ import annotations

import hashlib
import json
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ermedrag.evals.panel import panel_section, panel_summary
from ermedrag.evals.metrics import NEEDS_SAMPLES, number, option_order, original_order_rows, summarise
from ermedrag.evals.runner import RESULTS
from ermedrag.tools.records.jsonl import read_records

CONFIG_FIELDS = ("system", "model", "samples")  # beside `settings` in a row's `config`
MAX_VALUE_CHARS = 40  # a setting's value in the header and legend (an index path can be long)
MAX_LABEL_PART_CHARS = 24
ALL = "all"
LATENCY_NOTE = ("Stage time = wall time of a graph node, including time spent waiting for a batch; model time = "
                "the model's own compute over the run's calls (apportioned across a batch on a batched backend); "
                "wait = time those calls queued before computing. Means per answered question; "
                "“–”: not recorded in these results (older runs).")
NO_TOKEN_ENTROPY = ("no answer recorded it (it needs a backend that returns per-token distributions, hf/offline, "
                    "and a final answer that is the respondent's own completion)")


# ------------------------------------------------------------------------------------------------ loading

@dataclass
class LoadedResults:
    rows: list[dict[str, Any]]
    duplicates: dict[str, int] = field(default_factory=dict)  # folder → rows dropped (key already loaded)
    malformed: dict[str, int] = field(default_factory=dict)  # folder → rows without benchmark/question id

    @property
    def duplicates_dropped(self) -> int:
        return sum(self.duplicates.values())


def _config_of(row: dict[str, Any]) -> dict[str, Any]:
    """The row's configuration as {system, model, samples, settings}; older rows kept the settings beside
    system and model instead of under `settings`."""
    config = row.get("config") if isinstance(row.get("config"), dict) else {}
    settings = config.get("settings")
    if not isinstance(settings, dict):
        settings = {k: v for k, v in config.items() if k not in CONFIG_FIELDS and k != "settings"}
    elif config.get("prompt_version"):  # part of the configuration's identity: shown when it differs
        settings = {**settings, "prompt_version": config["prompt_version"]}
    samples = number(config.get("samples"))
    return {"system": str(config.get("system") or row.get("system") or "unknown"),
            "model": str(config.get("model") or ""), "samples": int(samples) if samples else 1,
            "settings": dict(settings)}


def _derived_key(config: dict[str, Any]) -> str:
    """A key for rows written before the runner recorded one (same identity: everything but the questions)."""
    return "derived-" + hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def normalise_row(record: dict[str, Any]) -> dict[str, Any] | None:
    """A result row with `config`, `config_key`, `sample` and `order` always present; None without a
    benchmark or question id (nothing to count it under)."""
    if not isinstance(record.get("benchmark"), str) or record.get("question_id") is None:
        return None
    config = _config_of(record)
    key = record.get("config_key")
    sample = number(record.get("sample"))
    return {**record, "config": config, "config_key": key if isinstance(key, str) and key else _derived_key(config),
            "question_id": str(record["question_id"]), "sample": int(sample) if sample is not None else 0,
            "order": option_order(record)}


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["config_key"], row["benchmark"], row["question_id"], row["sample"], row["order"])


def load_results(result_dirs: Iterable[str | Path]) -> LoadedResults:
    """Rows of every folder, merged; a row whose key (configuration, benchmark, question, sample, option order)
    was already loaded is dropped, first one kept, and counted against the folder it came from."""
    loaded = LoadedResults(rows=[])
    seen: set[tuple[Any, ...]] = set()
    for folder in result_dirs:
        path = Path(folder) / RESULTS
        if not path.exists():
            raise FileNotFoundError(f"no {RESULTS} in {folder} (run `ermedrag eval --out {folder}` first)")
        for record in read_records(path):
            row = normalise_row(record)
            if row is None:
                loaded.malformed[str(folder)] = loaded.malformed.get(str(folder), 0) + 1
            elif row_key(row) in seen:
                loaded.duplicates[str(folder)] = loaded.duplicates.get(str(folder), 0) + 1
            else:
                seen.add(row_key(row))
                loaded.rows.append(row)
    return loaded


def load_rows(result_dirs: Iterable[str | Path]) -> list[dict[str, Any]]:
    return load_results(result_dirs).rows


# ------------------------------------------------------------------------------------------------ configurations

@dataclass(frozen=True, eq=False)
class Configuration:
    key: str
    system: str
    model: str
    samples: int
    settings: dict[str, Any]
    label: str = ""

    def fields(self) -> dict[str, Any]:
        """What can differ between configurations: system, model, samples and every setting."""
        return {"system": self.system, "model": self.model, "samples": self.samples, **self.settings}


@dataclass(frozen=True)
class Comparison:
    configurations: list[Configuration]  # in report order: this order assigns the colours
    differs: dict[str, list[str]]  # field → its distinct values, as shown
    shares: dict[str, str]  # field → the one value every configuration has
    own: dict[str, str]  # setting only some configurations have, with one value → that value


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str) and not value else str(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def _short(value: Any) -> str:
    """A setting's value in a label: a path's last part, a model without its backend prefix, bounded."""
    text = str(value)
    if isinstance(value, str) and not text:
        return '""'
    if isinstance(value, str):
        text = " + ".join(part.split(":", 1)[-1].rstrip("/").rsplit("/", 1)[-1] or part for part in text.split(" + "))
    return text if len(text) <= MAX_LABEL_PART_CHARS else text[: MAX_LABEL_PART_CHARS - 1] + "…"


def _differing_fields(configs: list[Configuration]) -> tuple[dict[str, list[str]], dict[str, str], dict[str, str]]:
    """Fields with several values (→ the values, in sort order); fields every configuration has with one value;
    fields only some configurations have, with one value (settings of one system)."""
    values: dict[str, list[str]] = {}
    for config in configs:
        for name, value in config.fields().items():
            shown = _shown(value)
            if shown not in values.setdefault(name, []):
                values[name].append(shown)
    differs = {name: sorted(vals, key=_sort_value) for name, vals in values.items() if len(vals) > 1}
    if "model" in differs:  # the combined model name already says it; each role's model would repeat it
        differs = {name: vals for name, vals in differs.items() if not name.endswith("_model")}
    everywhere = set.intersection(*(set(c.fields()) for c in configs)) if configs else set()
    single = {name: vals[0] for name, vals in values.items() if len(vals) == 1}
    return (differs, {name: v for name, v in single.items() if name in everywhere},
            {name: v for name, v in single.items() if name not in everywhere})


def _sort_value(value: Any) -> tuple[int, float, str]:
    """Numbers (also shown as text) in numeric order, before other values in text order."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def compare_configurations(rows: list[dict[str, Any]]) -> Comparison:
    """The configurations in `rows`, what differs between them, and a short unique label for each."""
    first: dict[str, dict[str, Any]] = {}
    for row in rows:
        first.setdefault(row["config_key"], row["config"])
    configs = [Configuration(key, c["system"], c["model"], c["samples"], c["settings"]) for key, c in first.items()]
    differs, shares, own = _differing_fields(configs)
    shown_fields = [name for name in differs if name != "system"]

    def label(config: Configuration) -> str:
        parts = [config.system]
        for name in shown_fields:
            if name in config.fields():
                value = config.fields()[name]
                parts.append(_short(value) if name == "model" else f"{name}={_short(value)}")
        return " · ".join(parts)

    labelled = [Configuration(c.key, c.system, c.model, c.samples, c.settings, label(c)) for c in configs]
    counts = defaultdict(int)
    for c in labelled:
        counts[c.label] += 1
    # Labels collide when configurations differ only in a setting one of them lacks, or in a part the short form
    # leaves out (hf:gemma vs offline:gemma, a long value cut short): the key tells them apart.
    labelled = [c if counts[c.label] == 1 else Configuration(c.key, c.system, c.model, c.samples, c.settings,
                                                             f"{c.label} #{c.key[:6]}") for c in labelled]
    labelled.sort(key=lambda c: (c.system, [_sort_value(c.fields().get(n, "")) for n in shown_fields], c.label))
    return Comparison(labelled, differs, shares, own)


def comparison_header(comparison: Comparison) -> list[str]:
    configs = comparison.configurations
    shared = ", ".join(f"{k}={v}" for k, v in comparison.shares.items())
    if len(configs) == 1:
        return [f"One configuration: **{configs[0].label}** (`{configs[0].key}`).", "", f"Settings: {shared}."]
    differs = ", ".join(f"{name} ({' vs '.join(values)})" for name, values in comparison.differs.items())
    own = ", ".join(f"{k}={v}" for k, v in comparison.own.items())
    return [f"Configurations differ in: {differs or 'nothing shown (only in settings some systems lack)'}.",
            "", f"They share: {shared or 'nothing'}." + (f" Only where the system has them: {own}." if own else "")]


# ------------------------------------------------------------------------------------------------ summaries

@dataclass(frozen=True)
class Summaries:
    """Per configuration: the summary over all its rows (original option order) and per benchmark."""
    overall: dict[str, dict[str, Any]]  # config key → summary
    by_benchmark: dict[str, dict[str, dict[str, Any]]]  # config key → benchmark → summary
    benchmarks: list[str]


def summaries(rows: list[dict[str, Any]], comparison: Comparison) -> Summaries:
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        grouped[row["config_key"]][row["benchmark"]].append(row)
    overall, by_benchmark = {}, {}
    for config in comparison.configurations:
        benches = grouped.get(config.key, {})
        overall[config.key] = summarise([r for bench_rows in benches.values() for r in bench_rows])
        by_benchmark[config.key] = {b: summarise(benches[b]) for b in sorted(benches)}
    return Summaries(overall, by_benchmark, sorted({r["benchmark"] for r in rows}))


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
    lines = ["", f"### {title}", "", "| configuration | " + " | ".join(sums.benchmarks) + f" | {ALL} |",
             "|---|" + "---|" * (len(sums.benchmarks) + 1)]
    for c in comparison.configurations:
        cells = [cell(sums.by_benchmark[c.key].get(b)) for b in sums.benchmarks] + [cell(sums.overall[c.key])]
        lines.append(f"| {_md(c.label)} | " + " | ".join(cells) + " |")
    return lines


def _stages(s: dict[str, Any]) -> str:
    shown = [f"{k}={v:.2f}" for k, v in s["stage_seconds"].items() if v is not None]
    return ", ".join(shown) or "–"


def markdown_report(rows: list[dict[str, Any]], comparison: Comparison | None = None,
                    warnings: Sequence[str] = ()) -> str:
    comparison = comparison or compare_configurations(rows)
    main = original_order_rows(rows)
    sums = summaries(main, comparison)
    configs = comparison.configurations
    lines = ["# Evaluation report", "", *comparison_header(comparison), ""]
    lines += [f"**Warning:** {w}" for w in warnings] + ([""] if warnings else [])
    if len(main) < len(rows):
        lines += [f"{len(rows) - len(main)} answers to permuted options are left out of these tables (see "
                  "position bias).", ""]
    lines += ["## Accuracy", "", "Accuracy % with Wilson 95% interval and number of answers, one row per "
              "configuration.", "", "| configuration | model | " + " | ".join(sums.benchmarks) + f" | {ALL} |",
              "|---|---|" + "---|" * (len(sums.benchmarks) + 1)]
    for c in configs:
        cells = [_cell(sums.by_benchmark[c.key].get(b)) for b in sums.benchmarks]
        lines.append(f"| {_md(c.label)} | {_md(c.model)} | " + " | ".join(cells) + f" | {_cell(sums.overall[c.key])} |")
    lines += ["", "## Answers", "", "| configuration | invalid rate | well-formed rate | extracted rate | "
              "answer entropy (nats) | token entropy (nats) | output tokens / q |", "|---|---|---|---|---|---|---|"]
    for c in configs:
        s = sums.overall[c.key]
        lines.append(f"| {_md(c.label)} | {_num(s['invalid_rate'])} | {_num(s['well_formed_rate'])} | "
                     f"{_num(s['extracted_rate'])} | {_entropy_cell(s)} | {_num(s['token_entropy'])} | "
                     f"{_num(s['mean_output_tokens'], '{:.0f}')} |")
    if any(s["answer_entropy"] is not None for s in sums.overall.values()):
        lines += _per_benchmark_table("Answer entropy per benchmark (nats)", comparison, sums, _entropy_cell)
    else:
        lines += ["", f"Answer entropy: – for every configuration ({NEEDS_SAMPLES}, with --temperature > 0)."]
    if any(s["token_entropy"] is not None for s in sums.overall.values()):
        lines += _per_benchmark_table("Token entropy per benchmark (nats)", comparison, sums,
                                      lambda s: _num(s["token_entropy"]) if s else "–")
    lines += ["", "## Latency", "", LATENCY_NOTE, "",
              "| configuration | wall s / q | model s / q | wait s / q | stage s / q |", "|---|---|---|---|---|"]
    for c in configs:
        s = sums.overall[c.key]
        lines.append(f"| {_md(c.label)} | {_num(s['mean_seconds'], '{:.2f}')} | {_num(s['mean_model_seconds'], '{:.2f}')} "
                     f"| {_num(s['mean_wait_seconds'], '{:.2f}')} | {_stages(s)} |")
    lines += ["", "## Configurations", "", "| label | config_key | system | model | samples | settings |",
              "|---|---|---|---|---|---|"]
    for c in configs:
        settings = ", ".join(f"{k}={_shown(v)}" for k, v in sorted(c.settings.items())) or "–"
        lines.append(f"| {_md(c.label)} | `{_md(c.key)}` | {_md(c.system)} | {_md(c.model) or '–'} | {c.samples} | "
                     f"{_md(settings)} |")
    lines += ["", "Metric definitions: see `evals/metrics.py`. Answer entropy needs `--samples` > 1."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ plots

def config_colours(labels: Sequence[str]) -> dict[str, str]:
    """One colour per configuration label, by its place in the report: every plot uses this mapping."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: matplotlib.colors.to_hex(palette(i % palette.N)) for i, label in enumerate(labels)}


@dataclass(frozen=True)
class Panel:
    """One metric over benchmark groups: a value (and interval) per configuration and group, or None."""
    title: str
    values: dict[str, list[float | None]]  # config key → value per group
    caption: list[str]
    intervals: dict[str, list[tuple[float, float] | None]] | None = None
    percent: bool = False


def _group_ticks(comparison: Comparison, sums: Summaries) -> list[str]:
    ticks = []
    for bench in sums.benchmarks + [ALL]:
        counts = sorted({(sums.overall[c.key] if bench == ALL else sums.by_benchmark[c.key].get(bench) or {"n": 0})["n"]
                         for c in comparison.configurations} - {0})
        n = "–" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
        ticks.append(f"{bench}\nn={n}")
    return ticks


def _metric(sums: Summaries, key: str, metric: str) -> list[float | None]:
    per_group = [sums.by_benchmark[key].get(b) for b in sums.benchmarks] + [sums.overall[key]]
    return [s[metric] if s and s["n"] else None for s in per_group]


def accuracy_panel(comparison: Comparison, sums: Summaries) -> Panel:
    caption = ["Accuracy with Wilson 95% interval, original option order only."]
    intervals = {}
    for c in comparison.configurations:
        per_group = [sums.by_benchmark[c.key].get(b) for b in sums.benchmarks] + [sums.overall[c.key]]
        intervals[c.key] = [tuple(s["ci95"]) if s and s["n"] else None for s in per_group]
        missing = [b for b in sums.benchmarks if b not in sums.by_benchmark[c.key]]
        if missing:
            caption.append(f"{c.label}: no answers on {', '.join(missing)}.")
    return Panel("accuracy", {c.key: _metric(sums, c.key, "accuracy") for c in comparison.configurations}, caption,
                 intervals, percent=True)


def _missing_caption(comparison: Comparison, sums: Summaries, metric: str, name: str, reason: Any) -> list[str]:
    """Configurations without a value: for all their answers (grouped by `reason`), or on some benchmarks."""
    without: dict[str, list[str]] = {}
    lines = []
    for c in comparison.configurations:
        values = _metric(sums, c.key, metric)
        if not sums.overall[c.key]["n"]:
            continue
        if values[-1] is None:
            without.setdefault(reason(c), []).append(c.label)
        elif missing := [b for b, v in zip(sums.benchmarks, values) if v is None and b in sums.by_benchmark[c.key]]:
            lines.append(f"{c.label}: no {name} on {', '.join(missing)}.")
    return [f"{'; '.join(labels)}: no {name} — {why}." for why, labels in without.items()] + lines


def entropy_panels(comparison: Comparison, sums: Summaries) -> list[Panel]:
    def token_reason(c: Configuration) -> str:
        return NO_TOKEN_ENTROPY

    def answer_reason(c: Configuration) -> str:
        return (f"{NEEDS_SAMPLES} (ran with --samples {c.samples})" if c.samples <= 1
                else "no question has more than one recorded sample yet")

    return [Panel("mean token entropy (nats)",
                  {c.key: _metric(sums, c.key, "token_entropy") for c in comparison.configurations},
                  ["Token entropy: mean entropy of the model's next-token distribution over the respondent's tokens."]
                  + _missing_caption(comparison, sums, "token_entropy", "token entropy", token_reason)),
            Panel("answer entropy (nats)",
                  {c.key: _metric(sums, c.key, "answer_entropy") for c in comparison.configurations},
                  ["Answer entropy: entropy of one configuration's sampled answers to one question, averaged."]
                  + _missing_caption(comparison, sums, "answer_entropy", "answer entropy", answer_reason))]


def _draw_panel(ax: Any, panel: Panel, comparison: Comparison, colours: dict[str, str], ticks: list[str]) -> None:
    configs = comparison.configurations
    width = 0.8 / max(len(configs), 1)
    crowded = len(configs) * len(ticks) > 12
    tops = [0.0]  # bar heights, for the headroom their labels need
    for i, c in enumerate(configs):
        offset = (i - (len(configs) - 1) / 2) * width
        xs = [g + offset for g, v in enumerate(panel.values[c.key]) if v is not None]
        ys = [v for v in panel.values[c.key] if v is not None]
        errors = None
        if panel.intervals is not None:
            bounds = [b for b, v in zip(panel.intervals[c.key], panel.values[c.key]) if v is not None]
            # matplotlib refuses negative error bars; the Wilson interval always holds the rate
            errors = [[max(0.0, y - b[0]) for y, b in zip(ys, bounds)], [max(0.0, b[1] - y) for y, b in zip(ys, bounds)]]
        ax.bar(xs, ys, width, color=colours[c.label], yerr=errors, capsize=2,
               error_kw={"elinewidth": 0.8, "ecolor": "#555555"})
        for x, y in zip(xs, ys):
            # At the bar's own height (a 0 bar reads "0%" on the axis), boxed so an error bar never hides it.
            text = f"{100 * y:.0f}%" if panel.percent else f"{y:.2f}"
            ax.annotate(text, (x, y), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=7, rotation=90 if crowded else 0,
                        bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
            tops.append(y)
    headroom = 1.3 if crowded else 1.15
    ax.set_ylim(0, 1.0 * headroom if panel.percent else max(max(tops) * headroom, 0.1))
    if panel.percent:
        ax.set_yticks([i / 5 for i in range(6)], [f"{20 * i}%" for i in range(6)])
    ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
    ax.set_xlim(-0.5, len(ticks) - 0.5)
    ax.set_ylabel(panel.title)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if not any(v is not None for values in panel.values.values() for v in values):
        ax.text(0.5, 0.5, f"no {panel.title} recorded for any configuration (see below)", ha="center",
                transform=ax.transAxes, fontsize=9, color="#555555")


def _caption_text(lines: list[str], width_inches: float) -> str:
    wrap = max(40, int(width_inches * 15))
    return "\n".join(textwrap.fill(line, wrap, subsequent_indent="    ") for line in lines)


def plot_panels(panels: list[Panel], comparison: Comparison, sums: Summaries, colours: dict[str, str],
                path: Path) -> Path:
    """Stacked panels, each with its caption below; one legend for the figure, outside the plot area."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ticks = _group_ticks(comparison, sums)
    totals = {c.key: sums.overall[c.key]["n"] for c in comparison.configurations}
    width = max(7.0, 0.9 + len(ticks) * (0.3 + 0.28 * len(comparison.configurations)))
    captions = [_caption_text(p.caption, width) for p in panels]
    panel_height = max(3.2, 0.28 * width)  # many bars: a taller panel, so the figure stays readable when scaled
    heights = [panel_height + 0.16 * (caption.count("\n") + 1) for caption in captions]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width + 2.5, sum(heights)), layout="constrained",
                             height_ratios=heights, squeeze=False)
    for i, (panel, caption) in enumerate(zip(panels, captions)):
        ax = axes[i][0]
        _draw_panel(ax, panel, comparison, colours, ticks)
        # The caption is the axis label: the layout keeps it under the tick labels, never over the bars.
        ax.set_xlabel(caption, loc="left", fontsize=8, linespacing=1.4)
    # Every configuration is in the legend, also one with no bars here: its colour is the same in every plot.
    handles = [Patch(color=colours[c.label], label=f"{c.label} (n={totals[c.key]})") for c in comparison.configurations]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="configuration", title_fontsize=8,
               frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_report(rows: list[dict[str, Any]], out_dir: Path, comparison: Comparison | None = None) -> list[Path]:
    comparison = comparison or compare_configurations(rows)
    sums = summaries(original_order_rows(rows), comparison)
    colours = config_colours([c.label for c in comparison.configurations])
    return [plot_panels([accuracy_panel(comparison, sums)], comparison, sums, colours, out_dir / "accuracy.png"),
            plot_panels(entropy_panels(comparison, sums), comparison, sums, colours, out_dir / "entropy.png")]


# ------------------------------------------------------------------------------------------------ sections

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
        judged = quality["judge"]["summary"].items()
        lines += ["", f"Judge {judge}: " + ", ".join(f"{k}={_num(v['mean'])} (n={v['n']})" for k, v in judged)]
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
    warnings = [f"dropped {n} duplicate rows from {folder} (same configuration, benchmark, question, sample and "
                "option order as a row loaded before it; the first is kept)." for folder, n in loaded.duplicates.items()]
    warnings += [f"skipped {n} rows without a benchmark or question id in {folder}."
                 for folder, n in loaded.malformed.items()]
    return warnings


def summary_record(comparison: Comparison, sums: Summaries, loaded: LoadedResults) -> dict[str, Any]:
    main = original_order_rows(loaded.rows)
    return {
        "configurations": {c.label: {"config_key": c.key, "system": c.system, "model": c.model, "samples": c.samples,
                                     "settings": c.settings, "overall": sums.overall[c.key],
                                     "by_benchmark": sums.by_benchmark[c.key]}
                           for c in comparison.configurations},
        "differs_in": list(comparison.differs),
        "differences": comparison.differs,
        "shares": comparison.shares,
        "system_specific": comparison.own,
        # counts only: pooling configurations' accuracies would hide what differs between them
        "overall": {"n": len(main), "questions": len({(r["benchmark"], r["question_id"]) for r in main}),
                    "configurations": len(comparison.configurations), "permuted_rows": len(loaded.rows) - len(main)},
        "duplicates_dropped": loaded.duplicates_dropped,
        "duplicates_by_folder": loaded.duplicates,
    }


def write_report(result_dirs: list[str], out_dir: str | Path, *, trace_db: str | None = None,
                 corpus_dir: str | None = None, qrels: str | None = None, judge: str | None = None,
                 base_url: str | None = None) -> dict[str, Any]:
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
    text += panel_section(rows, {c.key: c.label for c in comparison.configurations})
    if trace_db:
        text += rag_quality_section(result_dirs, trace_db, corpus_dir, qrels, judge, base_url, out)
    (out / "report.md").write_text(text, encoding="utf-8")
    sums = summaries(original_order_rows(rows), comparison)
    record = {**summary_record(comparison, sums, loaded), "position_bias": bias_summary, "panel": panel_summary(rows)}
    (out / "summary.json").write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
    plots = plot_report(rows, out, comparison)
    return {"report": str(out / "report.md"), "plots": [str(p) for p in plots], "rows": len(rows),
            "configurations": [c.label for c in comparison.configurations],
            "duplicates_dropped": loaded.duplicates_dropped, "warnings": warnings}
