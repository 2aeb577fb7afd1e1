"""The openai: backend against a real OpenAI-compatible server: `transformers serve` with the offline model.

Gemma 3 270M base on CPU: checks the protocol path (chat completions, usage, concurrency, the whole graph
through the server and its traces), never answer quality. Generation budgets are kept tiny.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port, log_tail, stop_process_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STARTUP_TIMEOUT_S = 240  # model load is ~10 s on an idle machine; leave room for a busy one
QUESTION = {
    "question": "What is the first-line treatment for anaphylaxis?",
    "options": {"A": "Intramuscular epinephrine", "B": "Oral antihistamine", "C": "Inhaled salbutamol"},
}


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (OSError, ValueError):
        return None


def _wait_ready(base: str, proc: subprocess.Popen, log: Path) -> list[str]:
    """Wait for /health and a loaded model in /v1/models; return the served model ids."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log_tail(log)}")
        if _get_json(f"{base}/health"):
            models = _get_json(f"{base}/v1/models") or {}
            ids = [m["id"] for m in models.get("data", [])]
            if ids:
                return ids
        time.sleep(1)
    pytest.fail(f"transformers serve not ready at {base} within {STARTUP_TIMEOUT_S} s:\n{log_tail(log)}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """(base_url, model name) of `transformers serve` pinned to the offline model, stopped afterwards."""
    from ermedrag.tools.offline_model import offline_model_dir

    model_dir = offline_model_dir()  # converts the GGUF on first use (~90 s), then cached
    workdir = tmp_path_factory.mktemp("transformers-serve")
    log = workdir / "server.log"
    port = free_port()
    env = dict(os.environ)
    # Shared 2-core machines: one busy-waiting thread fewer keeps generation from collapsing.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMP_WAIT_POLICY", "passive")
    transformers = Path(sys.executable).parent / "transformers"
    command = [str(transformers), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--log-level", "info"]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        ids = _wait_ready(base, proc, log)
        print(f"\ntransformers serve ready on port {port} in {time.monotonic() - started:.1f} s, models {ids}")
        # The server is pinned to the folder it was given and rejects any other model name.
        assert str(model_dir) in ids, ids
        yield f"{base}/v1", str(model_dir), log
    finally:
        stop_process_group(proc)


def test_invoke_reports_text_and_usage(server):
    from ermedrag.tools.chat_models import load_chat_model

    base_url, name, log = server
    model = load_chat_model(f"openai:{name}", base_url=base_url, max_new_tokens=16)
    started = time.monotonic()
    reply = model.invoke("Name one drug used to treat fever.")
    print(f"invoke: {time.monotonic() - started:.1f} s, {reply.usage_metadata}, {reply.text!r}")
    assert reply.text.strip(), log_tail(log)
    usage = reply.usage_metadata
    assert usage and usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 16
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert reply.response_metadata["finish_reason"] in ("stop", "length")


def test_concurrent_calls_complete(server):
    """abatch sends the calls concurrently; on CPU the server may serialise them, so times are only printed."""
    from ermedrag.tools.chat_models import load_chat_model

    base_url, name, _ = server
    model = load_chat_model(f"openai:{name}", base_url=base_url, max_new_tokens=8)
    prompts = ["What is aspirin?", "What is insulin?", "What is sepsis?"]

    started = time.monotonic()
    sequential = [model.invoke(p) for p in prompts]
    sequential_s = time.monotonic() - started

    started = time.monotonic()
    concurrent = asyncio.run(model.abatch(prompts))
    concurrent_s = time.monotonic() - started
    print(f"3 calls x 8 tokens: sequential {sequential_s:.1f} s, concurrent (abatch) {concurrent_s:.1f} s")

    for reply in [*sequential, *concurrent]:
        assert reply.usage_metadata and reply.usage_metadata["output_tokens"] > 0
    assert len(concurrent) == 3 and all(r.text.strip() for r in concurrent)


def test_graph_through_openai_backend(server, tmp_path: Path):
    from ermedrag.graphs.er_medrag import graph
    from ermedrag.tools.traces import TraceStore

    base_url, name, log = server
    spec = f"openai:{name}"
    trace_db = tmp_path / "t.sqlite"
    context = {
        "extractor_model": spec,
        "respondent_model": spec,
        "base_url": base_url,
        "trace_db": str(trace_db),
        "index_dir": "",  # the starter knowledge base, whatever the environment says
        "chroma_url": "",
        "snippets_k": 2,
        "extractor_max_new_tokens": 24,
        "respondent_max_new_tokens": 24,
    }
    started = time.monotonic()
    state = graph.invoke(dict(QUESTION), context=context)
    print(f"graph via openai backend: {time.monotonic() - started:.1f} s, answer {state['answer']}")

    assert len(state["snippets"]) == 2
    assert len(state["extractions"]) == 2
    assert {e["snippet_id"] for e in state["extractions"]} == {s["id"] for s in state["snippets"]}
    answer = state["answer"]
    assert isinstance(answer, dict) and {"answer", "ok", "well_formed"} <= set(answer)

    store = TraceStore(trace_db)
    run = store.run(state["run_id"])
    assert run is not None and run["finished_at"] is not None
    events = list(store.events(run_id=state["run_id"]))
    assert sorted(e["agent"] for e in events) == ["extractor", "extractor", "respondent"], log_tail(log)
    for event in events:
        assert event["model"] == spec  # the spec it was built from, as for every backend
        assert isinstance(event["completion"], str)
        assert event["usage"] and event["usage"]["output_tokens"] > 0
        limit = context["respondent_max_new_tokens" if event["agent"] == "respondent" else "extractor_max_new_tokens"]
        assert event["usage"]["output_tokens"] <= limit
        assert event["sampling"]["model"] == spec and event["sampling"]["max_new_tokens"] == limit
        assert event["messages"] and event["messages"][-1]["content"]


def test_real_server_failures_are_model_server_errors(server):
    """The real server's own refusals, and a timeout shorter than any generation, as one typed error each."""
    from ermedrag.tools.chat_models import ModelServerError, load_chat_model

    base_url, name, log = server
    unknown = load_chat_model("openai:not-the-served-model", base_url=base_url, max_new_tokens=4, max_retries=0)
    with pytest.raises(ModelServerError) as caught:
        unknown.invoke("Name one drug used to treat fever.")
    print(f"unknown model: {caught.value}")
    assert caught.value.cause.startswith(("http_4xx:", "http_5xx:")), (caught.value.cause, log_tail(log))
    assert base_url in str(caught.value) and "\n" not in str(caught.value)

    hurried = load_chat_model(f"openai:{name}", base_url=base_url, max_new_tokens=64, timeout_s=0.05, max_retries=1,
                              retry_backoff_s=0.05)
    started = time.monotonic()
    with pytest.raises(ModelServerError) as caught:
        hurried.invoke("List ten symptoms of anaemia.")
    seconds = time.monotonic() - started
    assert (caught.value.cause, caught.value.attempts) == ("timeout", 2) and seconds < 5, (str(caught.value), seconds)
    assert "did not answer within 0.05 s" in str(caught.value)

