"""The report's plots: accuracy with its intervals, and answer and token entropy, one bar per configuration and benchmark; a panel with no data is left out and its caption says why."""

from __future__ import annotations
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence
from ermedrag.evals.metrics import NEEDS_SAMPLES, original_order_rows
from ermedrag.evals.report.results import Configuration, Comparison, compare_configurations, Summaries, summaries, ALL


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

    @property
    def has_data(self) -> bool:
        return any(v is not None for values in self.values.values() for v in values)

    def why_empty(self) -> str:
        """Why the panel has no data: its caption's lines after the metric's definition say which
        configurations lack the value and why (`_missing_caption`)."""
        why = " ".join(self.caption[1:]) or "no configuration has answers."
        return f"{self.title[:1].upper()}{self.title[1:]}: {why}"


def _group_ticks(comparison: Comparison, sums: Summaries) -> list[str]:
    ticks = []
    for bench in sums.benchmarks + [ALL]:
        counts = sorted(
            {
                (sums.overall[c.key] if bench == ALL else sums.by_benchmark[c.key].get(bench) or {"n": 0})["n"]
                for c in comparison.configurations
            }
            - {0}
        )
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
    return Panel(
        "accuracy",
        {c.key: _metric(sums, c.key, "accuracy") for c in comparison.configurations},
        caption,
        intervals,
        percent=True,
    )


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
        return (
            f"{NEEDS_SAMPLES} (ran with --samples {c.samples})"
            if c.samples <= 1
            else "no question has more than one recorded sample yet"
        )

    return [
        Panel(
            "mean token entropy (nats)",
            {c.key: _metric(sums, c.key, "token_entropy") for c in comparison.configurations},
            ["Token entropy: mean entropy of the model's next-token distribution over the respondent's tokens."]
            + _missing_caption(comparison, sums, "token_entropy", "token entropy", token_reason),
        ),
        Panel(
            "answer entropy (nats)",
            {c.key: _metric(sums, c.key, "answer_entropy") for c in comparison.configurations},
            ["Answer entropy: entropy of one configuration's sampled answers to one question, averaged."]
            + _missing_caption(comparison, sums, "answer_entropy", "answer entropy", answer_reason),
        ),
    ]


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
            errors = [
                [max(0.0, y - b[0]) for y, b in zip(ys, bounds)],
                [max(0.0, b[1] - y) for y, b in zip(ys, bounds)],
            ]
        ax.bar(
            xs,
            ys,
            width,
            color=colours[c.label],
            yerr=errors,
            capsize=2,
            error_kw={"elinewidth": 0.8, "ecolor": "#555555"},
        )
        for x, y in zip(xs, ys):
            # At the bar's own height (a 0 bar reads "0%" on the axis), boxed so an error bar never hides it.
            text = f"{100 * y:.0f}%" if panel.percent else f"{y:.2f}"
            ax.annotate(
                text,
                (x, y),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90 if crowded else 0,
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
            )
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


def _caption_text(lines: list[str], width_inches: float) -> str:
    wrap = max(40, int(width_inches * 15))
    return "\n".join(textwrap.fill(line, wrap, subsequent_indent="    ") for line in lines)


def shown_panels(panels: list[Panel]) -> list[Panel]:
    """The panels with data, the last one's caption extended by why each other one is left out (an empty panel
    is an empty frame that reads as a failed plot). Empty when no panel has data."""
    shown = [p for p in panels if p.has_data]
    omitted = [f"Not plotted. {p.why_empty()}" for p in panels if not p.has_data]
    if shown and omitted:
        shown[-1] = replace(shown[-1], caption=shown[-1].caption + omitted)
    return shown


def plot_panels(
    panels: list[Panel], comparison: Comparison, sums: Summaries, colours: dict[str, str], path: Path
) -> Path | None:
    """Stacked panels, each with its caption below; one legend for the figure, outside the plot area.

    Panels without data are left out (`shown_panels`); with none left no file is written, an older one at
    `path` is removed (it would show another run's numbers), and None is returned: `unplotted` says why."""
    panels = shown_panels(panels)
    if not panels:
        path.unlink(missing_ok=True)
        return None
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
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(width + 2.5, sum(heights)), layout="constrained", height_ratios=heights, squeeze=False
    )
    for i, (panel, caption) in enumerate(zip(panels, captions)):
        ax = axes[i][0]
        _draw_panel(ax, panel, comparison, colours, ticks)
        # The caption is the axis label: the layout keeps it under the tick labels, never over the bars.
        ax.set_xlabel(caption, loc="left", fontsize=8, linespacing=1.4)
    # Every configuration is in the legend, also one with no bars here: its colour is the same in every plot.
    handles = [Patch(color=colours[c.label], label=f"{c.label} (n={totals[c.key]})") for c in comparison.configurations]
    fig.legend(
        handles=handles, loc="outside right upper", fontsize=8, title="configuration", title_fontsize=8, frameon=False
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(comparison: Comparison, sums: Summaries) -> dict[str, list[Panel]]:
    """The report's plot files and the panels each may hold."""
    return {"accuracy.png": [accuracy_panel(comparison, sums)], "entropy.png": entropy_panels(comparison, sums)}


def unplotted(comparison: Comparison, sums: Summaries) -> list[str]:
    """One line per plot file that is not written because none of its panels has data, with why (the report
    prints them, so a missing file is explained where the reader looks for it)."""
    return [
        f"{name} is not written, none of its panels has data. " + " ".join(p.why_empty() for p in panels)
        for name, panels in figures(comparison, sums).items()
        if not shown_panels(panels)
    ]


def plot_report(rows: list[dict[str, Any]], out_dir: Path, comparison: Comparison | None = None) -> list[Path]:
    """The plot files written (a figure with no data is not: `unplotted`)."""
    comparison = comparison or compare_configurations(rows)
    sums = summaries(original_order_rows(rows), comparison)
    colours = config_colours([c.label for c in comparison.configurations])
    written = [
        plot_panels(panels, comparison, sums, colours, out_dir / name)
        for name, panels in figures(comparison, sums).items()
    ]
    return [path for path in written if path is not None]


NO_TOKEN_ENTROPY = (
    "no answer recorded it (it needs a backend that returns per-token distributions, hf/offline, "
    "and a final answer that is the respondent's own completion)"
)
