"""The panel section of a report: MMedAgent-RL's triage accuracy, its curriculum bucket mix, and the attending
against the specialists' own majority vote (both from the same runs, so the comparison is paired).

Rows of a panel graph carry `specialty`, `gold_specialty` (from `tools.specialties`, None when the benchmark's
metadata names none), `triage_correct` (triage itself named the gold specialty: a fallback to the default never
counts), `triage_fell_back`, `bucket`, `majority`, `majority_correct` and
`followed_majority` (`evals.runner.panel_fields`). Only rows in the original option order count.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping

from ermedrag.evals.metrics import original_order_rows, wilson_interval

BUCKETS = ("easy", "medium", "hard")


def _rate(flags: list[bool]) -> dict[str, Any]:
    n, hits = len(flags), sum(flags)
    return {"n": n, "rate": hits / n if n else None, "ci95": list(wilson_interval(hits, n))}


def panel_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Per configuration (`config_key`): triage accuracy over questions with a known gold specialty, the triage
    fallback rate, the bucket mix, the attending's and the specialists' majority's accuracy, and how often the
    attending followed the majority. None when no row comes from a panel graph."""
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in original_order_rows(rows):
        if "specialty" in row:
            groups[row["config_key"]].append(row)
    if not groups:
        return None
    return {key: _config_summary(group) for key, group in groups.items()}


def _config_summary(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    config = rows[0].get("config") or {}
    labelled = [bool(r["triage_correct"]) for r in rows if r.get("triage_correct") is not None]
    buckets = Counter(r.get("bucket") or "unknown" for r in rows)
    followed = [bool(r["followed_majority"]) for r in rows if r.get("followed_majority") is not None]
    return {
        "system": config.get("system"),
        "model": config.get("model"),
        "n": len(rows),
        "triage": {
            **_rate(labelled),
            "unlabelled": len(rows) - len(labelled),
            "fell_back": sum(bool(r.get("triage_fell_back")) for r in rows),
            "specialties": dict(Counter(r.get("specialty") or "none" for r in rows).most_common()),
        },
        "buckets": {name: buckets.get(name, 0) for name in (*BUCKETS, "unknown")},
        "attending": _rate([bool(r.get("correct")) for r in rows]),
        "majority_vote": _rate([bool(r.get("majority_correct")) for r in rows]),
        "followed_majority": _rate(followed),
    }


def _cell(entry: Mapping[str, Any]) -> str:
    if entry["rate"] is None:
        return "–"
    low, high = entry["ci95"]
    return f"{100 * entry['rate']:.1f} [{100 * low:.0f}–{100 * high:.0f}] (n={entry['n']})"


def panel_section(rows: Iterable[Mapping[str, Any]], labels: Mapping[str, str] | None = None) -> str:
    """The report's "Panel" section (markdown), or "" without panel rows. `labels`: config_key → the report's
    label for that configuration (default: system and model)."""
    summary = panel_summary(rows)
    if summary is None:
        return ""
    lines = [
        "",
        "## Panel (MMedAgent-RL)",
        "",
        "Triage accuracy counts questions whose benchmark metadata names a specialty (`tools/data/specialties.py`: "
        "MedMCQA subject, MedXpertQA body system); others are unlabelled, not wrong. Buckets: the share s of "
        "specialists who were right (easy s = 1, medium 0 < s < 1, hard s = 0). The majority vote is the "
        "specialists' most common answer in the same runs (a tie goes to the answer given first, as in the "
        "attending's own vote): the attending should beat it.",
        "",
        "| configuration | triage accuracy | unlabelled | fell back | easy / medium / hard | attending "
        "accuracy | majority-vote accuracy | followed majority |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        label = (labels or {}).get(key) or f"{s['system']} · {s['model']}"
        mix = " / ".join(str(s["buckets"][name]) for name in BUCKETS)
        lines.append(
            f"| {label} | {_cell(s['triage'])} | {s['triage']['unlabelled']} | {s['triage']['fell_back']} | "
            f"{mix} | {_cell(s['attending'])} | {_cell(s['majority_vote'])} | "
            f"{_cell(s['followed_majority'])} |"
        )
    return "\n".join(lines) + "\n"
