"""Reports over hand-written result rows: configurations kept apart, duplicates dropped, honest entropy, plots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from ermedrag.evals.metrics import NEEDS_SAMPLES
from ermedrag.evals.report import compare_configurations, config_colours, load_results, write_report
from ermedrag.evals.runner import RESULTS

COT = {"respondent_model": "offline:gemma3-270m", "temperature": 0.0, "respondent_max_new_tokens": 192}


def config(system: str, model: str, samples: int = 1, **settings: Any) -> dict[str, Any]:
    return {
        "system": system,
        "model": model,
        "samples": samples,
        "settings": {**COT, "respondent_model": model, **settings},
    }


def row(
    key: str,
    cfg: dict[str, Any],
    bench: str,
    qid: str,
    *,
    answer: str | None = "A",
    gold: str = "A",
    sample: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "config_key": key,
        "config": cfg,
        "benchmark": bench,
        "question_id": qid,
        "subject": "",
        "sample": sample,
        "gold": gold,
        "answer": answer,
        "ok": answer is not None,
        "well_formed": True,
        "extracted": False,
        "correct": answer == gold,
        "error": None,
        "run_id": f"{key}-{qid}-{sample}",
        "timings": {"respond_s": 1.5},
        "seconds": 1.6,
        "output_tokens": 20,
        "token_entropy": 0.8,
        **extra,
    }


def write_rows(folder: Path, rows: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Run A: er_medrag on gemma with snippets_k=6; run B: er_medrag on an openai model with snippets_k=8.
    A gets 3 of 4 medqa right and 0 of 2 pubmedqa; B gets all right."""
    a = config("er_medrag", "offline:gemma3-270m", snippets_k=6)
    b = config("er_medrag", "openai:x", snippets_k=8)
    run_a = [row("ka", a, "medqa", f"q{i}", answer="A" if i < 3 else "B") for i in range(4)]
    run_a += [row("ka", a, "pubmedqa", f"p{i}", answer="C") for i in range(2)]
    run_b = [row("kb", b, "medqa", f"q{i}", token_entropy=None, model_seconds=0.4, wait_seconds=0.9) for i in range(4)]
    run_b += [
        row("kb", b, "pubmedqa", f"p{i}", token_entropy=None, model_seconds=0.2, wait_seconds=0.1) for i in range(2)
    ]
    return write_rows(tmp_path / "a", run_a), write_rows(tmp_path / "b", run_b)


def test_two_configurations_stay_apart_and_the_header_says_what_differs(tmp_path):
    run_a, run_b = two_runs(tmp_path)
    written = write_report([str(run_a), str(run_b)], tmp_path / "out")
    text = Path(written["report"]).read_text()
    header = text.splitlines()[2]
    assert header.startswith("Configurations differ in: model (offline:gemma3-270m vs openai:x), snippets_k (6 vs 8)")
    assert "They share: system=er_medrag, samples=1, temperature=0.0, respondent_max_new_tokens=192." in text
    assert written["configurations"] == ["er_medrag · gemma3-270m · snippets_k=6", "er_medrag · x · snippets_k=8"]
    assert (
        "| er_medrag · gemma3-270m · snippets_k=6 | offline:gemma3-270m | 75.0 [30–95] (n=4) | 0.0 [0–66] (n=2) "
        "| 50.0 [19–81] (n=6) |" in text
    )
    assert "| er_medrag · x · snippets_k=8 | openai:x | 100.0 [51–100] (n=4) |" in text
    assert "| er_medrag · gemma3-270m · snippets_k=6 | `ka` | er_medrag | offline:gemma3-270m | 1 |" in text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["differs_in"] == ["model", "snippets_k"] and summary["duplicates_dropped"] == 0
    gemma = summary["configurations"]["er_medrag · gemma3-270m · snippets_k=6"]
    assert gemma["config_key"] == "ka" and gemma["settings"]["snippets_k"] == 6
    assert gemma["overall"]["accuracy"] == 0.5 and gemma["by_benchmark"]["medqa"]["accuracy"] == 0.75
    assert summary["overall"]["n"] == 12 and summary["overall"]["configurations"] == 2
    # latency: new fields where recorded, "–" where not, and one line saying which is which
    assert "| er_medrag · x · snippets_k=8 | 1.60 | 0.33 | 0.63 | respond_s=1.50 |" in text
    assert "| er_medrag · gemma3-270m · snippets_k=6 | 1.60 | – | – | respond_s=1.50 |" in text
    assert "Stage time = wall time of a graph node, including time spent waiting for a batch" in text


