"""Steps every graph takes: open a run, retrieve and record it, call an agent's model and record the call, read an
answer (once more when it names no option), respond from evidence; and the resources they use, built once per
configuration (chat models, the index, the trace store)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage

from ermedrag.agents import respondent
from ermedrag.agents.citations import EvidenceItem, cite
from ermedrag.agents.confidence import answer_prefix
from ermedrag.graphs.context import Context, sampling, server_policy
from ermedrag.graphs.state import validate_question
from ermedrag.tools.agent_calls import call_agent
from ermedrag.tools.cache import shared_resource
from ermedrag.tools.model_server import ModelServerError, ServerPolicy
from ermedrag.tools.models import load_chat_model
from ermedrag.tools.records.traces import RetrievalEvent, TraceEvent, TraceStore, default_trace_db, snippet_record
from ermedrag.tools.retrieval.index import Index, cached_index
from ermedrag.tools.retrieval.search import DEFAULT_CONFIG, RetrievalConfig, coarse_k_for, retrieval_settings
from ermedrag.tools.retrieval.search import retrieve as retrieve_snippets

Parsed = TypeVar("Parsed")


def chat_model(ctx: Context, spec: str, max_new_tokens: int) -> BaseChatModel:
    return _cached_chat_model(spec, ctx.base_url or None, ctx.temperature, max_new_tokens, server_policy(ctx))


@shared_resource(maxsize=16)
def _cached_chat_model(
    spec: str, base_url: str | None, temperature: float, max_new_tokens: int, policy: ServerPolicy
) -> BaseChatModel:
    """One model per distinct configuration: the timeouts and retries are part of it (a model built with
    other ones must not be handed out)."""
    return load_chat_model(
        spec,
        base_url=base_url,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        timeout_s=policy.timeout_s,
        connect_timeout_s=policy.connect_timeout_s,
        max_retries=policy.max_retries,
        retry_backoff_s=policy.retry_backoff_s,
    )


def index_for(ctx: Context) -> Index:
    if ctx.index_dir:
        return cached_index(str(Path(ctx.index_dir).expanduser()), ctx.chroma_url or None)
    from ermedrag.tools.data.starter_kb import starter_index_dir

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


def begin_run(
    state: Mapping[str, Any], ctx: Context, graph_name: str, fresh: tuple[str, ...] = ("timings",)
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
    setup = prepare(ctx, graph_name)
    store.record_setup(run_id, setup)
    return {"run_id": run_id, "question": question, "options": options, "gold": gold, "setup": setup} | dict.fromkeys(
        fresh
    )


WARM_UP_TOKENS = 1  # the budget of the model built to load weights: every budget's model shares them


def prepare(ctx: Context, graph_name: str) -> dict[str, float]:
    """Load what a run of the graph will use, before its stages start: the weights of each chat model its context
    names (the offline model is converted on first use), the index, its query encoder and the reranker. So that a
    stage's time is its own work, and the load is timed apart: seconds per part and `setup_s` (the wall time; about
    zero once loaded, as everything here is kept for the process).

    One part after another, not in threads: transformers imports its modules lazily and not thread-safely (a model
    and an encoder loading side by side failed with "cannot import name 'AutoTokenizer'"), and most of a load is
    imports, which hold the GIL: in threads the offline default's setup took 9.5 s, one after another 9.4 s."""
    from ermedrag.graphs.registry import graph_spec
    from ermedrag.tools.retrieval.encoder import load_encoder
    from ermedrag.tools.retrieval.search import load_cross_encoder

    uses = graph_spec(graph_name).settings
    jobs: dict[str, Callable[[], Any]] = {}
    for spec in dict.fromkeys(getattr(ctx, name) or ctx.respondent_model for name in uses if name.endswith("_model")):
        jobs[f"model {spec}"] = lambda spec=spec: _load_weights(chat_model(ctx, spec, WARM_UP_TOKENS))
    if "index_dir" in uses:
        jobs["index"] = lambda: load_encoder(index_for(ctx).encoder)
        if ctx.reranker:
            jobs["reranker"] = lambda: load_cross_encoder(ctx.reranker)
    started = time.perf_counter()
    seconds = {f"{name}_s": round(_timed_call(job), 3) for name, job in jobs.items()}
    return seconds | {"setup_s": round(time.perf_counter() - started, 3)}


def _timed_call(job: Callable[[], Any]) -> float:
    started = time.perf_counter()
    job()
    return time.perf_counter() - started


