"""Retrieval and answer quality of RAG runs, scored with ragas.

Retrieval (no LLM): which corpus passages a run retrieved, against the gold evidence of its question.

- retrieved ids: the doc ids (corpus passage ids) of the snippets a run retrieved, read from the retrieval
  events of its trace (`retrieved_ids`): every retrieval of the run (ER-MedRAG's and vanilla RAG's one, each
  of Med-R³'s searches). A snippet id is `"<doc_id>@<start>-<end>"`; several snippets of one passage count
  once, so the scores below are passage-level.
- gold evidence (`gold_evidence`): PubMedQA question `pubmedqa-<pmid>` → the passages of its own abstract,
  corpus ids `pubmed-<pmid>-<i>`; BioASQ → the `gold` passage ids of `bioasq_qrels.jsonl`; other benchmarks
  have none.
- context precision = |retrieved ∩ gold| / |retrieved| and context recall = |retrieved ∩ gold| / |gold|,
  over sets of ids. They are computed by ragas 0.4.3's non-LLM metrics `IDBasedContextPrecision` and
  `IDBasedContextRecall` (defined in `ragas.metrics._context_precision` / `_context_recall`; reachable, with a
  DeprecationWarning, as `ragas.metrics.IDBasedContextPrecision`; not in `ragas.metrics.collections`) on
  `SingleTurnSample(retrieved_context_ids=..., reference_context_ids=...)`. A pure-Python fallback with the
  same definitions (`_fallback_*`) is used only when ragas cannot be imported; `BACKEND` says which.
- PubMedQA's gold set is a prefix rule (`pubmed-<pmid>-`). Given the corpus (`corpus_dir`, holding
  `pubmedqa_contexts.jsonl.gz`) it is expanded into the concrete passage ids of that pmid, and both scores
  are exact. Without the corpus the reference ids are the retrieved ids that match the prefix: precision is
  still exact, but the size of the gold set is unknown, so recall is reported as None rather than a number
  that would be 1.0 whenever anything matched.

Answers (LLM-judged, `judge_metrics`): ragas `Faithfulness` (claims of the response supported by the retrieved
contexts) and `ResponseRelevancy` (cosine similarity between the question and questions the judge generates
from the response), run with a judge chat model of ours (`tools.chat_models.load_chat_model`) wrapped in
`ragas.llms.LangchainLLMWrapper`. ResponseRelevancy's embeddings are the packaged offline MiniLM
(`tools.index.load_encoder`, sentence-transformers) behind `ragas.embeddings.LangchainEmbeddingsWrapper`:
nothing is downloaded. Never point the judge at a remote service from tests.
"""

from __future__ import annotations

import asyncio
import math
import os
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ermedrag.tools.data.gold_evidence import GoldEvidence, benchmark_family, doc_id, gold_evidence
from ermedrag.tools.records.jsonl import read_records
from ermedrag.tools.records.traces import TraceStore

os.environ.setdefault("RAGAS_DO_NOT_TRACK", "true")  # before ragas is imported: no usage telemetry

try:
    from ragas.dataset_schema import SingleTurnSample
    from ragas.metrics._context_precision import IDBasedContextPrecision
    from ragas.metrics._context_recall import IDBasedContextRecall

    BACKEND = "ragas"
except ImportError:  # ragas is the optional `eval` extra
    SingleTurnSample = IDBasedContextPrecision = IDBasedContextRecall = None  # type: ignore[assignment,misc]
    BACKEND = "fallback"

RESULTS = "results.jsonl"
# `rag_quality`'s reasons for leaving a row out (its `skipped` keys), as the report words them.
SKIPPED_WHY = {
    "no_gold": "without gold evidence (only PubMedQA and BioASQ questions have it)",
    "no_run": "whose run is not in the trace database {trace_db} (run `ermedrag eval` with --trace-db)",
    "no_retrieval": "whose run retrieved nothing (a system without retrieval, such as cot)",
}


# --------------------------------------------------------------------------------------------- retrieved


def _store(store: TraceStore | str | os.PathLike[str]) -> TraceStore:
    return store if isinstance(store, TraceStore) else TraceStore(store)


def retrieved_ids(store: TraceStore | str | os.PathLike[str], run_id: str) -> list[str]:
    """Doc ids of the snippets run `run_id` retrieved over all its retrievals, deduplicated, in retrieval order.

    A run without retrieval (CoT), or one not in the store, has none.
    """
    snippet_ids = (s.get("id") for r in _store(store).retrievals(run_id) for s in r["snippets"] or [])
    return list(dict.fromkeys(doc_id(i) for i in snippet_ids if i))


# ------------------------------------------------------------------------------------------------ scores