def test_the_same_key_in_two_folders_is_kept_once_with_a_warning(tmp_path):
    run_a, _ = two_runs(tmp_path)
    copy = write_rows(tmp_path / "copy", [json.loads(line) for line in (run_a / RESULTS).read_text().splitlines()][:4])
    written = write_report([str(run_a), str(copy)], tmp_path / "out")
    assert written["duplicates_dropped"] == 4 and written["rows"] == 6
    text = Path(written["report"]).read_text()
    assert f"**Warning:** dropped 4 duplicate rows from {copy} (same configuration" in text
    assert "(n=6) |" in text and "(n=10)" not in text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["duplicates_by_folder"] == {str(copy): 4}
    # another option order or sample of the same question is not a duplicate
    gemma = config("er_medrag", "offline:gemma3-270m", snippets_k=6)
    other = write_rows(
        tmp_path / "other", [row("ka", gemma, "medqa", "q0", order=2), row("ka", gemma, "medqa", "q0", sample=1)]
    )
    assert load_results([run_a, other]).duplicates_dropped == 0
    # one configuration over several folders is one row
    more = write_rows(tmp_path / "more", [row("ka", gemma, "medqa", "q9")])
    text = Path(write_report([str(run_a), str(more)], tmp_path / "merged")["report"]).read_text()
    assert "| er_medrag | offline:gemma3-270m | 80.0 [38–96] (n=5) | 0.0 [0–66] (n=2) | 57.1 [25–84] (n=7) |" in text


