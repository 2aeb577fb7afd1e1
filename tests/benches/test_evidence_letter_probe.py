"""The evidence letter probe (benches/learning/evidence_letter_probe.py): the reasoning it writes for the model
quotes the very line that names the option, by the number the prompt shows; its `--smoke` run end to end (the
product's answer-scoring call on a tiny random model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.benches.test_learning_bench import bench_module
from tests.conftest import REPO

SCRIPT = REPO / "benches" / "learning" / "evidence_letter_probe.py"


def test_the_written_reasoning_quotes_the_line_naming_the_option_by_its_shown_number(shared_data: Path) -> None:
    probe, bench = bench_module("evidence_letter_probe"), bench_module("evidence_following")
    heldout, pool = bench.pools(shared_data, 300, 8)
    rows = [r for r in bench.heldout_rows(heldout, pool) if r["set"] in probe.SETS]
    for row in rows:
        number, line = probe.named_line(row)
        shown = row["prompt"][-1]["content"]
        assert f"\n{number}. [{line['snippet_id']}] " in f"\n{shown}"  # the number the model sees
        assert line["conclusion"] == row["options"][row["evidence_key"]]
        assert probe.reasoning(row, "quotes_conclusion") == (
            f"<think>Evidence [{number}] says {line['conclusion']}</think><answer>"
        )
        assert line["relation"] in probe.reasoning(row, "quotes_line")
        assert probe.reasoning(row, "no_quote") == "<think></think><answer>"
        # keys after the text: the letter follows the quoted text in the list as in the reasoning
        keyed = probe.keys_after_text(row["prompt"])[-1]["content"]
        assert f"{row['evidence_key']}. {line['conclusion']} ({row['evidence_key']})" in keyed
        assert probe.reasoning(row, "keys_after_text").endswith(f"says {line['conclusion']} (")
        assert keyed.split("\nOptions:\n")[0] == shown.split("\nOptions:\n")[0]  # only the options changed


def run_probe(shared_data: Path, work: Path, *args: str) -> dict:
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), "--smoke", "--data", str(shared_data), "--work", str(work), *args]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((work / "evidence_letter_probe.json").read_text())


def test_smoke_run_scores_every_variant_and_set(shared_data: Path, tmp_path: Path) -> None:
    first = run_probe(shared_data, tmp_path, "--variants", "no_quote")
    assert list(first["models"]["base"]) == ["path", "no_quote"]
    result = run_probe(shared_data, tmp_path, "--reuse")  # keeps the recorded variant, adds the others
    assert result["models"]["base"]["no_quote"] == first["models"]["base"]["no_quote"]
    assert result["chance"] == 0.25 and list(result["models"]) == ["base"]
    for variant in ("no_quote", "quotes_line", "quotes_conclusion", "keys_after_text"):
        for name in ("d0", "d2", "gold_evidence"):
            figure = result["models"]["base"][variant][name]
            assert figure["n"] == 4 and 0 <= figure["hits"] <= 4
