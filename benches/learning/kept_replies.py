"""The held-out replies behind a learning figure, kept in the repository beside it.

One gzip'd JSON line per reply (`<bench>/replies/<arm>_<phase>.jsonl.gz` under benches/results): the prompt's id,
the reply, the answer parsed from it, the gold answer and the reward parts, so that a figure can be checked, and a
collapse or a metric added later read off the very replies it came from. A file is replaced whole (written beside,
then renamed): a run stopped while writing leaves the earlier file as it was.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SUFFIX = ".jsonl.gz"


def replies_path(folder: Path, *parts: str | int) -> Path:
    """`folder/<parts joined by _>.jsonl.gz`, e.g. `replies_path(dir, "grpo_respondent", "seed0_after")`."""
    return folder / ("_".join(str(part) for part in parts) + SUFFIX)


def write_replies(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write `rows` to `path`, replacing what was there only once every row is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with gzip.open(partial, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(dict(row)) + "\n" for row in rows)
    os.replace(partial, path)
    return path


def read_replies(path: Path) -> list[dict[str, Any]] | None:
    """The rows `write_replies` kept at `path`, or None where there are none."""
    if not path.exists():
        return None
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
