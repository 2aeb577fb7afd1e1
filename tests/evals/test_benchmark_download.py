"""A benchmark that cannot be downloaded is one clear error naming it and `--data`, never a traceback (issue 38).

Nothing here reaches the network: the hub loader and urlopen are replaced by ones raising what `datasets`,
`huggingface_hub` and urllib raise offline; the one real attempt runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ermedrag.cli import main
from ermedrag.tools.data import benchmarks
from ermedrag.tools.data.benchmarks import BENCHMARKS, HUB_DATASETS, BenchmarkUnavailable, load_benchmark

HUB_BENCHMARKS = [name for name in BENCHMARKS if name != "bioasq"]


def _offline_errors() -> list[BaseException]:
    """What a hub download raises without a network: datasets' ConnectionError (its wording), huggingface_hub's
    OfflineModeIsEnabled, a gated dataset's DatasetNotFoundError, httpx's own ConnectError."""
    import httpx
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub.errors import OfflineModeIsEnabled

    return [
        ConnectionError("Couldn't reach 'GBaker/MedQA-USMLE-4-options' on the Hub (OfflineModeIsEnabled)"),
        OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled."),
        DatasetNotFoundError("Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub."),
        httpx.ConnectError("[Errno -2] Name or service not known"),
    ]


@pytest.fixture
def no_shared_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ERMEDRAG_SHARED_DATA", raising=False)


@pytest.mark.parametrize("error", range(4))
@pytest.mark.parametrize("name", HUB_BENCHMARKS)
def test_an_unreachable_hub_is_one_error_naming_the_benchmark_and_data(monkeypatch, no_shared_data, name, error):
    raised = _offline_errors()[error]

    def load_dataset(*args, **kwargs):
        raise raised

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    with pytest.raises(BenchmarkUnavailable) as caught:
        load_benchmark(name)
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)  # the CLI prints it as one line
    assert f"cannot download benchmark {name!r} from the Hugging Face hub dataset {HUB_DATASETS[name]} (" in message
    assert type(raised).__name__ in message and "--data DIR" in message and "ERMEDRAG_SHARED_DATA" in message
    assert all(f"benchmarks/{f}" in message for f in BENCHMARKS[name].local_files)
    assert "\n" not in message and caught.value.__cause__ is raised


def test_an_unreachable_mirage_file_is_one_error_for_bioasq(monkeypatch, no_shared_data):
    def urlopen(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(
        BenchmarkUnavailable,
        match=r"cannot download benchmark 'bioasq' from https://.*URLError.*"
        r"benchmarks/bioasq_yesno.jsonl\) or set ERMEDRAG_SHARED_DATA",
    ):
        load_benchmark("bioasq")


def test_other_errors_of_the_loader_are_not_disguised(monkeypatch, no_shared_data):
    """A bug (a wrong config name) is a traceback to fix, not a hint to use --data."""

    def load_dataset(*args, **kwargs):
        raise ValueError("BuilderConfig 'x' not found")

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    with pytest.raises(ValueError, match="BuilderConfig") as caught:
        load_benchmark("medqa")
    assert not isinstance(caught.value, BenchmarkUnavailable)


def test_the_cli_prints_one_line(monkeypatch, no_shared_data, tmp_path, capsys):
    monkeypatch.setattr("datasets.load_dataset", lambda *a, **k: (_ for _ in ()).throw(_offline_errors()[0]))
    assert main(["eval", "--bench", "medqa", "--out", str(tmp_path / "out"), "--limit", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot download benchmark 'medqa'") and "\n" not in err


def test_a_real_attempt_offline_is_one_line(tmp_path: Path):
    """A fresh process with HF_HUB_OFFLINE=1 and an empty hub cache: what a user without internet sees."""
    env = {k: v for k, v in os.environ.items() if k != "ERMEDRAG_SHARED_DATA"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-m", "ermedrag", "eval", "--bench", "medqa", "--out", str(tmp_path / "out"), "--limit", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot download benchmark 'medqa' from the Hugging Face hub dataset GBaker/")
    assert "--data DIR" in last


def test_hub_rows_are_passed_through(monkeypatch):
    rows = [{"question": "q", "options": {"A": "a", "B": "b"}, "answer_idx": "A"}]
    monkeypatch.setattr("datasets.load_dataset", lambda *a, **k: rows)
    assert list(benchmarks._hub(benchmarks.HUB_DATASETS["medqa"], None, "test")) == rows


def test_every_hub_benchmark_has_its_dataset_named():
    assert set(benchmarks.HUB_DATASETS) == set(BENCHMARKS) - {"bioasq"}
