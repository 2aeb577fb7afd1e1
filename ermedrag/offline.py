"""The settings that keep what this project loads off the network and quiet: no hub look-ups, no telemetry, no
tracers, no version checks, and no tokenizer thread pools that a fork would deadlock. Tests, benches and the
children they start run with them; an explicit setting in the caller's environment wins (tests/conftest.py
overrides it: tests stay offline whatever the shell says).

Set them before the libraries are imported: some (huggingface_hub, transformers) read them once, at import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "ANONYMIZED_TELEMETRY": "False",
    "RAGAS_DO_NOT_TRACK": "true",
    "LANGGRAPH_CLI_NO_ANALYTICS": "1",
    "LANGGRAPH_NO_VERSION_CHECK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "WANDB_DISABLED": "true",
}


def go_offline() -> None:
    """Apply OFFLINE_ENV to this process where its environment does not already set a name."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)


def offline_env(extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child process's environment: `base` (this process's environment by default), OFFLINE_ENV where it sets
    nothing, then `extra`."""
    return {**OFFLINE_ENV, **(os.environ if base is None else base), **(extra or {})}
