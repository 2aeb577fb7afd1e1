"""The entropy-bonus sweep (benches/learning/triage_entropy.py): its `--smoke` run end to end (real shared
questions, the real staged trainer on a tiny random model, one run per γ from the same start), the paired
per-step difference, and the options it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benches.learning import triage_entropy as sweep
from tests.conftest import REPO

SCRIPT = REPO / "benches" / "learning" / "triage_entropy.py"


@pytest.mark.slow  # three trainings and four evaluations: kept out of `make test`'s ten minutes
def test_smoke_sweep_trains_each_gamma_from_the_same_start_and_pairs_their_steps(
    shared_data: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "ERMEDRAG_TORCH_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--gammas",
            "0.1,1",
            "--data",
            str(shared_data),
            "--work",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = tmp_path / "smoke" / "triage_entropy.json"
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["gammas"] == [0.0, 0.1, 1.0]
    assert [run["gamma"] for run in result["runs"]] == [0.1, 1.0] and result["without_bonus"]["gamma"] == 0.0
    without = result["without_bonus"]["entropy_by_step"]
    assert len(without) == result["settings"]["triage_steps"] == 2
    for run in result["runs"]:
        diff = run["paired_difference"]
        assert diff["steps"] == 2 and len(run["entropy_by_step"]) == 2
        assert diff["by_step"][0] == pytest.approx(0, abs=1e-4)  # step 1: the same start, seed and rollouts
        assert diff["by_step"] == [pytest.approx(a - b, abs=1e-4) for a, b in zip(run["entropy_by_step"], without)]
        assert run["after"]["n"] == result["before"]["n"]
    assert set(result["baselines"]) == {"chance", "majority", "first_option", "copy_example", "keyword"}
    kept = sorted(p.name for p in (tmp_path / "smoke" / "triage_entropy_replies").iterdir())
    assert kept == [
        f"triage_{label}.jsonl.gz" for label in ("before", "gamma0.1_after", "gamma0_after", "gamma1_after")
    ]
    assert (tmp_path / "smoke" / "triage_entropy.png").is_file()


def test_paired_difference_counts_the_steps_both_runs_logged() -> None:
    diff = sweep.paired_difference([1.0, 1.5, 0.9], [1.0, 1.2, 1.0, 0.7])
    assert diff["by_step"] == [0.0, 0.3, -0.1] and diff["steps"] == 3 and diff["steps_higher"] == 1
    assert diff["mean"] == pytest.approx(0.06667, abs=1e-5)
    assert sweep.paired_difference([], [1.0])["mean"] is None


@pytest.mark.parametrize("gammas", ["0", "0.1,0.1", "-1", "inf", "a"])
def test_gammas_must_be_distinct_and_above_zero(gammas: str) -> None:
    with pytest.raises(SystemExit):
        sweep.parse_args(["--gammas", gammas])