def test_answer_entropy_is_absent_with_one_sample_and_per_configuration_with_three(tmp_path):
    single = config("cot", "offline:gemma3-270m")
    sampled = config("cot", "offline:gemma3-270m", samples=3, temperature=0.7)
    rows = [row("one", single, "medqa", f"q{i}") for i in range(3)]
    # sampled: medqa q0 answers A,A,B (H = ln3 - 2/3 ln2), q1 A,A,A (0); pubmedqa p0 A,B,C (ln 3)
    for qid, answers, bench in (("q0", "AAB", "medqa"), ("q1", "AAA", "medqa"), ("p0", "ABC", "pubmedqa")):
        rows += [row("three", sampled, bench, qid, answer=a, sample=s) for s, a in enumerate(answers)]
    written = write_report([str(write_rows(tmp_path / "run", rows))], tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["configurations"]
    one, three = summary["cot · samples=1 · temperature=0.0"], summary["cot · samples=3 · temperature=0.7"]
    assert one["overall"]["answer_entropy"] is None and one["overall"]["answer_entropy_note"] == NEEDS_SAMPLES
    assert one["by_benchmark"]["medqa"]["answer_entropy"] is None
    h_aab = math.log(3) - 2 / 3 * math.log(2)
    assert math.isclose(three["by_benchmark"]["medqa"]["answer_entropy"], h_aab / 2)
    assert math.isclose(three["by_benchmark"]["pubmedqa"]["answer_entropy"], math.log(3))
    assert math.isclose(three["overall"]["answer_entropy"], (h_aab + math.log(3)) / 3)
    text = Path(written["report"]).read_text()
    assert f"| cot · samples=1 · temperature=0.0 | 0.000 | 1.000 | 0.000 | – ({NEEDS_SAMPLES}) | 0.800 | 20 |" in text
    assert "### Answer entropy per benchmark (nats)" in text


def test_permuted_rows_stay_out_of_the_main_tables_and_feed_position_bias(tmp_path, monkeypatch):
    cfg = config("cot", "offline:gemma3-270m")
    rows = [
        row("k", cfg, "medqa", "q0", orders=3, answer_position="A", gold_position="A"),
        row("k", cfg, "medqa", "q0", answer="B", order=1, orders=3, answer_position="A", gold_position="C"),
        row("k", cfg, "medqa", "q0", answer="C", order=2, orders=3, answer_position="A", gold_position="B"),
    ]
    run = write_rows(tmp_path / "run", rows)
    written = write_report([str(run)], tmp_path / "out")
    text = Path(written["report"]).read_text()
    assert "100.0 [21–100] (n=1)" in text and "2 answers to permuted options are left out" in text
    assert "## Position bias" in text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["position_bias"]["k"]["consistency"]["rate"] == 0.0
    assert summary["overall"] == {"n": 1, "questions": 1, "configurations": 1, "permuted_rows": 2}
    # without the position-bias module the report is still written, without that section
    monkeypatch.setitem(sys.modules, "ermedrag.evals.position_bias", None)
    write_report([str(run)], tmp_path / "bare")
    assert "## Position bias" not in (tmp_path / "bare" / "report.md").read_text()
    assert json.loads((tmp_path / "bare" / "summary.json").read_text())["position_bias"] is None


def test_old_rows_without_the_new_fields_still_report(tmp_path):
    old_config = {
        "system": "cot",
        "model": "offline:gemma3-270m",
        "index_dir": "",
        "snippets_k": 4,
        "temperature": 0.0,
        "samples": 1,
    }
    old = [
        {
            "config_key": "9a65",
            "config": old_config,
            "benchmark": "medqa",
            "question_id": f"q{i}",
            "sample": 0,
            "gold": "A",
            "answer": "A",
            "ok": True,
            "well_formed": True,
            "correct": True,
            "error": None,
            "run_id": "r",
            "timings": {"respond_s": 2.0},
            "seconds": 2.0,
            "output_tokens": 5,
            "token_entropy": None,
        }
        for i in range(2)
    ]
    bare = [
        {
            "benchmark": "medqa",
            "question_id": "q9",
            "answer": "B",
            "correct": False,
            "ok": True,
            "config": {"system": "cot", "model": "m"},
        }
    ]
    written = write_report([str(write_rows(tmp_path / "old", old + bare))], tmp_path / "out")
    text = Path(written["report"]).read_text()
    assert text.splitlines()[2] == "Configurations differ in: model (m vs offline:gemma3-270m)."
    assert "| cot · gemma3-270m | offline:gemma3-270m | 100.0 [34–100] (n=2) |" in text
    assert "| cot · m | m | 0.0 [0–79] (n=1) |" in text
    assert "| 2.00 | – | – | respond_s=2.00 |" in text  # no model/wait seconds in old rows
    assert all(Path(p).stat().st_size > 1000 for p in written["plots"])


def test_every_plot_gives_a_configuration_the_same_colour(tmp_path):
    run_a, run_b = two_runs(tmp_path)
    rows = load_results([run_a, run_b]).rows
    labels = [c.label for c in compare_configurations(rows).configurations]
    colours = config_colours(labels)
    assert len(set(colours.values())) == 2
    assert config_colours(labels) == colours  # the same assignment for the accuracy and the entropy plot
    written = write_report([str(run_a), str(run_b)], tmp_path / "out")
    import matplotlib.image

    for path in written["plots"]:
        pixels = matplotlib.image.imread(path)[..., :3]
        present = {tuple(int(round(255 * c)) for c in p) for p in pixels.reshape(-1, 3)[::7]}
        for label in labels:  # B has no entropy bars, but its legend entry keeps its colour
            rgb = tuple(int(colours[label][i : i + 2], 16) for i in (1, 3, 5))
            assert rgb in present, (path, label)


@pytest.mark.parametrize("configs", [1, 4])
def test_plots_are_written_for_one_or_many_configurations(tmp_path, configs):
    rows = []
    for k in range(configs):
        cfg = config("er_medrag", "offline:gemma3-270m", snippets_k=2 + 2 * k)
        rows += [
            row(f"k{k}", cfg, bench, f"q{i}", answer="A" if i <= k else "B")
            for bench in ("medqa", "pubmedqa", "bioasq")
            for i in range(4)
        ]
    written = write_report([str(write_rows(tmp_path / "run", rows))], tmp_path / "out")
    assert [Path(p).name for p in written["plots"]] == ["accuracy.png", "entropy.png"]
    assert all(Path(p).stat().st_size > 5000 for p in written["plots"])
