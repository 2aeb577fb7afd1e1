"""The offline settings that tests, benches and their children run with: an explicit setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

from ermedrag.offline import OFFLINE_ENV, offline_env


def test_a_child_environment_keeps_the_callers_settings_and_adds_only_what_is_missing() -> None:
    base = {"HF_HUB_OFFLINE": "0", "PATH": "/usr/bin"}
    env = offline_env({"ERMEDRAG_TORCH_THREADS": "1"}, base=base)
    assert env["HF_HUB_OFFLINE"] == "0"  # the caller chose to go online
    assert env["TRANSFORMERS_OFFLINE"] == "1" and env["PATH"] == "/usr/bin"
    assert env["ERMEDRAG_TORCH_THREADS"] == "1"
    assert offline_env({"HF_HUB_OFFLINE": "1"}, base=base)["HF_HUB_OFFLINE"] == "1"  # extra wins over both


def test_go_offline_sets_every_missing_name_before_the_hub_reads_it() -> None:
    clean = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}
    code = (
        "from ermedrag.offline import go_offline; go_offline(); "
        "import huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
