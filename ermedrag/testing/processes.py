"""Helpers for tests and benches that start servers as processes: a free port, a log's end, a clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log: Path, chars: int = 6000) -> str:
    """The end of a server's log, for failure messages."""
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """Stop a server started with start_new_session=True, with everything it spawned."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
