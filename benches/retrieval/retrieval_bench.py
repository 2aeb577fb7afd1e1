"""Retrieval benchmark: BioASQ questions against the pooled shared corpora, in two settings.

1. passages: the ~50k passages indexed as they are; gold = the question's BioASQ snippet passages.
2. long_documents: passages joined back into their source documents (PubMed article, OpenStax module,
   MedQuAD document), chunked as the project does by default; a returned snippet finds a gold passage by
   character overlap.

Every system runs side by side on the same index and the same held-out questions (the tuning split is
tune.py's). Also measured: index build throughput against the raw encoder, peak RSS of a process serving
queries with the default pipeline, batched query latency, and the default pipeline through a `chroma run`
server. Writes benches/results/retrieval.json; benches/README.md explains every figure.

    .venv/bin/python benches/retrieval/retrieval_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import CACHE, DEFAULT_DATA, METRICS, REPO, chroma_server, run_system, set_threads
from data import SharedData, long_documents, load_passages, passage_vectors, single_passage_vectors, split_qrels
from indexes import ensure_index, fingerprint
from scoring import passage_metrics, snippet_metrics

from ermedrag.tools.machine import describe_machine


PASSAGE_CHUNK_SIZE = 1024  # tokens: 99.3% of passages stay one chunk (512 would split 1,720)
LONG_DOC_CHUNK_SIZE = 256  # build_index's default: the documents are chunked as the project does for users
CHUNK_OVERLAP = 32
SYSTEMS = [
    "bm25",
    "dense",
    "medrag_rrf",
    "llamaindex_fusion",
    "ours",
    "ours_k10",
    "ours_coarse_only",
    "ours_no_feedback",
]
VIGNETTES_FILE = "benchmarks/medqa_us_test.jsonl"  # USMLE-style clinical vignettes, the main benchmark's questions


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--data", default=DEFAULT_DATA, help="shared data folder (env ERMEDRAG_SHARED_DATA)")
    parser.add_argument("--passages-index", default=str(CACHE / "passages-index"))
    parser.add_argument("--long-documents-index", default=str(CACHE / "longdocs-index"))
    parser.add_argument("--rebuild", action="store_true", help="delete and rebuild both indexes")
    parser.add_argument("--settings", default="passages,long_documents")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--queries", type=int, default=1000, help="held-out questions reported (at most 1000)")
    parser.add_argument("--seed", type=int, default=0, help="the qrels split's seed (tune.py uses the same)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up queries per system")
    parser.add_argument("--batch", type=int, default=32, help="batch size for the batched-latency figure")
    parser.add_argument(
        "--throughput-documents",
        type=int,
        default=300,
        help="long documents encoded for the build-throughput comparison",
    )
    parser.add_argument(
        "--vignettes", type=int, default=200, help="MedQA questions timed per system on the passages index (0 = skip)"
    )
    parser.add_argument("--no-extras", action="store_true", help="skip throughput, RSS, batch and server figures")
    parser.add_argument("--out", default=str(REPO / "benches/results/retrieval.json"))
    return parser.parse_args()


# ---------------------------------------------------------------- settings


def passages_setting(args, data: SharedData, passages, vectors) -> tuple[Path, dict, callable]:
    index_dir = Path(args.passages_index).expanduser()
    record = ensure_index(
        index_dir,
        passages,
        vectors,
        chunk_size=PASSAGE_CHUNK_SIZE,
        chunk_overlap=CHUNK_OVERLAP,
        fingerprint=fingerprint([*data.corpora, data.cache / "minilm_passages_f16.npy"]),
        rebuild=args.rebuild,
    )
    score = lambda q, spans: passage_metrics(list(dict.fromkeys(s.doc_id for s in spans)), set(q["gold"]))  # noqa: E731
    return index_dir, record, score


def long_documents_setting(args, data: SharedData, passages, vectors) -> tuple[Path, dict, callable]:
    documents, spans = long_documents(passages)
    index_dir = Path(args.long_documents_index).expanduser()
    record = ensure_index(
        index_dir,
        documents,
        single_passage_vectors(documents, spans, vectors),
        chunk_size=LONG_DOC_CHUNK_SIZE,
        chunk_overlap=CHUNK_OVERLAP,
        fingerprint=fingerprint([*data.corpora, data.cache / "minilm_passages_f16.npy"]),
        rebuild=args.rebuild,
    )
    record["index"]["documents_from_passages"] = {"documents": len(documents), "passages": len(passages)}
    score = lambda q, found: snippet_metrics(found, [spans[g] for g in q["gold"]])  # noqa: E731
    return index_dir, record, score


# ---------------------------------------------------------------- extras


def build_throughput(passages, n_documents: int, seed: int) -> dict:
    """Raw encoder vs build_index on the same chunks, side by side (fresh temporary index, no cached vectors)."""
    from ermedrag.tools.retrieval.corpus import chunk_documents
    from ermedrag.tools.retrieval.index import build_index
    from ermedrag.tools.retrieval.encoder import encode

    documents, _ = long_documents(passages)
    sample = random.Random(seed).sample(documents, min(n_documents, len(documents)))
    chunks = chunk_documents(sample, LONG_DOC_CHUNK_SIZE, CHUNK_OVERLAP)
    texts = [f"{c.title}. {c.text}" if c.title else c.text for c in chunks]
    encode(texts[:64])
    t0 = time.perf_counter()
    encode(texts)
    raw_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="ermedrag-throughput-") as tmp:
        stats = build_index(
            sample, Path(tmp) / "index", chunk_size=LONG_DOC_CHUNK_SIZE, chunk_overlap=CHUNK_OVERLAP, progress=False
        )
    out = {
        "chunks": len(chunks),
        "raw_encoder_chunks_per_s": round(len(chunks) / raw_s, 1),
        "build_index_chunks_per_s": round(stats["chunks_added"] / stats["seconds"], 1),
        "build_seconds": round(stats["seconds"], 1),
        "embed_seconds": round(stats["embed_seconds"], 1),
        "bm25_seconds": round(stats["bm25_seconds"], 2),
    }
    out["build_vs_raw"] = round(out["build_index_chunks_per_s"] / out["raw_encoder_chunks_per_s"], 3)
    return out


SERVE_SCRIPT = """
import json, resource, sys, time
import torch; torch.set_num_threads({threads})
from ermedrag.tools.retrieval.index import open_index
from ermedrag.tools.retrieval.search import retrieve
from benches.retrieval.common import peak_rss_mb  # the child's own VmHWM (see there)
index = open_index({index!r}, {url!r})
questions = json.loads(sys.stdin.read())
retrieve(index, questions[0], k=10)
latencies = []
for q in questions:
    t0 = time.perf_counter(); retrieve(index, q, k=10); latencies.append(1000 * (time.perf_counter() - t0))
