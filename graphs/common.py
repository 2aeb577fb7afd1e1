"""What the graphs share: the context schema (Studio edits it) and the cached resources nodes use."""

from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage

from ermedrag.agents import respondent
from ermedrag.tools.agent_calls import call_agent

from ermedrag.tools.chat_models import (DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_MAX_RETRIES, DEFAULT_MODEL,
                                        DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_RETRY_BACKOFF_S, ModelServerError,
                                        ServerPolicy, load_chat_model)
from ermedrag.tools.openai_server import MAX_TEMPERATURE
from ermedrag.tools.index import Index, cached_index
from ermedrag.tools.retrieval import (COARSE_K, DEFAULT_CONFIG, SNIPPETS_K, RetrievalConfig, coarse_k_for,
                                      retrieval_settings)
from ermedrag.tools.retrieval import retrieve as retrieve_snippets
from ermedrag.tools.traces import RetrievalEvent, TraceEvent, TraceStore, default_trace_db, snippet_record
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.env import parse_bool  # noqa: F401 - re-exported: evals and tests import it from here

MAX_OPTIONS = 26
OPTION_KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
Parsed = TypeVar("Parsed")


def env(name: str, default: str) -> Any:
    return field(default_factory=lambda: os.environ.get(name, default))


def env_model(name: str) -> Any:
    return field(default_factory=lambda: os.environ.get(name) or os.environ.get("ERMEDRAG_MODEL", DEFAULT_MODEL))


def _from_env(name: str, default: Any, kind: type) -> Any:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be a{'n' if kind is int else ''} "
                         f"{kind.__name__}") from None


def env_int(name: str, default: int) -> Any:
    return field(default_factory=lambda: _from_env(name, default, int))


def env_float(name: str, default: float) -> Any:
    return field(default_factory=lambda: _from_env(name, default, float))


def env_bool(name: str, default: bool) -> Any:
    def read() -> bool:
        value = os.environ.get(name)
        try:
            return default if value is None else parse_bool(value)
        except ValueError as err:
            raise ValueError(f"environment variable {name}: {err}") from None
    return field(default_factory=read)


@dataclass(kw_only=True)
class Context:
    """Run configuration. Each field falls back to the environment variable named in its comment."""

    extractor_model: str = env_model("ERMEDRAG_EXTRACTOR_MODEL")
    """Extractor chat model, 'provider:name' (hf:, offline:, openai:, vllm:). Env ERMEDRAG_EXTRACTOR_MODEL."""
    respondent_model: str = env_model("ERMEDRAG_RESPONDENT_MODEL")
    """Respondent chat model. Env ERMEDRAG_RESPONDENT_MODEL (both fall back to ERMEDRAG_MODEL)."""
    base_url: str = env("OPENAI_BASE_URL", "")
    """OpenAI-compatible server for openai: models, e.g. http://127.0.0.1:8000/v1. Env OPENAI_BASE_URL."""
    index_dir: str = env("ERMEDRAG_INDEX_DIR", "")
    """Corpus index built by `ermedrag index`; empty = the starter knowledge base. Env ERMEDRAG_INDEX_DIR."""
    chroma_url: str = env("ERMEDRAG_CHROMA_URL", "")
    """A Chroma server (http://host:port) instead of the embedded store. Env ERMEDRAG_CHROMA_URL."""
    coarse_k: int = env_int("ERMEDRAG_COARSE_K", COARSE_K)
    """Chunks kept by the coarse stage (BM25 + dense fused, pseudo-relevance feedback); at least `snippets_k` are
    kept, so each snippet can come from its own chunk. Env ERMEDRAG_COARSE_K."""
    reranker: str = env("ERMEDRAG_RERANKER", "")
    """Cross-encoder (HF id or folder, e.g. ncbi/MedCPT-Cross-Encoder) re-scoring the coarse chunks; empty = off.
    Env ERMEDRAG_RERANKER."""
    snippets_k: int = env_int("ERMEDRAG_SNIPPETS_K", SNIPPETS_K)
    """Snippets kept by the fine stage: one extractor call each. Env ERMEDRAG_SNIPPETS_K."""
    temperature: float = env_float("ERMEDRAG_TEMPERATURE", 0.0)
    """Sampling temperature for every agent (0 = greedy)."""
    extractor_max_new_tokens: int = env_int("ERMEDRAG_EXTRACTOR_MAX_NEW_TOKENS", 96)
    """Generation budget of one extractor call."""
    respondent_max_new_tokens: int = env_int("ERMEDRAG_RESPONDENT_MAX_NEW_TOKENS", 192)
    """Generation budget of the respondent."""
    answer_extraction: bool = env_bool("ERMEDRAG_ANSWER_EXTRACTION", True)
    """When a reply names no option, ask the model once more for the letter alone, from its own reasoning
    (answer extraction); the answer is marked `extracted` and never well formed. Env ERMEDRAG_ANSWER_EXTRACTION."""
    trace_db: str = env("ERMEDRAG_TRACE_DB", "")
    """SQLite file of recorded runs; empty = ~/.cache/ermedrag/traces.sqlite. Env ERMEDRAG_TRACE_DB."""
    # How long a model server (openai: models) may take. They change when an answer arrives, never which one:
    # not part of any graph's settings (graphs.registry), so results do not split on them.
    request_timeout_s: float = env_float("ERMEDRAG_REQUEST_TIMEOUT_S", DEFAULT_REQUEST_TIMEOUT_S)
    """Seconds a model server may take to answer one request (read timeout). Env ERMEDRAG_REQUEST_TIMEOUT_S."""
    connect_timeout_s: float = env_float("ERMEDRAG_CONNECT_TIMEOUT_S", DEFAULT_CONNECT_TIMEOUT_S)
    """Seconds to open a connection to a model server. Env ERMEDRAG_CONNECT_TIMEOUT_S."""
    max_retries: int = env_int("ERMEDRAG_MAX_RETRIES", DEFAULT_MAX_RETRIES)
    """Retries of a failed model-server request (refused, timed out, dropped, 408/409/429/5xx); 0 = none.
    Env ERMEDRAG_MAX_RETRIES."""
    retry_backoff_s: float = env_float("ERMEDRAG_RETRY_BACKOFF_S", DEFAULT_RETRY_BACKOFF_S)
    """Wait before the first retry; it doubles per retry (capped at 8 s). Env ERMEDRAG_RETRY_BACKOFF_S."""

    def __post_init__(self) -> None:
        # Counts, budgets, temperatures and timeouts are finite and never negative: a negative k would reach a
        # Python slice and silently mean "all but the last few", a NaN temperature a server as a request it
        # refuses. Subclasses (Med-R³'s budgets) are checked the same way.
        for name, value in vars(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"context field {name!r} must be a finite number, got {value}")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"context field {name!r} must be >= 0, got {value}")
            if name == "temperature" and value > MAX_TEMPERATURE:
                raise ValueError(f"context field 'temperature' must be at most {MAX_TEMPERATURE:g}, got {value}")


