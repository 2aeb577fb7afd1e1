"""Shared fixtures. Tests run offline: nothing here reaches the network."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from ermedrag.offline import OFFLINE_ENV
from ermedrag.testing.processes import free_port, log_tail, stop_process_group  # noqa: F401 - tests import them here

# Tests never reach the network, whatever the shell says; the processes they start inherit this.
os.environ.update(OFFLINE_ENV)

# Under pytest-xdist (`make test` runs two workers) each worker and what it starts (servers, benches, llama.cpp)
# gets its share of the cores: two workers at full thread counts on 2 cores oversubscribe them, and every
# thread then waits on the others. Set before torch is imported; an explicit setting wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for _name in ("OMP_NUM_THREADS", "ERMEDRAG_TORCH_THREADS", "ERMEDRAG_LLAMACPP_THREADS"):
        os.environ.setdefault(_name, str(max(1, _cores // _WORKERS)))

REPO = Path(__file__).resolve().parents[1]
# Tests of the llamacpp: backend: `make test-all` builds llama-cpp-python from source; `make test` leaves them out.
LLAMACPP_MARKS = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed (make llamacpp)"
    ),
]


def needs_llamacpp(test):
    for mark in LLAMACPP_MARKS:
        test = mark(test)
    return test


SCRIPTED = "scripted:ermedrag.testing.scripted"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared benchmark/corpus folder (ERMEDRAG_SHARED_DATA, else ../shared/data beside the repo)."""
    path = Path(os.environ.get("ERMEDRAG_SHARED_DATA", REPO.parent / "shared" / "data"))
    if not (path / "corpora").is_dir():
        pytest.skip(f"shared data not found at {path}: set ERMEDRAG_SHARED_DATA to the shared/data folder")
    return path


@pytest.fixture
def scripted_context(tmp_path: Path) -> dict[str, str]:
    """Graph context with the scripted model for both agents, the starter index and a fresh trace db."""
    return {
        "extractor_model": SCRIPTED,
        "respondent_model": SCRIPTED,
        "trace_db": str(tmp_path / "traces.sqlite"),
    }


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run faster on one thread, and much faster when another process holds a core."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny randomly initialised causal LM saved to a folder (`ermedrag.testing.build_tiny_causal_lm`)."""
    from ermedrag.testing.tiny_model import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "model")
