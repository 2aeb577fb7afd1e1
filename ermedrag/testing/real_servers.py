"""Real OpenAI-compatible servers from packages, started on 127.0.0.1 with the offline model: what the server tests
(tests/tools/model_server/test_real_servers.py) and the parity bench (benches/server_parity.py) run the graphs through.

    with real_server("llamacpp_server", workdir) as server:
        load_chat_model(f"openai:{server.model}", base_url=server.base_url)   # server.in_process: the same weights
        # with ERMEDRAG_SERVER_TOKENIZER set to server.tokenizer, so that assistant turns are continued

Kinds (`SERVER_KINDS`), each beside the in-process backend that runs the same weights:
    llamacpp_server     llama-cpp-python's own server (`ermedrag.testing.llamacpp_server`, the `llamacpp` extra) on
                        the offline GGUF, with the offline model's chat template; twin `llamacpp:gemma3-270m`
    transformers_serve  `transformers serve` (transformers[serving]) on the converted offline model folder, in the
                        dtype the in-process backend computes in; twin `offline:gemma3-270m`
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ermedrag.testing.processes import free_port, log_tail, stop_process_group

SERVER_KINDS = ("llamacpp_server", "transformers_serve")
IN_PROCESS_TWIN = {"llamacpp_server": "llamacpp:gemma3-270m", "transformers_serve": "offline:gemma3-270m"}
# ERMEDRAG_SERVER_TOKENIZER for each: the GGUF carries no chat template (the server is given the offline model's),
# while `transformers serve` answers to the converted folder, whose tokenizer has it.
SERVER_TOKENIZER = {"llamacpp_server": "offline:gemma3-270m", "transformers_serve": ""}
STARTUP_TIMEOUT_S = 300  # transformers serve loads the model in ~10 s on idle cores; a busy machine takes longer


class ServerStartError(RuntimeError):
    """A real server that exited or did not answer in time; the message ends with its log's tail."""


@dataclass(frozen=True)
class RealServer:
    kind: str
    base_url: str  # ends in /v1
    model: str  # the model name the server answers to (`openai:<model>`)
    in_process: str  # the in-process model spec with the same weights
    tokenizer: str  # what ERMEDRAG_SERVER_TOKENIZER must name for assistant turns to be continued ("" = the model)
    log: Path
    pid: int


def server_command(kind: str, port: int, threads: int | None = None) -> tuple[list[str], str]:
    """The command that starts a `kind` server on `port`, and the model name it answers to."""
    if kind == "llamacpp_server":
        from ermedrag.tools.models.offline import offline_gguf

        gguf = str(offline_gguf())
        # --interrupt_requests False: by default a new request cuts the one streaming (ending it with [DONE] and no
        # finish_reason), so concurrent calls (an extractor fan-out) cut each other; this way they queue.
        command = [
            sys.executable,
            "-m",
            "ermedrag.testing.llamacpp_server",
            "--model",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "8192",
            "--interrupt_requests",
            "False",
        ]
        if threads:
            command += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
        return command, gguf
    if kind == "transformers_serve":
        from ermedrag.tools.models.offline import offline_model_dir
        from ermedrag.tools.machine import checkpoint_dtype, inference_dtype

        folder = str(offline_model_dir())
        dtype = str(inference_dtype("cpu", checkpoint_dtype(folder))).removeprefix("torch.")
        transformers = str(Path(sys.executable).parent / "transformers")
        return [
            transformers,
            "serve",
            folder,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--dtype",
            dtype,
            "--model-timeout",
            "86400",
            "--log-level",
            "info",
        ], folder
    raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS}")


def _models(base: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=3) as response:
            return [m["id"] for m in json.loads(response.read()).get("data", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return []


@contextlib.contextmanager
def real_server(
    kind: str, workdir: Path, *, threads: int | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S
) -> Iterator[RealServer]:
    """A `kind` server on a free port, ready (it lists its model), stopped with everything it spawned afterwards."""
    port = free_port()
    command, model = server_command(kind, port, threads)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{kind}.log"
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_WAIT_POLICY", "passive")  # shared cores: no busy-waiting threads
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout_s
        while model not in _models(base):
            if proc.poll() is not None:
                raise ServerStartError(f"{kind} exited with {proc.returncode}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"{kind} not ready at {base} within {startup_timeout_s:.0f} s:\n{log_tail(log)}")
            time.sleep(0.5)
        yield RealServer(kind, f"{base}/v1", model, IN_PROCESS_TWIN[kind], SERVER_TOKENIZER[kind], log, proc.pid)
    finally:
        stop_process_group(proc)