def _fallback_precision(retrieved: Sequence[str], reference: Sequence[str]) -> float:
    got, gold = set(map(str, retrieved)), set(map(str, reference))
    return len(got & gold) / len(got) if got else math.nan


def _fallback_recall(retrieved: Sequence[str], reference: Sequence[str]) -> float:
    got, gold = set(map(str, retrieved)), set(map(str, reference))
    return len(got & gold) / len(gold) if gold else math.nan


def metric_classes() -> dict[str, type | None]:
    """The ragas classes that compute context precision and recall (None with the fallback)."""
    return {"context_precision": IDBasedContextPrecision, "context_recall": IDBasedContextRecall}


def _run(coro_fn: Any) -> Any:
    """asyncio.run(coro_fn()), also from code already inside an event loop (then in a worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(coro_fn())).result()


def _finite(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


async def _id_scores(pairs: Sequence[tuple[Sequence[str], Sequence[str]]]) -> list[tuple[float, float]]:
    precision, recall = IDBasedContextPrecision(), IDBasedContextRecall()

    async def one(retrieved: Sequence[str], reference: Sequence[str]) -> tuple[float, float]:
        sample = SingleTurnSample(retrieved_context_ids=list(retrieved), reference_context_ids=list(reference))
        return (await precision.single_turn_ascore(sample), await recall.single_turn_ascore(sample))

    return list(await asyncio.gather(*(one(r, g) for r, g in pairs)))


def id_scores(pairs: Sequence[tuple[Sequence[str], Sequence[str]]]) -> list[tuple[float | None, float | None]]:
    """(precision, recall) for each (retrieved ids, reference ids) pair; None where undefined (empty set)."""
    if not pairs:
        return []
    if BACKEND == "ragas":
        raw = _run(lambda: _id_scores(pairs))
    else:
        raw = [(_fallback_precision(r, g), _fallback_recall(r, g)) for r, g in pairs]
    return [(_finite(p), _finite(r)) for p, r in raw]


def context_scores(retrieved: Sequence[str], gold: GoldEvidence) -> dict[str, float | None]:
    """Context precision and recall of one run's retrieved doc ids against `gold` (recall None if incomplete)."""
    return _scores_for([(list(retrieved), gold)])[0]


def _scores_for(items: Sequence[tuple[list[str], GoldEvidence]]) -> list[dict[str, float | None]]:
    raw = id_scores([(retrieved, gold.reference_ids(retrieved)) for retrieved, gold in items])
    return [
        {"context_precision": p, "context_recall": r if gold.complete else None}
        for (p, r), (_, gold) in zip(raw, items)
    ]


