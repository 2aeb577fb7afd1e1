"""The report's "Evidence and uncertainty" section: what answers cite, and how well their confidence ranks them.

Per configuration: the share of answers citing at least one evidence item they were shown, and of answers citing
one they were not (an invented citation); where the benchmark has gold evidence (PubMedQA: the question's own
abstract, BioASQ: its gold snippets; `tools.data.gold_evidence`), citation precision (cited documents that are
gold) and recall (gold documents shown to the model that it cited); the risk–coverage curve of answers ranked by
confidence with its AURC beside random abstention's (`evals.conformal.risk_coverage`); and, for answers given
with a conformal set or an abstention threshold, their coverage and size, or the share answered and its accuracy.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ermedrag.evals.conformal import risk_coverage
from ermedrag.tools.data.gold_evidence import GoldEvidence, benchmark_family, doc_id, gold_evidence

NOT_SCORED = "–"


def _share(hits: int, n: int) -> float | None:
    return hits / n if n else None


def _cell(value: float | None) -> str:
    return NOT_SCORED if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def citation_scores(row: Mapping[str, Any], gold: GoldEvidence) -> tuple[float | None, float | None]:
    """(precision, recall) of one answer's citations against its question's gold documents: precision over the
    shown items it cites (None when it cites none), recall over the gold documents it was shown (None when it was
    shown none)."""
    cited = [doc_id(c["doc_id"]) for c in row.get("citations") or [] if c.get("shown") and c.get("doc_id")]
    shown_gold = {d for d in map(doc_id, row.get("evidence_doc_ids") or []) if d in gold}
    precision = _share(sum(d in gold for d in cited), len(cited))
    recall = _share(len(shown_gold & set(cited)), len(shown_gold))
    return precision, recall


def _gold_for(
    row: Mapping[str, Any], qrels: str | None, corpus_dir: str | None, notes: set[str]
) -> GoldEvidence | None:
    if benchmark_family(str(row.get("benchmark") or "")) is None:
        return None
    try:
        return gold_evidence(str(row.get("question_id")), str(row["benchmark"]), qrels, corpus_dir)
    except FileNotFoundError as err:
        notes.add(str(err))
        return None


def evidence_summary(
    rows: Sequence[Mapping[str, Any]], qrels: str | None = None, corpus_dir: str | None = None
) -> dict[str, Any]:
    """Per configuration key: citation shares and scores, the risk–coverage summary, answer sets, abstention."""
    grouped: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        grouped[row["config_key"]].append(row)
    notes: set[str] = set()
    summary: dict[str, Any] = {}
    for key, group in grouped.items():
        with_citations = [r for r in group if "citations" in r]
        scores = [citation_scores(r, gold) for r in group if (gold := _gold_for(r, qrels, corpus_dir, notes))]
        precisions = [p for p, _ in scores if p is not None]
        recalls = [r for _, r in scores if r is not None]
        curve = risk_coverage(group)
        sets = [r for r in group if r.get("answer_set")]
        withheld = [r for r in group if "abstained" in r]
        answered = [r for r in withheld if not r["abstained"]]
        summary[key] = {
            "n": len(group),
            "n_with_citations_recorded": len(with_citations),
            "cites_shown_rate": _share(
                sum(any(c.get("shown") for c in r["citations"]) for r in with_citations), len(with_citations)
            ),
            "cites_unshown_rate": _share(
                sum(any(not c.get("shown") for c in r["citations"]) for r in with_citations), len(with_citations)
            ),
            "citation_precision": _share(sum(precisions), len(precisions)),
            "n_citation_precision": len(precisions),
            "citation_recall": _share(sum(recalls), len(recalls)),
            "n_citation_recall": len(recalls),
            "risk_coverage": {k: v for k, v in (curve or {}).items() if k not in ("coverage", "risk")} or None,
            "answer_sets": {
                "n": len(sets),
                "coverage": _share(
                    sum(r["answer"] is not None and r["gold"] in r["answer_set"] for r in sets), len(sets)
                ),
                "mean_set_size": _share(sum(len(r["answer_set"]) for r in sets), len(sets)),
                "alpha": sets[0].get("answer_set_alpha") if sets else None,
            }
            if sets
            else None,
            "abstention": {
                "n": len(withheld),
                "answered_rate": _share(len(answered), len(withheld)),
                "accuracy_answered": _share(sum(bool(r.get("correct")) for r in answered), len(answered)),
            }
            if withheld
            else None,
        }
    return {"configurations": summary, "notes": sorted(notes)}


def evidence_section(summary: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """The markdown of `evidence_summary`."""
    configs = summary["configurations"]
    lines = [
        "",
        "## Evidence and uncertainty",
        "",
        "Citations: share of answers citing an evidence item they were shown, and citing one they were not (an "
        "invented citation); against gold evidence (PubMedQA, BioASQ), precision (cited documents that are gold) and "
        "recall (gold documents shown that were cited), with n. AURC: area under the risk–coverage curve of answers "
        "ranked by confidence (lower is better); random abstention's AURC is the error rate.",
        "",
        "| configuration | cites shown | cites unshown | citation precision (n) | citation recall (n) | "
        "AURC | random AURC | n scored |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in configs.items():
        curve = s["risk_coverage"] or {}
        lines.append(
            f"| {labels.get(key, key)} | {_cell(s['cites_shown_rate'])} | {_cell(s['cites_unshown_rate'])} | "
            f"{_cell(s['citation_precision'])} ({s['n_citation_precision']}) | {_cell(s['citation_recall'])} "
            f"({s['n_citation_recall']}) | {_cell(curve.get('aurc'))} | {_cell(curve.get('random_aurc'))} | "
            f"{curve.get('n', 0)} |"
        )
    for key, s in configs.items():
        if s["answer_sets"]:
            a = s["answer_sets"]
            lines.append(
                f"\n{labels.get(key, key)}: conformal sets at alpha={a['alpha']} hold the gold option in "
                f"{_cell(a['coverage'])} of {a['n']} answers, {_cell(a['mean_set_size'])} options on average."
            )
        if s["abstention"]:
            a = s["abstention"]
            lines.append(
                f"\n{labels.get(key, key)}: answered {_cell(a['answered_rate'])} of {a['n']} questions "
                f"(abstaining below the threshold), accuracy of those answered {_cell(a['accuracy_answered'])}."
            )
    lines += [f"\nNote: {note}" for note in summary["notes"]]
    return "\n".join(lines) + "\n"


def plot_risk_coverage(rows: Sequence[Mapping[str, Any]], labels: Mapping[str, str], out: Path) -> Path | None:
    """`risk_coverage.png`: each configuration's curve and its random-abstention line; None without confidences."""
    curves = {key: risk_coverage([r for r in rows if r["config_key"] == key]) for key in labels}
    curves = {key: c for key, c in curves.items() if c}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, curve in curves.items():
        line = ax.plot(curve["coverage"], curve["risk"], label=f"{labels[key]} (AURC {curve['aurc']:.3f})")[0]
        ax.axhline(curve["random_aurc"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("coverage (share of answers given, most confident first)")
    ax.set_ylabel("risk (error rate of those given)")
    ax.set_title("Risk–coverage; dotted: random abstention")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "risk_coverage.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
