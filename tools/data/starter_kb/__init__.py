"""The starter knowledge base: 72 short passages on common clinical topics, written for this project.

Demo content to exercise the pipeline offline, not clinical advice. `starter_index_dir()` builds its index
(embedded Chroma + BM25, packaged MiniLM) on first use and reuses it afterwards.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ermedrag.tools.cache import shared_resource
from ermedrag.tools.settings import cache_home

PASSAGES = Path(__file__).with_name("passages.jsonl")


@shared_resource(maxsize=1)  # concurrent first calls (eval runner threads) must not build it twice
def starter_index_dir(progress: bool = False) -> Path:
    from ermedrag.tools.retrieval.corpus import read_documents
    from ermedrag.tools.retrieval.index import build_index

    version = hashlib.sha256(PASSAGES.read_bytes()).hexdigest()[:12]
    directory = cache_home() / "indexes" / f"starter-{version}"
    if not (directory / "manifest.json").exists():
        build_index(read_documents([PASSAGES]), directory, progress=progress)
    return directory
