"""One process at a time on a thing on disk (an eval's results folder, a run being answered, a bench's work
folder): an exclusive `flock` on a lock file, released by the OS when the holder dies, so a killed process never
blocks the next one. The file names its holder, for the refusal message."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import IO, Iterator


class Busy(ValueError):
    """Another process holds the lock; the message names it and what to do."""


def take(path: Path, what: str, advice: str) -> IO[str]:
    """Hold the lock at `path` for this process (the open handle keeps it; closing it releases it), or raise `Busy`
    "`what` is held by <holder>; `advice`"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(handle)
        handle.close()
        raise Busy(f"{what} is held by {holder}; {advice}") from None
    handle.seek(0)
    handle.truncate()
    command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]
    handle.write(f"process {os.getpid()} ({command}, since {time.strftime('%Y-%m-%d %H:%M:%S')})")
    handle.flush()
    return handle


HOLDER_WAIT_S = 1.0  # the holder writes its name just after it takes the lock: a contender that came between waits


def _holder(handle: IO[str]) -> str:
    """Who holds the lock, as its file names it; "another process" if it names no one within HOLDER_WAIT_S."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        handle.seek(0)
        holder = handle.read().strip()
        if holder or time.monotonic() > deadline:
            return holder or "another process"
        time.sleep(0.02)


@contextlib.contextmanager
def held(path: Path, what: str, advice: str) -> Iterator[None]:
    """`take` for the duration of a with-block; the file is emptied when released."""
    handle = take(path, what, advice)
    try:
        yield
    finally:
        handle.seek(0)
        handle.truncate()
        handle.close()
