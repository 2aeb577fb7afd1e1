"""The graph behind a real `langgraph dev` server (what Studio talks to), driven with langgraph-sdk.

Scripted model only: this checks the server wiring (graph loading, context, streaming, state, traces,
the input/output schemas Studio draws its forms from), not model quality. The server tests are slow; one
fast test checks every graph's schemas in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTED, free_port, log_tail, stop_process_group
from ermedrag.graphs.registry import GRAPHS, load_graph
from ermedrag.tools.records.traces import TraceStore

STARTUP_TIMEOUT_S = 90
RUN_TIMEOUT_S = 180
QUESTION = {
    "question": "What is the first-line treatment for anaphylaxis?",
    "options": {"A": "Intramuscular epinephrine", "B": "Oral antihistamine", "C": "Inhaled salbutamol"},
}


def _wait_ok(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"langgraph dev exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/ok", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"langgraph dev not up at {url}/ok within {STARTUP_TIMEOUT_S} s:\n{log_tail(log)}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """(url, trace db path, log path) of a `langgraph dev` server on a free port, stopped afterwards."""
    workdir = tmp_path_factory.mktemp("langgraph-server")
    trace_db = workdir / "traces.sqlite"
    log = workdir / "server.log"
    port = free_port()
    assert port != 2024  # taken on these machines; the server would silently move elsewhere
    env = {
        **os.environ,
        "ERMEDRAG_TRACE_DB": str(trace_db),
        "ERMEDRAG_MODEL": SCRIPTED,
    }
    # Role-specific variables would override ERMEDRAG_MODEL: make sure the scripted model is what runs.
    for name in ("ERMEDRAG_EXTRACTOR_MODEL", "ERMEDRAG_RESPONDENT_MODEL", "ERMEDRAG_SNIPPETS_K"):
        env.pop(name, None)
    langgraph = Path(sys.executable).parent / "langgraph"
    command = [str(langgraph), "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        _wait_ok(url, proc, log)
        print(f"\nlanggraph dev up on port {port} in {time.monotonic() - started:.1f} s")
        yield url, trace_db, log
    finally:
        stop_process_group(proc)


def _stream_run(client, thread_id: str, log: Path, **kwargs) -> list:
    parts = []
    for part in client.runs.stream(thread_id, "er_medrag", input=QUESTION, stream_mode="updates", **kwargs):
        if part.event == "error":
            pytest.fail(f"run failed: {part.data}\n{log_tail(log)}")
        parts.append(part)
    return parts


def _check_state(client, thread_id: str, trace_db: Path, k: int | None) -> dict:
    values = client.threads.get_state(thread_id)["values"]
    answer = values["answer"]
    assert answer["ok"] is True, answer
    assert answer["answer"] in QUESTION["options"], answer
    assert values["options"] == QUESTION["options"]
    snippets = values["snippets"]
    assert snippets, values
    if k is not None:
        assert len(snippets) == k
    for snippet in snippets:
        assert snippet["doc_id"] and snippet["source"], snippet
    assert len(values["extractions"]) == len(snippets)

    store = TraceStore(trace_db)
    run = store.run(values["run_id"])
    assert run is not None, f"run {values['run_id']} not in {trace_db}"
    assert run["finished_at"] is not None and run["answer"]["answer"] == answer["answer"]
    events = list(store.events(run_id=values["run_id"]))
    assert [e["agent"] for e in events].count("extractor") == len(snippets)
    assert [e["agent"] for e in events].count("respondent") == 1
    assert all(e["model"] == SCRIPTED and e["completion"] for e in events)
    return values


@pytest.mark.slow
def test_stream_run_through_server(server):
    from langgraph_sdk import get_sync_client

    url, trace_db, log = server
    client = get_sync_client(url=url, timeout=RUN_TIMEOUT_S)
    assistants = client.assistants.search(graph_id="er_medrag")
    assert assistants, "graph er_medrag not registered"

    thread = client.threads.create()
    started = time.monotonic()
    parts = _stream_run(client, thread["thread_id"], log)
    print(f"run (default context) streamed in {time.monotonic() - started:.1f} s")
    nodes = [node for part in parts if part.event == "updates" for node in part.data]
    for node in ("retrieve", "extract", "respond"):
        assert node in nodes, f"no update from {node}: {[p.event for p in parts]}"
    assert nodes.index("retrieve") < nodes.index("extract") < nodes.index("respond")
    values = _check_state(client, thread["thread_id"], trace_db, k=None)
    assert len(values["snippets"]) == 4  # Context.snippets_k default


@pytest.mark.slow
def test_run_context_sets_snippets_k(server):
    from langgraph_sdk import get_sync_client

    url, trace_db, log = server
    client = get_sync_client(url=url, timeout=RUN_TIMEOUT_S)
    thread = client.threads.create()
    started = time.monotonic()
    parts = _stream_run(client, thread["thread_id"], log, context={"snippets_k": 2})
    print(f"run (snippets_k=2) streamed in {time.monotonic() - started:.1f} s")
    extract_updates = [p for p in parts if p.event == "updates" and "extract" in p.data]
    assert len(extract_updates) == 2
    _check_state(client, thread["thread_id"], trace_db, k=2)


def _check_schemas(graph_name: str, input_schema: dict | None, output_schema: dict | None) -> None:
    """Studio's forms: the input asks for the question and options; the output shows the parsed answer."""
    assert input_schema and output_schema, f"{graph_name}: input {input_schema!r}, output {output_schema!r}"
    assert {"question", "options"} <= set(input_schema["properties"]), (graph_name, input_schema)
    assert "answer" in output_schema["properties"], (graph_name, output_schema)
    json.dumps([input_schema, output_schema])  # plain JSON, as the server sends it


@pytest.mark.parametrize("graph_name", list(GRAPHS))
def test_every_graph_has_input_and_output_json_schemas(graph_name):
    """pydantic builds them from the state types: a `typing.TypedDict` anywhere in them fails on Python < 3.12."""
    graph = load_graph(graph_name)
    _check_schemas(graph_name, graph.get_input_jsonschema(), graph.get_output_jsonschema())


@pytest.mark.slow
def test_server_serves_schemas_of_every_graph(server):
    """`GET /assistants/{assistant_id}/schemas`, what Studio asks for, for every registered graph."""
    from langgraph_sdk import get_sync_client

    url, _, log = server
    client = get_sync_client(url=url, timeout=RUN_TIMEOUT_S)
    for graph_name in GRAPHS:
        assistants = client.assistants.search(graph_id=graph_name)
        assert assistants, f"graph {graph_name} not registered"
        endpoint = f"{url}/assistants/{assistants[0]['assistant_id']}/schemas"
        try:
            with urllib.request.urlopen(endpoint, timeout=RUN_TIMEOUT_S) as response:
                schemas = json.loads(response.read())
        except urllib.error.HTTPError as err:
            pytest.fail(f"{endpoint}: HTTP {err.code} {err.read()[:2000]!r}\n{log_tail(log)}")
        _check_schemas(graph_name, schemas.get("input_schema"), schemas.get("output_schema"))