def sampling(ctx: Context, model: str, max_new_tokens: int) -> dict[str, Any]:
    return {"model": model, "temperature": ctx.temperature, "max_new_tokens": max_new_tokens}


def server_policy(ctx: Context) -> ServerPolicy:
    """The context's timeouts and retries (a ValueError naming the field when one is out of range)."""
    return ServerPolicy(ctx.request_timeout_s, ctx.connect_timeout_s, ctx.max_retries, ctx.retry_backoff_s)


def chat_model(ctx: Context, spec: str, max_new_tokens: int) -> BaseChatModel:
    return _cached_chat_model(spec, ctx.base_url or None, ctx.temperature, max_new_tokens, server_policy(ctx))


@shared_resource(maxsize=16)
def _cached_chat_model(spec: str, base_url: str | None, temperature: float, max_new_tokens: int,
                       policy: ServerPolicy) -> BaseChatModel:
    """One model per distinct configuration: the timeouts and retries are part of it (a model built with
    other ones must not be handed out)."""
    return load_chat_model(spec, base_url=base_url, temperature=temperature, max_new_tokens=max_new_tokens,
                           timeout_s=policy.timeout_s, connect_timeout_s=policy.connect_timeout_s,
                           max_retries=policy.max_retries, retry_backoff_s=policy.retry_backoff_s)


def index_for(ctx: Context) -> Index:
    if ctx.index_dir:
        return cached_index(str(Path(ctx.index_dir).expanduser()), ctx.chroma_url or None)
    from ermedrag.tools.starter_kb import starter_index_dir

    return cached_index(str(starter_index_dir()), None)


def retrieval_config(ctx: Context) -> RetrievalConfig:
    """The tuned defaults, with the context's reranker when one is set (over at least its coarse chunks)."""
    if not ctx.reranker:
        return DEFAULT_CONFIG
    return replace(DEFAULT_CONFIG, reranker=ctx.reranker, rerank_k=max(ctx.coarse_k, DEFAULT_CONFIG.rerank_k))


def trace_store(ctx: Context) -> TraceStore:
    return _cached_store(ctx.trace_db or default_trace_db())


@shared_resource(maxsize=8)
def _cached_store(path: str) -> TraceStore:
    return TraceStore(path)


