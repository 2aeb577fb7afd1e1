"""How an index's costs grow with the corpus: build time, memory, disk, opening, queries, adding.

    .venv/bin/python benches/retrieval/scale.py                          # 50k, 200k, 1M → results/scale.json, scale.png
    .venv/bin/python benches/retrieval/scale.py --sizes 5000,20000 --out /tmp/scale.json   # a quick check

What is real and what is not:
- Passages: the shared corpora's 50,008 real passages; a larger size adds copies of them, each lightly perturbed
  (every `7 + copy`-th word dropped, one neighbouring pair of words swapped) so BM25 sees new documents of the same
  vocabulary and length. Indexed with the project's own `build_index` (chunk size 1,024: a passage stays one chunk).
- Vectors: the cached MiniLM vectors of the real passages (`cache/minilm_passages_f16.npy`); a copy gets its
  original's vector plus Gaussian noise (σ 0.02 per dimension, renormalised). Build time therefore excludes the
  encoder, whose throughput is measured on its own (`retrieval.json`, `build_throughput`).
- Queries: 200 held-out BioASQ questions through `retrieve(index, q, k=10)` with the defaults, the encoder included.

Each step runs in a fresh child process of this stdlib-only parent; peak memory is the child's VmHWM (its own
address space: a child's ru_maxrss starts at its parent's high-water mark); a build's peak includes holding the
documents and vectors in memory, as any caller of `build_index` does. Per size:
`build_s`, `build_peak_rss_mb`, `disk_mb`, `open_s` (open_index: manifest, BM25 memory-mapped, Chroma),
`serve_peak_rss_mb`, `p50_ms` / `p95_ms` (embedded Chroma), `server_p50_ms` / `server_p95_ms` (`chroma run` on
127.0.0.1 serving the index's store), and `add_10k_s` (10,000 more passages through `build_index`, with the
`add_bm25_s` of it: one BM25 segment of the new chunks, or a merge when one is due; `add_segments`: the BM25
segments committed after it; `after_add_p50_ms` / `after_add_p95_ms`: queries again, over those segments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common import chroma_server, peak_rss_mb

from ermedrag.offline import offline_env
from ermedrag.tools.machine import describe_machine

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = Path.home() / ".cache/ermedrag/bench/scale"
CHUNK_SIZE, CHUNK_OVERLAP = 1024, 32
QUERIES = 200
ADD = 10_000
NOISE = 0.02


# ------------------------------------------------------------------------------------------ child steps


def synthetic_corpus(data_root: Path, first: int, count: int) -> tuple[list, dict]:
    """Passages number `first` .. `first + count - 1` of the endless corpus (real passages, then perturbed copies),
    with their chunk ids' vectors."""
    import random

    import numpy as np

    from data import SharedData, load_passages, passage_vectors

    from ermedrag.tools.retrieval.corpus import Document, chunk_documents

    data = SharedData(data_root)
    passages = load_passages(data)
    vectors = passage_vectors(data, passages)
    documents, wanted = [], {}
    for number in range(first, first + count):
        copy, original = divmod(number, len(passages))
        source = passages[original]
        if copy == 0:
            document, vector = source, vectors[source.id]
        else:
            words = source.text.split()
            kept = [w for i, w in enumerate(words, 1) if i % (7 + copy)]
            rng = random.Random(number)
            if len(kept) > 2:
                i = rng.randrange(len(kept) - 1)
                kept[i], kept[i + 1] = kept[i + 1], kept[i]
            document = Document(
                id=f"{source.id}~x{copy}", title=source.title, text=" ".join(kept) or source.text, source=source.source
            )
            noisy = vectors[source.id] + np.random.default_rng(number).normal(0, NOISE, vectors[source.id].shape)
            vector = (noisy / np.linalg.norm(noisy)).astype(np.float32)
        documents.append(document)
        wanted[document.id] = vector
    precomputed = {c.id: wanted[c.doc_id] for c in chunk_documents(documents, CHUNK_SIZE, CHUNK_OVERLAP)}
    return documents, precomputed


def child_build(index_dir: Path, data_root: Path, first: int, count: int) -> dict:
    from ermedrag.tools.retrieval.index import build_index

    documents, precomputed = synthetic_corpus(data_root, first, count)
    stats = build_index(
        documents,
        index_dir,
        chunk_size=CHUNK_SIZE,
        chunk_overlap=CHUNK_OVERLAP,
        precomputed=precomputed,
        progress=False,
    )
    segments = json.loads((index_dir / "manifest.json").read_text())["bm25_segments"]
    return {
        "seconds": round(stats["seconds"], 1),
        "bm25_s": round(stats["bm25_seconds"], 1),
        "chunks_total": stats["chunks_total"],
        "segments": len(segments),
        "peak_rss_mb": peak_rss_mb(),
    }


