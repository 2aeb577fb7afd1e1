"""What an index holds, seen from a fresh process: `python -m benches.reliability.index_check DIR` prints one JSON
object: whether `open_index` opened it (it may repair), and the chunk counts of the manifest, the BM25 ids and the
Chroma collection, and whether the BM25 ids and Chroma's ids are the same set.

A fresh process, because Chroma's embedded client caches a store per path: a process that opened an index before
another process changed it would see its own stale copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PAGE = 5000


def index_state(directory: str) -> dict[str, Any]:
    from ermedrag.tools.retrieval.index import open_index

    state: dict[str, Any] = {"directory": directory}
    try:
        index = open_index(directory)
    except Exception as err:  # noqa: BLE001 - the caller classifies it
        return state | {"opened": False, "error": f"{type(err).__name__}: {err}"}
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    stored: list[str] = []
    for offset in range(0, index.collection.count(), PAGE):
        stored.extend(index.collection.get(include=[], limit=PAGE, offset=offset)["ids"])
    return state | {
        "opened": True,
        "manifest_chunks": manifest.get("chunks"),
        "bm25_ids": len(index.bm25_ids),
        "chroma_count": index.collection.count(),
        "same_ids": set(stored) == set(index.bm25_ids),
    }


if __name__ == "__main__":
    print(json.dumps(index_state(sys.argv[1])))
