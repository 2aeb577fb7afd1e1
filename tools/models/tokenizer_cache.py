"""Tokenizers kept between processes: `load_tokenizer` is `AutoTokenizer.from_pretrained` for a local folder or GGUF.

Why: loading the offline model's tokenizer (Gemma, 262k tokens) with `from_pretrained` parses its 33 MB
tokenizer.json in Python twice, 2.3 s of every `ermedrag` command on 2 cores; the loaded object, pickled into
ermedrag's cache, comes back in 1.1 s (benches/results/first_answer.json). Only local sources are kept (a hub id
is the hub cache's business). A kept tokenizer is keyed by the source's path, the loading arguments, the name, size
and modification time of every file in the source folder (a GGUF's own tokenizer is in the GGUF), and the
transformers and tokenizers versions: an edited file or an upgrade loads afresh. The files are ermedrag's own (ERMEDRAG_HOME/tokenizers),
written by this process and renamed into place whole; one that does not load is loaded afresh and written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from ermedrag.tools.settings import cache_home


def load_tokenizer(source: str, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained(source, **kwargs)`, from the cache when this source was loaded before."""
    from transformers import AutoTokenizer

    kept = _kept_path(source, kwargs)
    if kept is None:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    try:
        with open(kept, "rb") as handle:
            return pickle.load(handle)
    except OSError:  # not kept yet, or a cache that cannot be read: load afresh
        pass
    except Exception:  # written by another library version in spite of the key, or damaged: load afresh
        with contextlib.suppress(OSError):
            kept.unlink()
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    _keep(tokenizer, kept)
    return tokenizer


def _kept_path(source: str, kwargs: dict[str, Any]) -> Path | None:
    """Where the tokenizer of a local `source` is kept; None for a hub id (or arguments that are not plain data)."""
    import tokenizers
    import transformers

    folder = Path(source).expanduser()
    if not folder.is_dir():
        return None
    files = sorted(
        (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(folder) if entry.is_file()
    )
    try:
        key = json.dumps(
            [str(folder.resolve()), kwargs, files, transformers.__version__, tokenizers.__version__], sort_keys=True
        )
    except TypeError:
        return None
    return cache_home() / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pickle"


def _keep(tokenizer: Any, path: Path) -> None:
    """Write the pickled tokenizer beside `path` and rename it there: a reader never sees half a file. A tokenizer
    that does not pickle, or a cache that cannot be written, is simply not kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    except OSError:  # a read-only or full cache: load afresh next time
        return
    try:
        with os.fdopen(handle, "wb") as out:
            pickle.dump(tokenizer, out, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(staging, path)
    except Exception:
        Path(staging).unlink(missing_ok=True)
