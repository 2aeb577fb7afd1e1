"""A report part with nothing to show says why instead of drawing or tabulating nothing (issue 38): entropy
panels without data are left out of the plot (no file when none is left), and an empty RAG-quality table is one
line with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from ermedrag.evals import rag_quality as rq
from ermedrag.evals.metrics import NEEDS_SAMPLES, original_order_rows
from ermedrag.evals.report import compare_configurations, load_results, write_report
from ermedrag.evals.report.plots import NO_TOKEN_ENTROPY, entropy_panels, figures, shown_panels, unplotted
from ermedrag.evals.report.results import summaries
from ermedrag.tools.records.traces import TraceStore
from tests.evals.test_report import config, row, write_rows


def _rows(token_entropy: float | None, samples: int = 1) -> list[dict]:
    cfg = config("er_medrag", "offline:gemma3-270m", samples=samples, snippets_k=4)
    return [
        row("k", cfg, bench, f"q{i}", answer="AB"[s % 2] if samples > 1 else "A", sample=s, token_entropy=token_entropy)
        for bench in ("medqa", "pubmedqa")
        for i in range(3)
        for s in range(samples)
    ]


def _sums(folder: Path):
    rows = load_results([folder]).rows
    comparison = compare_configurations(rows)
    return comparison, summaries(original_order_rows(rows), comparison)


# --------------------------------------------------------------------------------------------------- plots


def test_no_entropy_at_all_writes_no_entropy_plot_and_the_report_says_why(tmp_path):
    folder = write_rows(tmp_path / "run", _rows(token_entropy=None))
    out = tmp_path / "out"
    out.mkdir()
    (out / "entropy.png").write_bytes(b"an older run's plot")  # must not stay beside this report
    written = write_report([str(folder)], out)
    assert [Path(p).name for p in written["plots"]] == ["accuracy.png"]
    assert not (out / "entropy.png").exists()
    text = Path(written["report"]).read_text()
    line = next(
        line
        for line in text.splitlines()
        if line.startswith("entropy.png is not written, none of its panels has data. ")
    )
    assert "Mean token entropy (nats): er_medrag: no token entropy" in line and NO_TOKEN_ENTROPY in line
    assert "Answer entropy (nats): er_medrag: no answer entropy" in line and NEEDS_SAMPLES in line
    assert "--samples 1" in line
    comparison, sums = _sums(folder)
    assert unplotted(comparison, sums) == [line]


def test_a_panel_without_data_is_left_out_and_the_caption_says_why(tmp_path):
    folder = write_rows(tmp_path / "run", _rows(token_entropy=0.8))
    comparison, sums = _sums(folder)
    panels = entropy_panels(comparison, sums)
    assert [p.has_data for p in panels] == [True, False]
    shown = shown_panels(panels)
    assert [p.title for p in shown] == ["mean token entropy (nats)"]
    assert shown[0].caption[-1].startswith("Not plotted. Answer entropy (nats): er_medrag: no answer entropy")
    assert NEEDS_SAMPLES in shown[0].caption[-1]
    assert unplotted(comparison, sums) == []
    assert set(figures(comparison, sums)) == {"accuracy.png", "entropy.png"}

    one = write_report([str(folder)], tmp_path / "one")
    both = write_report([str(write_rows(tmp_path / "run3", _rows(token_entropy=0.8, samples=3)))], tmp_path / "both")
    assert (
        [Path(p).name for p in one["plots"]] == [Path(p).name for p in both["plots"]] == ["accuracy.png", "entropy.png"]
    )
    height = {name: matplotlib.image.imread(Path(w["plots"][1])).shape[0] for name, w in (("one", one), ("both", both))}
    assert height["one"] < 0.7 * height["both"]  # one panel, not one beside an empty frame
    assert "is not written" not in Path(one["report"]).read_text()


# ---------------------------------------------------------------------------------------------- RAG quality


def _section(text: str) -> list[str]:
    return [line for line in text.split("## RAG quality", 1)[1].splitlines() if line.strip()]


@pytest.fixture
def qrels(tmp_path: Path) -> Path:
    path = tmp_path / "qrels.jsonl"
    path.write_text(json.dumps({"id": "bioasq-q0", "question": "?", "type": "yesno", "gold": ["bioasq-g1"]}) + "\n")
    return path


def test_results_without_traces_say_so_instead_of_an_empty_table(tmp_path, qrels):
    cfg = config("vanilla_rag", "offline:gemma3-270m")
    rows = [row("k", cfg, "bioasq", f"bioasq-q{i}") for i in range(2)] + [row("k", cfg, "medqa", "m0")]
    folder = write_rows(tmp_path / "run", rows)
    trace_db = tmp_path / "empty.sqlite"
    TraceStore(trace_db)
    written = write_report([str(folder)], tmp_path / "out", trace_db=str(trace_db), qrels=str(qrels))
    section = _section(Path(written["report"]).read_text())
    assert not any(line.startswith("|") for line in section)
    reason = next(line for line in section if line.startswith("No context precision/recall"))
    assert reason == (
        "No context precision/recall: of 3 results, 2 without gold evidence (only PubMedQA and BioASQ questions "
        f"have it); 1 whose run is not in the trace database {trace_db} (run `ermedrag eval` with --trace-db)."
    )
    assert section[-1].startswith("Faithfulness and answer relevancy: not judged (pass --judge MODEL")


def test_no_gold_evidence_names_the_missing_qrels(tmp_path, monkeypatch):
    monkeypatch.delenv("ERMEDRAG_SHARED_DATA", raising=False)
    cfg = config("vanilla_rag", "offline:gemma3-270m")
    folder = write_rows(tmp_path / "run", [row("k", cfg, "bioasq", "bioasq-q0"), row("k", cfg, "medqa", "m0")])
    quality = rq.rag_quality([folder], tmp_path / "t.sqlite")
    reason = rq.empty_reason(quality)
    assert reason.startswith("No context precision/recall: of 2 results, 2 without gold evidence")
    assert "qrels" in reason and "\n" not in reason


def test_a_judge_with_nothing_to_judge_says_so(tmp_path, qrels):
    cfg = config("cot", "offline:gemma3-270m")
    folder = write_rows(tmp_path / "run", [row("k", cfg, "medqa", "m0")])
    trace_db = tmp_path / "t.sqlite"
    written = write_report(
        [str(folder)], tmp_path / "out", trace_db=str(trace_db), qrels=str(qrels), judge="scripted:nowhere"
    )
    section = _section(Path(written["report"]).read_text())
    assert section[-1].startswith("Judge scripted:nowhere: nothing to judge (no run of these results")
    saved = json.loads((tmp_path / "out" / "rag_quality.json").read_text())
    assert saved["judge"]["rows"] == [] and saved["trace_db"] == str(trace_db)


def test_no_reason_when_something_was_scored():
    quality = {"groups": [{"system": "s"}], "skipped": {"no_gold": 3, "no_run": 0, "no_retrieval": 0}, "notes": []}
    assert rq.empty_reason(quality) is None
    assert rq.empty_reason({"groups": [], "skipped": {"no_gold": 0}, "notes": []}) == (
        "No context precision/recall: the results hold no rows."
    )