def validate_question(state: Mapping[str, Any]) -> tuple[str, dict[str, str] | None]:
    """The question and options of the input, or a ValueError that names what is wrong."""
    question = state.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("input 'question' must be a non-empty string")
    options = state.get("options")
    if options is None or options == {}:
        return question.strip(), None
    if not isinstance(options, Mapping):
        raise ValueError(f"input 'options' must be a mapping like {{'A': '...'}}, got {type(options).__name__}")
    if len(options) > MAX_OPTIONS:
        raise ValueError(f"input 'options' has {len(options)} entries; at most {MAX_OPTIONS}")
    clean: dict[str, str] = {}
    given: dict[str, Any] = {}
    for key, text in options.items():
        letter = canonical_option_key(key)
        if letter in given:
            raise ValueError(f"input 'options' has both {given[letter]!r} and {key!r}: option keys are letters "
                             f"A-Z and a lowercase key is the same option as its uppercase one")
        if not isinstance(text, (str, int, float)):
            raise ValueError(f"input 'options' entry {key!r}: keys must be non-empty strings, values text "
                             f"(this value is a {type(text).__name__})")
        given[letter], clean[letter] = key, str(text)
    return question.strip(), clean


def canonical_option_key(key: Any) -> str:
    """An option key as every part downstream sees it: one uppercase letter A-Z ('b' and ' B ' are 'B'), or a
    ValueError naming the key. Answers are parsed into, and gold answers compared with, these keys."""
    letter = key.strip().upper() if isinstance(key, str) else None
    if letter is None or len(letter) != 1 or letter not in OPTION_KEYS:
        raise ValueError(f"input 'options' key {key!r}: option keys are single letters A-Z (e.g. 'A', 'B')")
    return letter


def per_question(combine: Callable[[Any, Any], Any], empty: Callable[[], Any] = list
                 ) -> Callable[[Any, Any], Any]:
    """A state channel's reducer that combines updates with `combine` and starts over on None: `begin_run` sends
    None to each such channel (`fresh`), so a new question on a thread that answered one before (Studio, a
    reused `thread_id`) never inherits its documents, opinions, segments or timings."""
    def reduce(current: Any, new: Any) -> Any:
        if new is None:
            return empty()
        return combine(empty() if current is None else current, new)
    return reduce


def begin_run(state: Mapping[str, Any], ctx: Context, graph_name: str, fresh: tuple[str, ...] = ("timings",)
              ) -> dict[str, Any]:
    """Check the input and open its run in the trace store; the state update every graph starts with. `fresh`:
    the graph's `per_question` channels, emptied. The run id is the input's, unless it names a run that already
    finished or asked another question (the state of a reused thread): then the question gets a new run."""
    question, options = validate_question(state)
    gold = state.get("gold")
    if options and isinstance(gold, str) and gold.strip().upper() in options:
        gold = gold.strip().upper()  # the same canonical key as the options (and the parsed answers)
    store = trace_store(ctx)
    run_id = state.get("run_id")
    earlier = store.run(run_id) if run_id else None
    if earlier and (earlier.get("finished_at") or (earlier.get("question") or {}).get("question") != question):
        run_id = None
    run_id = run_id or uuid.uuid4().hex
    store.start_run(run_id, graph_name, {"question": question, "options": options}, gold)
    return {"run_id": run_id, "question": question, "options": options, "gold": gold} | dict.fromkeys(fresh)


def retrieve_recorded(ctx: Context, query: str, *, run_id: str, node: str, k: int, coarse_k: int
                      ) -> tuple[list[dict[str, Any]], float]:
    """Coarse-to-fine retrieval with the context's index and settings, recorded as a retrieval event of the
    run; the snippets (as plain dicts) and the seconds the retrieval took."""
    index, config = index_for(ctx), retrieval_config(ctx)
    started = time.perf_counter()
    snippets = [s.to_dict() for s in retrieve_snippets(index, query, k=k, coarse_k=coarse_k, config=config)]
    seconds = time.perf_counter() - started
    trace_store(ctx).add_retrieval(RetrievalEvent(
        run_id=run_id, node=node, query=query, snippets=[snippet_record(s) for s in snippets],
        settings=retrieval_settings(k, coarse_k, config), index_info=index.identity(), latency_s=seconds))
    return snippets, seconds


def retrieve_evidence(ctx: Context, question: str, *, run_id: str, node: str) -> dict[str, Any]:
    """The question's snippets, retrieved and recorded, as a state update (with the stage's timing)."""
    snippets, seconds = retrieve_recorded(ctx, question, run_id=run_id, node=node, k=ctx.snippets_k,
                                          coarse_k=coarse_k_for(ctx.snippets_k, ctx.coarse_k))
    return {"snippets": snippets, "timings": {"retrieve_s": seconds}}


