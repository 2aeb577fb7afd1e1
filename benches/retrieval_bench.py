"""Retrieval benchmark: BioASQ questions against the pooled shared corpora (~50k passages).

Builds (or reuses) an index with `tools.index.build_index` from the precomputed MiniLM passage vectors,
then runs BM25, dense and the project's coarse-to-fine hybrid side by side on a seeded sample of BioASQ
questions and writes `benches/results/retrieval.json`. See benches/README.md for what every number means.

    .venv/bin/python benches/retrieval_bench.py --queries 1000
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import random
import shlex
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("ANONYMIZED_TELEMETRY", "False")):
    os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

CHUNK_SIZE = 1024  # tokens: 99.3% of passages stay one chunk `doc#0-len(text)` (512 would split 1,720)
CHUNK_OVERLAP = 32
DEPTH = 100  # passages ranked per query (mrr@100)
FINE_DEFAULT_CHUNKS = 8  # tools.retrieval.retrieve(coarse_k=8)
INDEX_FILES = {"manifest.json", "chroma", "bm25", "bench.json"}


def parse_args() -> argparse.Namespace:
    default_data = os.environ.get("ERMEDRAG_SHARED_DATA") or str(REPO.parent / "shared" / "data")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", default=default_data, help="shared data folder (env ERMEDRAG_SHARED_DATA)")
    parser.add_argument("--index-dir", default=str(Path.home() / ".cache/ermedrag/bench/passages-index"),
                        help="where the bench index is built (reused when complete)")
    parser.add_argument("--rebuild", action="store_true", help="delete and rebuild the index")
    parser.add_argument("--queries", type=int, default=1000, help="BioASQ questions in the seeded sample")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--fine-chunks", type=int, default=20,
                        help="coarse chunks re-scored by the fine stage in the wider variants")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS,
                        help="comma-separated subset of: " + ", ".join(SYSTEMS) + " (or all; the dense global variants cost ~1 s a query)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the encoder (1 is steadier on a shared 2-core machine; 0 = torch default)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up questions per system")
    parser.add_argument("--out", default=str(REPO / "benches/results/retrieval.json"))
    return parser.parse_args()


# ---------------------------------------------------------------- corpus and precomputed vectors

def unique_ids(ids: list[str]) -> tuple[list[str], int]:
    """Later occurrences of a repeated id become `id~2`, `id~3`, ... (the shared MedQuAD repeats ids)."""
    seen: Counter[str] = Counter()
    out = []
    for doc_id in ids:
        seen[doc_id] += 1
        out.append(doc_id if seen[doc_id] == 1 else f"{doc_id}~{seen[doc_id]}")
    return out, sum(n - 1 for n in seen.values())


def load_corpora(corpora: list[Path]):
    """All passages via tools.corpus.read_documents, which renames a repeated id `id~2`, `id~3`, ...
    (the shared MedQuAD repeats 2,421 ids for different passages); returns (documents, renamed count)."""
    from tools.corpus import read_documents

    documents = read_documents(corpora)
    return documents, sum(1 for d in documents if d.id.rpartition("~")[2].isdigit() and "~" in d.id)


def precomputed_vectors(cache: Path, documents) -> dict[str, np.ndarray]:
    """Chunk id `doc#0-len(text)` -> cached vector of f"{title}. {text}" (only one-chunk passages use it)."""
    vectors = np.load(cache / "minilm_passages_f16.npy", mmap_mode="r")
    with gzip.open(cache / "minilm_passages_ids.txt.gz", "rt") as handle:
        ids, _ = unique_ids([line.strip() for line in handle if line.strip()])
    if ids != [d.id for d in documents] or len(ids) != vectors.shape[0]:
        sys.exit(f"{cache}: cached vector ids do not match the corpora (order or content changed): recompute them")
    vectors = np.asarray(vectors)
    return {f"{d.id}#0-{len(d.text)}": vectors[i] for i, d in enumerate(documents)}


# ---------------------------------------------------------------- index

def corpus_fingerprint(corpora: list[Path], cache: Path) -> dict:
    files = [*corpora, cache / "minilm_passages_f16.npy"]
    return {"files": {p.name: p.stat().st_size for p in files}, "chunk_size": CHUNK_SIZE,
            "chunk_overlap": CHUNK_OVERLAP}


def ensure_index(index_dir: Path, corpora: list[Path], cache: Path, rebuild: bool) -> dict:
    """Reuse a complete bench index, else build one from scratch; returns the build record."""
    from tools.index import _manifest  # noqa: PLC2701 (read-only look at the manifest)

    fingerprint = corpus_fingerprint(corpora, cache)
    record_path = index_dir / "bench.json"
    if index_dir.exists() and not rebuild and record_path.exists():
        record = json.loads(record_path.read_text())
        manifest = _manifest(index_dir)
        if record.get("fingerprint") == fingerprint and manifest.get("chunks") == record["index"]["chunks"]:
            print(f"reusing the complete index at {index_dir} "
                  f"({record['index']['chunks']:,} chunks, built in {record['index']['build_seconds']:.0f} s)")
            return record
        print(f"{index_dir} is incomplete or stale: rebuilding")
    if index_dir.exists() and any(index_dir.iterdir()):
        extra = {p.name for p in index_dir.iterdir()
                 if p.name not in INDEX_FILES and not p.name.startswith((".bm25-", "manifest.json"))}
        if extra:
            sys.exit(f"{index_dir} holds files that are not a bench index ({sorted(extra)[:5]}): "
                     "choose another --index-dir")
        shutil.rmtree(index_dir)
    return build(index_dir, corpora, cache, fingerprint)


def build(index_dir: Path, corpora: list[Path], cache: Path, fingerprint: dict) -> dict:
    from tools.corpus import chunk_documents
    from tools.index import build_index

    t0 = time.perf_counter()
    documents, renamed = load_corpora(corpora)
    print(f"read {len(documents):,} passages from {len(corpora)} files in {time.perf_counter() - t0:.1f} s"
              + (f" ({renamed:,} repeated ids renamed id~N)" if renamed else ""))
    precomputed = precomputed_vectors(cache, documents)

    # build_index encodes a whole add-batch (512 chunks) when any chunk in it lacks a precomputed vector,
    # so the passages that get split are added in a first call of their own and the rest in a second.
    t0 = time.perf_counter()
    counts = Counter(c.doc_id for c in chunk_documents(documents, CHUNK_SIZE, CHUNK_OVERLAP))
    plan_s = time.perf_counter() - t0
    split = [d for d in documents if counts[d.id] > 1]
    whole = [d for d in documents if counts[d.id] == 1]
    print(f"chunk_size={CHUNK_SIZE}: {len(whole):,} passages stay one chunk, {len(split):,} are split into "
          f"{sum(counts[d.id] for d in split):,} chunks (planning pass {plan_s:.1f} s, not counted)")

    stats = []
    for label, docs in (("split passages (real encoder)", split), ("one-chunk passages (cached vectors)", whole)):
        if not docs:
            continue
        print(f"build_index: {label}: {len(docs):,} passages")
        stats.append(build_index(docs, index_dir, chunk_size=CHUNK_SIZE, chunk_overlap=CHUNK_OVERLAP,
                                 precomputed=precomputed, progress=True))
        s = stats[-1]
        print(f"  +{s['chunks_added']:,} chunks in {s['seconds']:.1f} s (embedding/vectors {s['embed_seconds']:.1f} s,"
              f" bm25 {s['bm25_seconds']:.1f} s)")
    fresh = stats[0]["chunks_added"] if split else 0
    index = {"passages": len(documents), "chunks": stats[-1]["chunks_total"],
             "build_seconds": round(sum(s["seconds"] for s in stats), 1),
             "bm25_seconds": round(sum(s["bm25_seconds"] for s in stats), 1), "fresh_encoded": fresh}
    record = {"fingerprint": fingerprint, "index": index, "renamed_ids": renamed, "calls": stats,
              "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    (index_dir / "bench.json").write_text(json.dumps(record, indent=2))
    return record


# ---------------------------------------------------------------- systems

def doc_of(chunk_id: str) -> str:
    return chunk_id.rsplit("#", 1)[0]


def dedupe(doc_ids) -> list[str]:
    return list(dict.fromkeys(doc_ids))[:DEPTH]


def fine_ranked(index, query: str, fine_chunks: int, scorer: str, policy: str) -> list[str]:
    """Coarse hybrid over DEPTH chunks; the fine stage turns the top `fine_chunks` chunks into snippets
    (passages in order of first appearance among them); the coarse tail follows in coarse order."""
    from tools.retrieval import coarse_hybrid, fine_sentence_windows

    hits = coarse_hybrid(index, query, DEPTH)
    snippets = fine_sentence_windows(index, query, hits[:fine_chunks], k=10**6, scorer=scorer, policy=policy)
    return dedupe([s.doc_id for s in snippets] + [doc_of(h.chunk_id) for h in hits])


def make_systems(fine_chunks: int) -> dict[str, Callable]:
    from tools.retrieval import MAX_QUERY_CHARS, bm25_search, coarse_hybrid, dense_search, retrieve

    def clean(q: str) -> str:  # what retrieve() does to a query
        return " ".join(q.split())[:MAX_QUERY_CHARS]

    return {
        "bm25": lambda ix, q: dedupe(doc_of(h.chunk_id) for h in bm25_search(ix, clean(q), DEPTH)),
        "dense": lambda ix, q: dedupe(doc_of(h.chunk_id) for h in dense_search(ix, clean(q), DEPTH)),
        # The project's default pipeline (tools.retrieval.retrieve), asked for DEPTH snippets.
        "ours": lambda ix, q: dedupe(s.doc_id for s in retrieve(ix, q, k=DEPTH, coarse_k=DEPTH)),
        "rrf_coarse_only": lambda ix, q: dedupe(doc_of(h.chunk_id) for h in coarse_hybrid(ix, clean(q), DEPTH)),
        "global_lexical_fine": lambda ix, q: fine_ranked(ix, clean(q), FINE_DEFAULT_CHUNKS, "lexical", "global"),
        "global_dense_fine": lambda ix, q: fine_ranked(ix, clean(q), FINE_DEFAULT_CHUNKS, "dense", "global"),
        f"global_dense_fine{fine_chunks}": lambda ix, q: fine_ranked(ix, clean(q), fine_chunks, "dense", "global"),
    }


SYSTEMS = ["bm25", "dense", "ours", "rrf_coarse_only", "global_lexical_fine", "global_dense_fine",
           "global_dense_fineN"]
DEFAULT_SYSTEMS = "bm25,dense,ours,rrf_coarse_only,global_lexical_fine"


# ---------------------------------------------------------------- metrics

def metrics(ranked: list[str], gold: set[str]) -> dict[str, float]:
    top = ranked[:10]
    first = next((i for i, d in enumerate(ranked[:DEPTH]) if d in gold), None)
    dcg = sum(1 / math.log2(i + 2) for i, d in enumerate(top) if d in gold)
    idcg = sum(1 / math.log2(i + 2) for i in range(min(len(gold), 10)))
    return {"hit@10": float(any(d in gold for d in top)), "recall@10": len(set(top) & gold) / len(gold),
            "mrr@100": 0.0 if first is None else 1 / (first + 1), "ndcg@10": dcg / idcg}


def run_system(name: str, fn: Callable, index, sample: list[dict], warmup: list[dict]) -> dict[str, float]:
    for q in warmup:
        fn(index, q["question"])
    totals: Counter[str] = Counter()
    latencies = []
    for q in tqdm(sample, desc=f"{name:>22}", unit="q", mininterval=2):
        t0 = time.perf_counter()
        ranked = fn(index, q["question"])
        latencies.append((time.perf_counter() - t0) * 1000)
        totals.update(metrics(ranked, set(q["gold"])))
    n = len(sample)
    out = {k: round(totals[k] / n, 4) for k in ("hit@10", "recall@10", "mrr@100", "ndcg@10")}
    out["p50_ms"] = round(float(np.percentile(latencies, 50)), 1)
    out["p95_ms"] = round(float(np.percentile(latencies, 95)), 1)
    return out


def machine() -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "?")
    mem = next((int(line.split()[1]) // 1024 // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"nproc={os.cpu_count()}, {cpu}, {mem} GiB RAM, no GPU used (device={os.environ.get('ERMEDRAG_DEVICE', 'cpu')}),"
            f" torch {torch.__version__} threads={torch.get_num_threads()}, Python {platform.python_version()},"
            f" {platform.system()} {platform.release()}, load avg at start {load}")


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    data = Path(args.data).expanduser()
    corpora = sorted((data / "corpora").glob("*.jsonl.gz"))
    qrels_path = data / "retrieval" / "bioasq_qrels.jsonl"
    cache = data / "cache"
    missing = [str(p) for p in (qrels_path, cache / "minilm_passages_f16.npy", cache / "minilm_passages_ids.txt.gz")
               if not p.exists()]
    if not corpora or missing:
        sys.exit(f"shared data not found under {data} (missing: {missing or ['corpora/*.jsonl.gz']}); "
                 "pass --data or set ERMEDRAG_SHARED_DATA")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    load_at_start = machine()

    record = ensure_index(Path(args.index_dir).expanduser(), corpora, cache, args.rebuild)

    from tools.index import encode, open_index

    index = open_index(Path(args.index_dir).expanduser())
    print(f"index: {index.size:,} chunks in Chroma, {len(index.bm25_ids):,} in BM25")
    t0 = time.perf_counter()
    encode(["warm-up"])
    print(f"encoder loaded in {time.perf_counter() - t0:.1f} s")

    qrels = [json.loads(line) for line in qrels_path.read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    order = rng.sample(range(len(qrels)), len(qrels))
    n = min(args.queries, len(qrels))
    sample = [qrels[i] for i in order[:n]]
    warmup = [qrels[i] for i in order[n:n + args.warmup]]
    gold_ids = {g for q in sample for g in q["gold"]}
    print(f"{n} BioASQ questions (seed {args.seed}), {len(gold_ids):,} distinct gold passages, "
          f"{sum(len(q['gold']) for q in sample) / n:.1f} gold per question")

    systems = make_systems(args.fine_chunks)
    wanted = list(systems) if args.systems == "all" else [
        s.replace("fineN", f"fine{args.fine_chunks}") for s in args.systems.split(",")]
    unknown = [s for s in wanted if s not in systems]
    if unknown:
        sys.exit(f"unknown systems {unknown}; choose from {list(systems)}")
    results = {}
    for name in wanted:
        t0 = time.perf_counter()
        results[name] = run_system(name, systems[name], index, sample, warmup)
        print(f"{name:>22}: {json.dumps(results[name])}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    command = shlex.join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO))
                          else sys.executable, os.path.relpath(__file__, REPO), *sys.argv[1:]])
    out = {"passages": results, "index": record["index"], "queries": n, "command": command,
           "machine": load_at_start}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")

    print(f"\n{'system':>22} " + " ".join(f"{k:>9}" for k in ("hit@10", "recall@10", "mrr@100", "ndcg@10",
                                                           "p50_ms", "p95_ms")))
    for name, row in results.items():
        print(f"{name:>22} " + " ".join(f"{v:>9}" for v in row.values()))
    print(f"index: {json.dumps(record['index'])}")
    print(f"wrote {out_path} in {time.perf_counter() - started:.0f} s total")


if __name__ == "__main__":
    main()