latencies.sort()
print(json.dumps({{"peak_rss_mb": round(peak_rss_mb()),
                  "p50_ms": round(latencies[len(latencies) // 2], 1),
                  "p95_ms": round(latencies[int(len(latencies) * 0.95)], 1), "queries": len(latencies)}}))
"""


def serve_in_child(index_dir: Path, questions: list[str], threads: int, chroma_url: str | None = None) -> dict:
    """The default pipeline (`retrieve`, k=10) in a fresh process: its peak RSS and latency."""
    script = SERVE_SCRIPT.format(threads=max(threads, 1), index=str(index_dir), url=chroma_url)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(questions),
        capture_output=True,
        text=True,
        timeout=1800,
        env=os.environ,
    )
    if proc.returncode:
        raise RuntimeError(f"serving child failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def through_chroma_server(index_dir: Path, questions: list[str], threads: int) -> dict:
    """The same child, with Chroma behind `chroma run` on 127.0.0.1 serving a copy of the index's store."""
    import shutil

    with tempfile.TemporaryDirectory(prefix="ermedrag-chroma-server-") as tmp:
        shutil.copytree(index_dir / "chroma", Path(tmp) / "chroma")
        with chroma_server(Path(tmp) / "chroma", timeout_s=60) as url:
            return serve_in_child(index_dir, questions, threads, url)


def vignette_latency(systems: dict, wanted: list[str], questions: list[str], warmup: int) -> dict:
    """Single-query latency of each system on clinical vignettes (no qrels: time only). `ours` is the call a
    user makes, `retrieve(index, q, k=10)`; `ours_k100` the pipeline asked for 100 snippets as in the table."""
    from ermedrag.tools.retrieval.encoder import load_encoder

    import numpy as np

    timed = {
        ("ours" if name == "ours_k10" else "ours_k100" if name == "ours" else name): systems[name] for name in wanted
    }
    tokenizer = load_encoder().tokenizer
    lengths = [len(tokenizer(q, add_special_tokens=False, verbose=False)["input_ids"]) for q in questions]
    out: dict = {
        "_questions": {
            "count": len(questions),
            "source": VIGNETTES_FILE + " (file order)",
            "median_tokens": int(np.median(lengths)),
            "longer_than_encoder_window": round(sum(n > 254 for n in lengths) / len(lengths), 3),
        }
    }
    for name, search in timed.items():
        for q in questions[-warmup:] if warmup else []:
            search(q)
        latencies = []
        for q in questions:
            t0 = time.perf_counter()
            search(q)
            latencies.append(1000 * (time.perf_counter() - t0))
        out[name] = {
            "p50_ms": round(float(np.percentile(latencies, 50)), 1),
            "p95_ms": round(float(np.percentile(latencies, 95)), 1),
        }
        print(f"vignettes {name:>18}: {json.dumps(out[name])}", flush=True)
    return out


def load_vignettes(data: SharedData, count: int) -> list[str]:
    path = data.root / VIGNETTES_FILE
    if not path.exists():
        print(f"no {path}: vignette latency skipped")
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [json.loads(line)["question"] for line in lines[:count]]


def batched_latency(index, questions: list[str], batch: int) -> dict:
    from ermedrag.tools.retrieval.search import retrieve_many

    retrieve_many(index, questions[:2], k=10)
    t0 = time.perf_counter()
    for start in range(0, len(questions), batch):
        retrieve_many(index, questions[start : start + batch], k=10)
    return {"batch": batch, "ms_per_query": round(1000 * (time.perf_counter() - t0) / len(questions), 1)}


# ---------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    data = SharedData(Path(args.data).expanduser())
    data.check()
    set_threads(args.threads)
    load_at_start = describe_machine()
    out_path = Path(args.out)
    out: dict = json.loads(out_path.read_text()) if out_path.exists() else {}
    out.update(
        {"command": shlex.join(["python", os.path.relpath(__file__, REPO), *sys.argv[1:]]), "machine": load_at_start}
    )

    _, held_out = split_qrels(data, args.seed)
    questions = held_out[: args.queries]
    warmup = held_out[-args.warmup :] if args.warmup else []  # only for warming up: never scored here
    print(f"{len(questions)} held-out BioASQ questions (seed {args.seed}); tuning split used by tune.py only")
    passages = load_passages(data)
    vectors = passage_vectors(data, passages)

    from ermedrag.tools.retrieval.encoder import encode
    from ermedrag.tools.retrieval.index import open_index
    from systems import make_systems

    wanted = SYSTEMS if args.systems == "all" else args.systems.split(",")
    settings = {"passages": passages_setting, "long_documents": long_documents_setting}
    for setting in args.settings.split(","):
        index_dir, record, score = settings[setting](args, data, passages, vectors)
        index = open_index(index_dir)
        encode(["warm-up"])
        systems = make_systems(index)
        results = {}
        for name in wanted:
            t0 = time.perf_counter()
            results[name] = run_system(name, systems[name], score, questions, warmup)
            print(f"{setting} {name:>18}: {json.dumps(results[name])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        out[setting] = results
        out.setdefault("indexes", {})[setting] = record["index"]
        vignettes = load_vignettes(data, args.vignettes) if setting == "passages" and args.vignettes else []
        if vignettes:
            out["vignettes"] = vignette_latency(systems, wanted, vignettes, args.warmup)
        if not args.no_extras:
            texts = [q["question"] for q in questions]
            extras = out.setdefault("extras", {}).setdefault(setting, {})
            extras["ours_batched"] = batched_latency(index, texts, args.batch)
            extras["ours_serving_process"] = serve_in_child(index_dir, texts[:200], args.threads)
            if setting == "passages":
                extras["ours_via_chroma_server"] = through_chroma_server(index_dir, texts[:200], args.threads)
            print(f"{setting} extras: {json.dumps(extras)}", flush=True)
        del systems, index
        out_path.write_text(json.dumps(out, indent=2) + "\n")

    if not args.no_extras:
        out["build_throughput"] = build_throughput(passages, args.throughput_documents, args.seed)
        print(f"build throughput: {json.dumps(out['build_throughput'])}")
    out["peak_rss_mb_bench_process"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["queries"] = len(questions)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    for setting in ("passages", "long_documents"):
        if setting in out:
            print(f"\n{setting}\n{'system':>18} " + " ".join(f"{k:>9}" for k in (*METRICS, "p50_ms")))
            for name, row in out[setting].items():
                print(f"{name:>18} " + " ".join(f"{row.get(k, float('nan')):>9}" for k in (*METRICS, "p50_ms")))
    print(f"wrote {out_path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