def record_call(
    ctx: Context,
    model_spec: str,
    max_new_tokens: int,
    messages: list[BaseMessage],
    parse: Callable[[str], Parsed],
    *,
    agent: str,
    node: str,
    run_id: str,
    gold: str | None = None,
    stop: list[str] | None = None,
    inputs: dict[str, Any] | None = None,
) -> tuple[Parsed, TraceEvent]:
    """Call an agent's model once (the context's model `model_spec`, with its sampling, timeouts and retries)
    and record the call as an event of the run: how every graph node calls a model. A call that fails (a model
    server that did not answer, ...) marks the run failed with its error, then the error goes on up."""
    try:
        parsed, event = call_agent(
            chat_model(ctx, model_spec, max_new_tokens), messages, parse, agent=agent, node=node, run_id=run_id,
            sampling=sampling(ctx, model_spec, max_new_tokens), gold=gold, stop=stop, inputs=inputs)
    except Exception as err:
        trace_store(ctx).fail_run(run_id, f"{node}: {type(err).__name__}: {err}")
        raise
    trace_store(ctx).add_event(event)
    return parsed, event


REQUEST_REJECTED = ("http_4xx:400", "http_4xx:422")  # a server refusing the request's shape, not failing


def extract_if_unparsed(state: Mapping[str, Any], ctx: Context, model_spec: str, reply: respondent.Answer,
                        reasoning: str) -> respondent.Answer:
    """The reply's answer, or, when it names no option (and `ctx.answer_extraction` is on), one recorded
    answer-extraction call (`agents.respondent.extraction_messages`) that reads `reasoning` and writes the
    letter: every graph applies the same rule. Agent `answer_extractor`, so training never takes it for a reply."""
    options = state.get("options")
    if reply["ok"] or not options or not ctx.answer_extraction:
        return reply
    if not reasoning.strip():  # nothing to read back: an extraction would be a fresh guess, not the model's answer
        return {**reply, "extracted": False, "error": f"{reply['error']}; answer extraction: no reasoning to read"}
    try:
        extracted, _ = record_call(
            ctx, model_spec, respondent.EXTRACTION_MAX_NEW_TOKENS,
            respondent.extraction_messages(state["question"], options, reasoning),
            lambda completion: respondent.parse_extracted(completion, options, reply),
            agent="answer_extractor", node="extract_answer", run_id=state["run_id"], gold=state.get("gold"),
            stop=respondent.STOP, inputs={"question": state["question"], "options": options, "reasoning": reasoning},
        )
    except Exception as err:  # noqa: BLE001 - the reply stands; only a server that is down stops the run
        if isinstance(err, ModelServerError) and err.server_down:
            raise
        # E.g. a server that takes no continued assistant turn (only vLLM's takes `continue_final_message`: HTTP
        # 400/422 elsewhere) or a chat template that rewrites it: the reply stands, unparsed, and says why it was
        # not read back; the run finishes (finish_run clears the failure mark record_call set).
        why = ("the server refused the request: it continues an assistant turn, which vLLM's server supports; set "
               "answer_extraction=false for this server") if getattr(err, "cause", "") in REQUEST_REJECTED else \
            " ".join(f"{type(err).__name__}: {err}".split())[:300]
        return {**reply, "extracted": False, "error": f"{reply['error']}; answer extraction failed ({why})"}
    return extracted


def answer_call(ctx: Context, model_spec: str, max_new_tokens: int, messages: list[BaseMessage],
                state: Mapping[str, Any], *, agent: str, node: str, inputs: dict[str, Any]) -> respondent.Answer:
    """One recorded call whose reply is an answer in `<think>…</think><answer>…</answer>` (the respondent, a
    specialist, the attending): parsed, and read back once when it names no option (`extract_if_unparsed`).
    `state` holds the run id, question, options and gold."""
    options = state.get("options")
    reply, _ = record_call(ctx, model_spec, max_new_tokens, messages,
                           lambda completion: respondent.parse_answer(completion, options), agent=agent, node=node,
                           run_id=state["run_id"], gold=state.get("gold"), stop=respondent.STOP, inputs=inputs)
    return extract_if_unparsed(state, ctx, model_spec, reply, reply["reasoning"])


def respond_with(state: Mapping[str, Any], ctx: Context, evidence: str) -> dict[str, Any]:
    """Call the respondent on `evidence` (and extract its answer when it names none), record the calls, close
    the run; the state update."""
    started = time.perf_counter()
    answer = answer_call(
        ctx, ctx.respondent_model, ctx.respondent_max_new_tokens,
        respondent.build_messages(state["question"], state.get("options"), evidence), state,
        agent="respondent", node="respond",
        inputs={"question": state["question"], "options": state.get("options"), "evidence": evidence},
    )
    trace_store(ctx).finish_run(state["run_id"], dict(answer))
    return {"answer": answer, "timings": {"respond_s": time.perf_counter() - started}}
