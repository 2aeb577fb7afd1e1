"""Append-only JSONL logs that survive being killed: what evals and exports write, one record at a time.

Each record is flushed to the OS as soon as it is written (a killed process keeps it; `close` fsyncs).
A line cut short by a kill is ended on reopen and skipped on read, and its work is simply redone.
`replace_text` rewrites a whole file so that a kill leaves either the old one or the new one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Complete records of a log; a missing file has none, a cut line is skipped."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


def replace_text(path: Path, text: str) -> None:
    """Write `text` under a temporary name beside `path`, then rename it over `path` (atomic)."""
    temporary = path.with_name(f".{path.name}.part")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


class AppendLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._end_cut_line(path)
        self._handle = path.open("a", encoding="utf-8")

    @staticmethod
    def _end_cut_line(path: Path) -> None:
        """A kill can leave half a line at the end: end it, so the next record starts on its own line."""
        if path.exists() and path.stat().st_size:
            with path.open("rb+") as handle:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    handle.write(b"\n")

    def write(self, record: dict[str, Any]) -> None:
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        os.fsync(self._handle.fileno())
        self._handle.close()

    def __enter__(self) -> "AppendLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
