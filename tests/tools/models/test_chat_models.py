"""Chat-model backends: spec errors, the scripted model's real overlap, and the real offline model."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import LLAMACPP_MARKS
from langchain_core.messages import HumanMessage

from ermedrag.agents.respondent import Answer
from ermedrag.graphs.er_medrag import graph
from ermedrag.graphs.steps import SCORER_AGENT
from ermedrag.tools.models import ModelSpecError, load_chat_model, parse_model_spec
from ermedrag.tools.models.hf import hf_generator
from ermedrag.tools.records.traces import TraceStore

OFFLINE = "offline:gemma3-270m"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt-4", "must look like 'provider:name'"),
        ("hf:", "must look like"),
        ("", "must look like"),
        ("nope:model", "unknown model provider 'nope'"),
    ],
)
def test_bad_model_specs_name_the_problem(spec, message):
    with pytest.raises(ModelSpecError, match=message):
        parse_model_spec(spec)


def test_openai_backend_needs_a_server(monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ModelSpecError, match="OPENAI_BASE_URL"):
        load_chat_model("openai:Qwen/Qwen3-8B")


def test_openai_backend_takes_its_timeouts_and_retries():
    model = load_chat_model(
        "openai:Qwen/Qwen3-8B",
        base_url="http://127.0.0.1:9/v1",
        timeout_s=7,
        connect_timeout_s=2,
        max_retries=4,
        retry_backoff_s=0.25,
    )
    assert (model.policy.timeout_s, model.policy.connect_timeout_s) == (7, 2)
    assert (model.policy.max_retries, model.policy.retry_backoff_s) == (4, 0.25)
    assert model.spec == "openai:Qwen/Qwen3-8B"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(timeout_s=0), r"request_timeout_s \(--timeout\) must be a positive number of seconds, got 0"),
        (dict(timeout_s=float("nan")), "request_timeout_s"),
        (dict(connect_timeout_s=-1), r"connect_timeout_s \(--connect-timeout\)"),
        (dict(max_retries=11), r"max_retries \(--retries\) must be an integer from 0 to 10"),
        (dict(retry_backoff_s=-0.5), "retry_backoff_s must be a non-negative"),
    ],
)
def test_openai_backend_refuses_bad_timeouts_naming_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_chat_model("openai:x", base_url="http://127.0.0.1:9/v1", **kwargs)


def test_vllm_backend_without_vllm_says_how_to_install():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        model = load_chat_model("vllm:Qwen/Qwen3-8B")
        with pytest.raises(ImportError, match=r"ermedrag\[gpu\]"):
            model.invoke("hello")
    else:
        pytest.skip("vllm is installed: the import guard is not reachable")


def test_scripted_calls_overlap_in_async_and_thread_batches():
    model = load_chat_model("scripted:ermedrag.testing.scripted", delay_s=0.5)
    prompts = [[HumanMessage(content=f"Question {i}?\nA. x\nB. y")] for i in range(6)]
    started = time.perf_counter()
    replies = asyncio.run(model.abatch(prompts))
    async_s = time.perf_counter() - started
    started = time.perf_counter()
    model.batch(prompts)
    thread_s = time.perf_counter() - started
    assert [r.text for r in replies] == ["<think>Scripted reasoning.</think><answer>A</answer>"] * 6
    assert async_s < 1.5 and thread_s < 1.5, (async_s, thread_s)


@pytest.mark.slow
def test_offline_model_reports_usage_logprobs_and_honours_stop():
    model = load_chat_model(OFFLINE, max_new_tokens=12)
    reply = model.invoke([HumanMessage(content="List three symptoms of anaemia.")])
    usage, entries = reply.usage_metadata, reply.response_metadata["logprobs"]["content"]
    assert usage["input_tokens"] > 5 and 0 < usage["output_tokens"] <= 12
    assert len(entries) == usage["output_tokens"]
    assert all(e["logprob"] <= 0 and e["entropy"] >= 0 for e in entries)
    assert reply.response_metadata["finish_reason"] in ("stop", "length")

    first_word = reply.text.split()[0] if reply.text.split() else None
    if first_word:
        stopped = model.invoke([HumanMessage(content="List three symptoms of anaemia.")], stop=[first_word])
        assert first_word not in stopped.text and stopped.response_metadata["stop_sequence"] == first_word


@pytest.mark.slow
def test_offline_model_batches_concurrent_calls():
    model = load_chat_model(OFFLINE, max_new_tokens=6)
    prompts = [[HumanMessage(content=f"Name organ number {i} of the body.")] for i in range(4)]
    sequential = [model.invoke(p).text for p in prompts]
    generator = hf_generator(model.model_path, model.device)
    before = len(generator.batch_sizes)
    batched = [r.text for r in model.batch(prompts)]
    assert max(generator.batch_sizes[before:]) > 1  # the four calls shared decoding steps
    assert len(batched) == 4 and all(isinstance(t, str) for t in batched)
    # Left padding changes float rounding only: greedy outputs agree on the whole for this tiny budget.
    assert sum(a == b for a, b in zip(sequential, batched)) >= 3, (sequential, batched)


@pytest.mark.slow
@pytest.mark.parametrize("model", [OFFLINE, pytest.param("llamacpp:gemma3-270m", marks=LLAMACPP_MARKS)])
def test_whole_graph_on_the_real_offline_model(tmp_path, model):
    context = {
        "extractor_model": model,
        "respondent_model": model,
        "trace_db": str(tmp_path / "t.sqlite"),
        "snippets_k": 2,
        "extractor_max_new_tokens": 48,
        "respondent_max_new_tokens": 48,
    }
    state = graph.invoke(
        {
            "question": "Which drug is first-line for type 2 diabetes?",
            "options": {"A": "Metformin", "B": "Insulin"},
            "gold": "A",
        },
        context=context,
    )
    assert len(state["snippets"]) == 2 and len(state["extractions"]) == 2
    # Every field `Answer` declares: the graph sets the cited evidence and the confidence (None, with its source,
    # where not scored), `extracted` only when the answer was read back.
    assert set(Answer.__annotations__) - {"extracted"} <= set(state["answer"]) <= set(Answer.__annotations__)
    events = list(TraceStore(context["trace_db"]).events(run_id=state["run_id"]))
    replies = [e["agent"] for e in events if e["agent"] != SCORER_AGENT]  # the scorer's call is no reply
    assert replies.count("extractor") == 2 and replies[-1] in ("respondent", "answer_extractor")
    for event in events:
        assert event["model"] == model and event["usage"]["output_tokens"] <= 48
        assert len(event["logprobs"]) == event["usage"]["output_tokens"]