def _result_rows(result_dirs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    paths = [result_dirs] if isinstance(result_dirs, (str, os.PathLike)) else list(result_dirs)
    rows: list[dict[str, Any]] = []
    for path in map(Path, paths):
        rows.extend(read_records(path if path.is_file() else path / RESULTS))
    return rows


def _system(row: Mapping[str, Any], store: TraceStore) -> str:
    system = (row.get("config") or {}).get("system") or row.get("system")
    if not system and row.get("run_id"):
        system = (store.run(row["run_id"]) or {}).get("graph")
    return str(system or "unknown")


def _mean(values: list[float | None]) -> tuple[float | None, int]:
    known = [v for v in values if v is not None]
    return (sum(known) / len(known) if known else None), len(known)


def rag_quality(
    result_dirs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    trace_db: TraceStore | str | os.PathLike[str],
    qrels_path: str | os.PathLike[str] | None = None,
    corpus_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Mean context precision and recall per (system, benchmark) over result rows with gold evidence.

    `result_dirs`: runner output folders (their `results.jsonl`) or results files. Rows are left out, and
    counted under `skipped`, when their benchmark has no gold evidence (`no_gold`), their run is not in the
    trace store (`no_run`), or the run retrieved nothing (`no_retrieval`: CoT). Each group reports `n` (rows
    scored), the means, and `n_recall` (rows whose recall is defined: all of them for BioASQ and for
    PubMedQA with `corpus_dir`, none for PubMedQA without it).
    """
    store = _store(trace_db)
    skipped = {"no_gold": 0, "no_run": 0, "no_retrieval": 0}
    notes: list[str] = []
    unavailable: set[str] = set()
    items: list[tuple[tuple[str, str], str, list[str], GoldEvidence]] = []
    for row in _result_rows(result_dirs):
        benchmark = str(row.get("benchmark") or "")
        family = benchmark_family(benchmark)
        if family is None or family in unavailable:
            skipped["no_gold"] += 1
            continue
        try:
            gold = gold_evidence(str(row.get("question_id")), benchmark, qrels_path, corpus_dir)
        except FileNotFoundError as err:
            unavailable.add(family)
            notes.append(str(err))
            skipped["no_gold"] += 1
            continue
        if gold is None:
            skipped["no_gold"] += 1
            continue
        run_id = row.get("run_id")
        if not run_id or store.run(run_id) is None:
            skipped["no_run"] += 1
            continue
        retrieved = retrieved_ids(store, run_id)
        if not retrieved:
            skipped["no_retrieval"] += 1
            continue
        items.append(
            ((_system(row, store), benchmark), str((row.get("config") or {}).get("model") or ""), retrieved, gold)
        )

    scores = _scores_for([(retrieved, gold) for _, _, retrieved, gold in items])
    grouped: dict[tuple[str, str], list[tuple[str, dict[str, float | None]]]] = defaultdict(list)
    for (key, model, _, _), score in zip(items, scores):
        grouped[key].append((model, score))
    groups = []
    for (system, benchmark), entries in sorted(grouped.items()):
        precision, _ = _mean([s["context_precision"] for _, s in entries])
        recall, n_recall = _mean([s["context_recall"] for _, s in entries])
        groups.append(
            {
                "system": system,
                "benchmark": benchmark,
                "n": len(entries),
                "context_precision": precision,
                "context_recall": recall,
                "n_recall": n_recall,
                "models": sorted({m for m, _ in entries if m}),
            }
        )
    classes = metric_classes()
    return {
        "backend": BACKEND,
        "metrics": {
            name: f"{cls.__module__}.{cls.__qualname__}" if cls else "fallback" for name, cls in classes.items()
        },
        "groups": groups,
        "skipped": skipped,
        "notes": notes,
        "trace_db": str(store.path),
    }


def empty_reason(quality: Mapping[str, Any]) -> str | None:
    """Why `rag_quality` scored no row, in one line (None when it scored some): how many rows were left out for
    each reason, and its notes (a missing qrels file). An empty table would leave the reader guessing."""
    if quality["groups"]:
        return None
    counts = {key: n for key, n in quality["skipped"].items() if n}
    if not counts:
        return "No context precision/recall: the results hold no rows."
    trace_db = quality.get("trace_db") or "given"
    parts = [f"{n} {SKIPPED_WHY[key].format(trace_db=trace_db)}" for key, n in counts.items()]
    notes = "".join(f" {note.rstrip('.')}." for note in quality.get("notes") or [])
    return f"No context precision/recall: of {sum(counts.values())} results, {'; '.join(parts)}.{notes}"


# ------------------------------------------------------------------------------------------------- judge


class JudgeUnavailable(ValueError):
    """judge_metrics was called without a judge model (or with one that cannot be built)."""


def _sentence_transformer_embeddings(encoder: str) -> Any:
    """ragas embeddings over a local sentence-transformers model (the packaged MiniLM by default)."""
    from langchain_core.embeddings import Embeddings
    from ragas.embeddings import LangchainEmbeddingsWrapper

    from ermedrag.tools.retrieval.encoder import DEFAULT_ENCODER, encode, load_encoder

    name = encoder or DEFAULT_ENCODER
    load_encoder(name)  # now: a missing model fails here, not in the middle of the judging

    class SentenceTransformerEmbeddings(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return encode(list(texts), name).tolist()  # the project's encoding: unit vectors in float32

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return LangchainEmbeddingsWrapper(SentenceTransformerEmbeddings())


def build_judge(
    judge_model: str | None,
    base_url: str | None = None,
    *,
    relevancy: bool = True,
    embeddings: Any = None,
    encoder: str | None = None,
    max_new_tokens: int = 1024,
) -> dict[str, Any]:
    """The ragas metrics of `judge_metrics`, built around the judge `judge_model` (a model spec of ours).

    `embeddings`: a ragas embeddings object (or a LangChain `Embeddings`) for ResponseRelevancy; None builds
    the offline sentence-transformers one; `relevancy=False` leaves ResponseRelevancy out.
    """
    if not judge_model:
        raise JudgeUnavailable(
            "judge_metrics needs a judge model: pass judge_model, e.g. 'openai:Qwen/Qwen3-8B' with base_url "
            "of an OpenAI-compatible server, or 'hf:<local model path>'"
        )
    from ragas.embeddings.base import BaseRagasEmbeddings
    from ragas.llms import LangchainLLMWrapper
    from ragas.metrics._answer_relevance import ResponseRelevancy
    from ragas.metrics._faithfulness import Faithfulness

    from ermedrag.tools.models import load_chat_model

    chat = load_chat_model(judge_model, base_url=base_url, temperature=0.0, max_new_tokens=max_new_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        llm = LangchainLLMWrapper(chat)
        metrics: dict[str, Any] = {"faithfulness": Faithfulness(llm=llm)}
        if relevancy:
            if embeddings is None:
                embeddings = _sentence_transformer_embeddings(encoder or "")
            elif not isinstance(embeddings, BaseRagasEmbeddings):
                from ragas.embeddings import LangchainEmbeddingsWrapper

                embeddings = LangchainEmbeddingsWrapper(embeddings)
            metrics["answer_relevancy"] = ResponseRelevancy(llm=llm, embeddings=embeddings)
    return metrics


def judge_samples(
    result_rows: Iterable[Mapping[str, Any]], trace_db: TraceStore | str | os.PathLike[str]
) -> list[dict[str, Any]]:
    """Rows for `judge_metrics` from runner result rows and their traces (runs without contexts left out).

    user_input: the question; response: the respondent's reasoning and its answer (with the option text);
    retrieved_contexts: the snippet texts the extractor read (ER-MedRAG) or else the evidence block the
    respondent read (vanilla RAG); a run that retrieved nothing (CoT) has none.
    """
    store = _store(trace_db)
    samples = []
    for row in result_rows:
        run_id = row.get("run_id")
        if not run_id or not store.retrievals(run_id):
            continue
        snippets, respondent = [], None
        for event in store.events(run_id=run_id):
            inputs = event.get("inputs") or {}
            if inputs.get("snippet"):
                snippets.append(str(inputs["snippet"]))
            if event.get("agent") == "respondent":
                respondent = event
        if respondent is None:
            continue
        inputs = respondent.get("inputs") or {}
        parsed = respondent.get("parsed") or {}
        evidence = inputs.get("evidence")
        contexts = snippets or ([evidence] if isinstance(evidence, str) and evidence.strip() else [])
        if not contexts:
            continue
        answer = parsed.get("answer")
        option = (inputs.get("options") or {}).get(answer) if answer else None
        final = f"{answer}. {option}" if option else str(answer or "")
        response = "\n".join(
            p for p in (str(parsed.get("reasoning") or "").strip(), f"Answer: {final}" if final else "") if p
        )
        samples.append(
            {
                "user_input": inputs.get("question") or "",
                "response": response or respondent["completion"],
                "retrieved_contexts": contexts,
                "run_id": run_id,
                "benchmark": row.get("benchmark"),
                "question_id": row.get("question_id"),
                "system": (row.get("config") or {}).get("system") or row.get("system"),
            }
        )
    return samples


def judge_metrics(
    rows: Iterable[Mapping[str, Any]],
    judge_model: str | None,
    base_url: str | None = None,
    *,
    relevancy: bool = True,
    embeddings: Any = None,
    encoder: str | None = None,
    concurrency: int = 4,
    timeout_s: float | None = 300.0,
) -> dict[str, Any]:
    """LLM-judged ragas Faithfulness (and ResponseRelevancy) of each row, and their means.

    `rows`: dicts with ragas' `user_input`, `response` and `retrieved_contexts` (see `judge_samples`); other
    keys are passed through. A row whose judging fails (unparseable judge output, timeout) gets None and its
    error; the means are over the rows that were scored.
    """
    metrics = build_judge(judge_model, base_url, relevancy=relevancy, embeddings=embeddings, encoder=encoder)
    rows = [dict(r) for r in rows]

    async def score_all() -> list[dict[str, Any]]:
        semaphore = asyncio.Semaphore(max(1, concurrency))

        async def one(row: dict[str, Any]) -> dict[str, Any]:
            sample = SingleTurnSample(
                user_input=str(row.get("user_input") or ""),
                response=str(row.get("response") or ""),
                retrieved_contexts=[str(c) for c in row.get("retrieved_contexts") or []],
            )
            out = dict(row)
            async with semaphore:
                for name, metric in metrics.items():
                    try:
                        out[name] = _finite(await metric.single_turn_ascore(sample, timeout=timeout_s))
                    except Exception as err:  # noqa: BLE001 - one bad judge reply must not lose the others
                        out[name] = None
                        out.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:300]
            return out

        return list(await asyncio.gather(*(one(r) for r in rows)))

    scored = _run(score_all) if rows else []
    means = {}
    for name in metrics:
        mean, n = _mean([r.get(name) for r in scored])
        means[name] = {"mean": mean, "n": n}
    return {
        "judge": judge_model,
        "metrics": {n: f"{type(m).__module__}.{type(m).__qualname__}" for n, m in metrics.items()},
        "relevancy_skipped": None if "answer_relevancy" in metrics else "relevancy=False",
        "rows": scored,
        "summary": means,
    }