def _load_weights(model: Any) -> None:
    """In-process backends load their weights at their first call; load them now. A model server (openai:) is not
    called: a server that is down fails the run at its first call, naming it."""
    warm = getattr(model, "warm_up", None)
    if callable(warm):
        warm()


def retrieve_recorded(
    ctx: Context, query: str, *, run_id: str, node: str, k: int, coarse_k: int
) -> tuple[list[dict[str, Any]], float]:
    """Coarse-to-fine retrieval with the context's index and settings, recorded as a retrieval event of the
    run; the snippets (as plain dicts) and the seconds the retrieval took."""
    index, config = index_for(ctx), retrieval_config(ctx)
    started = time.perf_counter()
    snippets = [s.to_dict() for s in retrieve_snippets(index, query, k=k, coarse_k=coarse_k, config=config)]
    seconds = time.perf_counter() - started
    trace_store(ctx).add_retrieval(
        RetrievalEvent(
            run_id=run_id,
            node=node,
            query=query,
            snippets=[snippet_record(s) for s in snippets],
            settings=retrieval_settings(k, coarse_k, config),
            index_info=index.identity(),
            latency_s=seconds,
        )
    )
    return snippets, seconds


def retrieve_evidence(ctx: Context, question: str, *, run_id: str, node: str) -> dict[str, Any]:
    """The question's snippets, retrieved and recorded, as a state update (with the stage's timing)."""
    snippets, seconds = retrieve_recorded(
        ctx, question, run_id=run_id, node=node, k=ctx.snippets_k, coarse_k=coarse_k_for(ctx.snippets_k, ctx.coarse_k)
    )
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
    invoke_kwargs: dict[str, Any] | None = None,
) -> tuple[Parsed, TraceEvent]:
    """Call an agent's model once (the context's model `model_spec`, with its sampling, timeouts and retries)
    and record the call as an event of the run: how every graph node calls a model. A call that fails (a model
    server that did not answer, ...) marks the run failed with its error, then the error goes on up."""
    try:
        parsed, event = call_agent(
            chat_model(ctx, model_spec, max_new_tokens),
            messages,
            parse,
            agent=agent,
            node=node,
            run_id=run_id,
            sampling=sampling(ctx, model_spec, max_new_tokens),
            gold=gold,
            stop=stop,
            inputs=inputs,
            invoke_kwargs=invoke_kwargs,
        )
    except Exception as err:
        trace_store(ctx).fail_run(run_id, f"{node}: {type(err).__name__}: {err}")
        raise
    trace_store(ctx).add_event(event)
    return parsed, event


REQUEST_REJECTED = ("http_4xx:400", "http_4xx:422")  # a server refusing the request's shape, not failing


def soft_failure(err: Exception, setting: str) -> str:
    """Why an optional call (answer extraction, answer scoring) gave nothing, in one line; re-raises a server that is
    down (the run stops there, naming it). A server refusing the call's shape is told to set `setting` false."""
    if isinstance(err, ModelServerError) and err.server_down:
        raise err
    if getattr(err, "cause", "") in REQUEST_REJECTED:
        # E.g. a server that takes no continued assistant turn (only vLLM's takes `continue_final_message`: HTTP
        # 400/422 elsewhere) or a chat template that rewrites it.
        return (
            "the server refused the request: it continues an assistant turn, which vLLM's server supports; set "
            f"{setting}=false for this server"
        )
    return " ".join(f"{type(err).__name__}: {err}".split())[:300]


def extract_if_unparsed(
    state: Mapping[str, Any], ctx: Context, model_spec: str, reply: respondent.Answer, reasoning: str
) -> respondent.Answer:
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
            ctx,
            model_spec,
            respondent.EXTRACTION_MAX_NEW_TOKENS,
            respondent.extraction_messages(state["question"], options, reasoning),
            lambda completion: respondent.parse_extracted(completion, options, reply),
            agent="answer_extractor",
            node="extract_answer",
            run_id=state["run_id"],
            gold=state.get("gold"),
            stop=respondent.STOP,
            inputs={"question": state["question"], "options": options, "reasoning": reasoning},
        )
    except Exception as err:  # noqa: BLE001 - the reply stands; only a server that is down stops the run
        # The reply stands, unparsed, and says why it was not read back; the run finishes (finish_run clears the
        # failure mark record_call set).
        why = soft_failure(err, "answer_extraction")
        return {**reply, "extracted": False, "error": f"{reply['error']}; answer extraction failed ({why})"}
    return extracted


SCORER_AGENT = "answer_scorer"  # its calls are never a reply: training and answer counts skip them


