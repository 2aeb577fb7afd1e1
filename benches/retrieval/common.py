"""What the retrieval bench scripts share: offline environment, paths, timing one system over questions."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

from ermedrag.offline import go_offline

REPO = Path(__file__).resolve().parents[2]
go_offline()

import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

CACHE = Path.home() / ".cache/ermedrag/bench"
DEFAULT_DATA = os.environ.get("ERMEDRAG_SHARED_DATA") or str(REPO.parent / "shared" / "data")
METRICS = ("hit@10", "recall@10", "mrr@100", "ndcg@10")


def set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def run_system(
    name: str,
    search: Callable[[str], object],
    score: Callable[[dict, object], dict[str, float]],
    questions: list[dict],
    warmup: list[dict],
) -> dict[str, float]:
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


def peak_rss_mb() -> float:
    """This process's own memory high-water mark (VmHWM), in MB. Not ru_maxrss: a child's ru_maxrss starts at its
    parent's high-water mark (exec keeps it), and the parent of a serving child is a bench holding indexes."""
    with open("/proc/self/status", encoding="utf-8") as status:
        kilobytes = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return round(kilobytes / 1024, 1)


@contextlib.contextmanager
def chroma_server(store: Path, timeout_s: float = 300) -> Iterator[str]:
    """`chroma run` on 127.0.0.1 serving the Chroma store at `store`, for the block: yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    chroma = Path(sys.executable).with_name("chroma")
    server = subprocess.Popen(
        [str(chroma), "run", "--path", str(store), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"chroma run exited with {server.returncode}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"chroma run did not listen on port {port} within {timeout_s} s")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=60)