def child_serve(index_dir: Path, data_root: Path, chroma_url: str | None) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from data import SharedData, split_qrels

    from ermedrag.tools.retrieval.encoder import load_encoder
    from ermedrag.tools.retrieval.index import open_index
    from ermedrag.tools.retrieval.search import retrieve

    questions = [q["question"] for q in split_qrels(SharedData(data_root), 0)[1][:QUERIES]]
    load_encoder()
    started = time.perf_counter()
    index = open_index(index_dir, chroma_url)
    open_s = time.perf_counter() - started
    for question in questions[:3]:
        retrieve(index, question, k=10)
    latencies = []
    for question in questions:
        t0 = time.perf_counter()
        retrieve(index, question, k=10)
        latencies.append(1000 * (time.perf_counter() - t0))
    return {
        "open_s": round(open_s, 2),
        "p50_ms": round(float(np.percentile(latencies, 50)), 1),
        "p95_ms": round(float(np.percentile(latencies, 95)), 1),
        "peak_rss_mb": peak_rss_mb(),
    }


# ------------------------------------------------------------------------------------------ the parent


def run_child(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        env=offline_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=6 * 3600,
    )
    if proc.returncode:
        raise RuntimeError(f"child {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def disk_mb(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 1)


def through_chroma_server(index_dir: Path, data_root: Path) -> dict:
    with chroma_server(index_dir / "chroma") as url:
        return run_child("serve", str(index_dir), str(data_root), url)


def measure(size: int, work: Path, data_root: Path) -> dict:
    index_dir = work / f"index-{size}"
    shutil.rmtree(index_dir, ignore_errors=True)
    built = run_child("build", str(index_dir), str(data_root), "0", str(size))
    print(f"{size:,}: built {json.dumps(built)}", flush=True)
    row = {
        "build_s": built["seconds"],
        "build_bm25_s": built["bm25_s"],
        "build_peak_rss_mb": built["peak_rss_mb"],
        "chunks": built["chunks_total"],
        "disk_mb": disk_mb(index_dir),
    }
    served = run_child("serve", str(index_dir), str(data_root), "")
    row.update(
        open_s=served["open_s"],
        p50_ms=served["p50_ms"],
        p95_ms=served["p95_ms"],
        serve_peak_rss_mb=served["peak_rss_mb"],
    )
    remote = through_chroma_server(index_dir, data_root)
    row.update(server_p50_ms=remote["p50_ms"], server_p95_ms=remote["p95_ms"])
    added = run_child("build", str(index_dir), str(data_root), str(size), str(ADD))
    row.update(
        add_10k_s=added["seconds"],
        add_bm25_s=added["bm25_s"],
        add_peak_rss_mb=added["peak_rss_mb"],
        add_segments=added["segments"],
    )
    after = run_child("serve", str(index_dir), str(data_root), "")  # the commits' segments scored as one BM25
    row.update(after_add_p50_ms=after["p50_ms"], after_add_p95_ms=after["p95_ms"])
    print(f"{size:,}: {json.dumps(row)}", flush=True)
    return row


def plot(sizes: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(int(s) for s in sizes)
    series = {
        "build s": "build_s",
        "add 10k s": "add_10k_s",
        "disk MB": "disk_mb",
        "serving peak RSS MB": "serve_peak_rss_mb",
        "query p50 ms": "p50_ms",
        "query p95 ms": "p95_ms",
        "open s": "open_s",
    }
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for label, key in series.items():
        ys = [sizes[str(x)][key] for x in xs]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="passages", title="Index cost by corpus size (2 cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="50000,200000,1000000")
    parser.add_argument(
        "--data", default=os.environ.get("ERMEDRAG_SHARED_DATA") or str(REPO.parent / "shared" / "data")
    )
    parser.add_argument("--work", default=str(CACHE))
    parser.add_argument("--out", default=str(REPO / "benches" / "results" / "scale.json"))
    args = parser.parse_args()
    if args.child:
        step, index_dir, data_root, *rest = args.child
        if step == "build":
            result = child_build(Path(index_dir), Path(data_root), int(rest[0]), int(rest[1]))
        else:
            result = child_serve(Path(index_dir), Path(data_root), rest[0] if rest and rest[0] else None)
        print(json.dumps(result))
        return
    data_root = Path(args.data).expanduser()
    if not (data_root / "cache" / "minilm_passages_f16.npy").exists():
        print(f"scale: skipped: no shared data with cached vectors at {data_root} (--data / ERMEDRAG_SHARED_DATA)")
        return
    started = time.perf_counter()
    at_start = describe_machine()
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {}
    sizes = record.setdefault("sizes", {})
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for size in (int(s) for s in args.sizes.split(",")):
        sizes[str(size)] = measure(size, work, data_root)
        out.write_text(json.dumps(record, indent=2) + "\n")
    record.update(
        command="python benches/retrieval/scale.py " + " ".join(sys.argv[1:]),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=at_start,
        seconds=round(time.perf_counter() - started, 1),
    )
    out.write_text(json.dumps(record, indent=2) + "\n")
    plot(sizes, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