def with_confidence(
    state: Mapping[str, Any],
    ctx: Context,
    model_spec: str,
    messages: list[BaseMessage],
    completion: str,
    answer: respondent.Answer,
) -> respondent.Answer:
    """`answer` with how sure it is (`agents.confidence`): one recorded one-token call continuing `messages` with
    what the agent wrote in `completion` up to its `<answer>` reads the option letters' log-probabilities there.
    For multiple-choice questions, when `ctx.answer_scores` is on; an answer without scores says why."""
    from langchain_core.messages import AIMessage

    from ermedrag.agents.confidence import answered_by_letter, confidence, option_probabilities

    options = state.get("options")
    if not options or not ctx.answer_scores:
        return answer
    if not answered_by_letter(completion, options):
        why = "none: the answer names its option by its text, so the letters' probabilities are not what it chose"
        return {**answer, "option_probs": None, "confidence": None, "confidence_source": why}
    prefix = answer_prefix(completion, answer["reasoning"])
    can_score = getattr(chat_model(ctx, model_spec, 1), "scores_answer_tokens", None)
    if not callable(can_score) or not can_score():
        why = (
            "none: this backend cannot score the option letters where the answer starts (hf, llamacpp and vLLM's "
            "server can); eval --samples N gives sampled frequencies"
        )
        return {**answer, "option_probs": None, "confidence": None, "confidence_source": why}
    try:
        _, event = record_call(
            ctx,
            model_spec,
            1,
            [*messages, AIMessage(content=prefix)],
            lambda completion: None,
            agent=SCORER_AGENT,
            node="score_answer",
            run_id=state["run_id"],
            gold=state.get("gold"),
            inputs={"question": state["question"], "options": options, "answer_prefix": prefix},
            invoke_kwargs={"score_tokens": list(options)},
        )
    except Exception as err:  # noqa: BLE001 - the answer stands; only a server that is down stops the run
        why = f"none: scoring failed ({soft_failure(err, 'answer_scores')})"
        return {**answer, "option_probs": None, "confidence": None, "confidence_source": why}
    first = (event.logprobs or [{}])[0]
    probs = option_probabilities(first.get("top_logprobs"), options)
    source = (
        "option_logprobs"
        if probs is not None
        else "none: the backend gave no log-probabilities of the option letters; eval --samples N gives frequencies"
    )
    return {
        **answer,
        "option_probs": probs,
        "confidence": confidence(probs, answer["answer"]),
        "confidence_source": source,
    }


def answer_call(
    ctx: Context,
    model_spec: str,
    max_new_tokens: int,
    messages: list[BaseMessage],
    state: Mapping[str, Any],
    *,
    agent: str,
    node: str,
    inputs: dict[str, Any],
    shown: Sequence[EvidenceItem] = (),
    score: bool = False,
) -> respondent.Answer:
    """One recorded call whose reply is an answer in `<think>…</think><answer>…</answer>` (the respondent, a
    specialist, the attending): parsed, read back once when it names no option (`extract_if_unparsed`), with the
    citations of its reasoning resolved against the evidence items it was `shown` (numbered as in its prompt), and
    with `score`, its confidence (`with_confidence`). `state` holds the run id, question, options and gold."""
    options = state.get("options")
    reply, event = record_call(
        ctx,
        model_spec,
        max_new_tokens,
        messages,
        lambda completion: respondent.parse_answer(completion, options),
        agent=agent,
        node=node,
        run_id=state["run_id"],
        gold=state.get("gold"),
        stop=respondent.STOP,
        inputs=inputs,
    )
    answer = extract_if_unparsed(state, ctx, model_spec, reply, reply["reasoning"])
    if score:
        answer = with_confidence(state, ctx, model_spec, messages, event.completion, answer)
    return {**answer, "citations": cite(answer["reasoning"], shown)}


def respond_with(
    state: Mapping[str, Any], ctx: Context, evidence: str, shown: Sequence[EvidenceItem] = ()
) -> dict[str, Any]:
    """Call the respondent on `evidence` (and extract its answer when it names none), resolve its citations
    against the `shown` items `evidence` renders, record the calls, close the run; the state update."""
    started = time.perf_counter()
    answer = answer_call(
        ctx,
        ctx.respondent_model,
        ctx.respondent_max_new_tokens,
        respondent.build_messages(state["question"], state.get("options"), evidence),
        state,
        agent="respondent",
        node="respond",
        inputs={"question": state["question"], "options": state.get("options"), "evidence": evidence},
        shown=shown,
        score=True,
    )
    trace_store(ctx).finish_run(state["run_id"], dict(answer))
    return {"answer": answer, "timings": {"respond_s": time.perf_counter() - started}}
