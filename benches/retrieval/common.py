"""What the retrieval bench scripts share: offline environment, paths, timing one system over questions."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("ANONYMIZED_TELEMETRY", "False")):
    os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

CACHE = Path.home() / ".cache/ermedrag/bench"
DEFAULT_DATA = os.environ.get("ERMEDRAG_SHARED_DATA") or str(REPO.parent / "shared" / "data")
METRICS = ("hit@10", "recall@10", "mrr@100", "ndcg@10")


def set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def run_system(name: str, search: Callable[[str], object], score: Callable[[dict, object], dict[str, float]],
               questions: list[dict], warmup: list[dict]) -> dict[str, float]:
    """Mean metrics over `questions` and single-query latency percentiles (after untimed warm-up queries)."""
    for q in warmup:
        search(q["question"])
    totals: Counter[str] = Counter()
    latencies = []
    for q in tqdm(questions, desc=f"{name:>24}", unit="q", mininterval=5):
        t0 = time.perf_counter()
        results = search(q["question"])
        latencies.append((time.perf_counter() - t0) * 1000)
        totals.update(score(q, results))
    out = {k: round(totals[k] / len(questions), 4) for k in totals}
    out["p50_ms"] = round(float(np.percentile(latencies, 50)), 1)
    out["p95_ms"] = round(float(np.percentile(latencies, 95)), 1)
    return out
