"""Every graph, `ermedrag eval` and `ermedrag export` through real OpenAI-compatible servers: llama.cpp's own server
and `transformers serve`, started here from their packages with the offline model (`ermedrag.testing.real_servers`).

Each reply through a server must be of the same kind as the one from the in-process backend with the same weights
(`llamacpp:` beside llama.cpp's server, `offline:` beside `transformers serve`): well formed or not, searched or not,
strict JSON or not. Greedy decoding on both sides; budgets kept small. Gemma 3 270M base: the protocol path is under
test, never answer quality. The parity over 20 questions is a bench: benches/server_parity.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ermedrag.agents import respondent
from ermedrag.graphs.registry import load_graph
from ermedrag.testing.real_servers import SERVER_KINDS, real_server
from ermedrag.tools.model_server import ModelServerError
from ermedrag.tools.models import load_chat_model
from ermedrag.tools.records.traces import TraceStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

QUESTION = {
    "question": "Which drug is the first-line treatment for type 2 diabetes?",
    "options": {"A": "Insulin glargine", "B": "Metformin", "C": "Glipizide"},
    "gold": "B",
}
QUESTIONS = [
    QUESTION,
    {
        "question": "What is the first-line treatment for anaphylaxis?",
        "options": {"A": "Oral antihistamine", "B": "Intramuscular epinephrine", "C": "Inhaled salbutamol"},
        "gold": "B",
    },
    {
        "question": "Which hormone is replaced in primary hypothyroidism?",
        "options": {"A": "Cortisol", "B": "Insulin", "C": "Levothyroxine"},
        "gold": "C",
    },
]
# Small budgets keep the file in minutes on 2 cores; both sides get the same ones.
BUDGETS = {
    "extractor_max_new_tokens": 48,
    "respondent_max_new_tokens": 64,
    "snippets_k": 2,
    "step_max_new_tokens": 64,
    "max_total_tokens": 160,
    "max_searches": 1,
    "n_specialists": 2,
    "triage_max_new_tokens": 48,
    "specialist_max_new_tokens": 48,
    "attending_max_new_tokens": 64,
}


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server(request, tmp_path_factory):
    with real_server(request.param, tmp_path_factory.mktemp(request.param), threads=1) as running:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("ERMEDRAG_SERVER_TOKENIZER", running.tokenizer)
            yield running


def _context(graph: str, spec: str, base_url: str, trace_db: Path) -> dict:
    fields = {f for f in _fields(graph)}
    return {
        key: value
        for key, value in (
            {
                "extractor_model": spec,
                "respondent_model": spec,
                "base_url": base_url,
                "trace_db": str(trace_db),
                "index_dir": "",
                "chroma_url": "",
                "temperature": 0.0,
                "request_timeout_s": 600.0,
            }
            | BUDGETS
        ).items()
        if key in fields
    }


def _fields(graph: str) -> set[str]:
    from ermedrag.graphs.registry import context_fields

    return context_fields(graph)


def _kinds(graph: str, states: list[dict]) -> dict[str, int]:
    """How many replies of each kind: well-formed and parsed answers, runs that searched, strict-JSON extractions."""
    counts = {
        "well_formed": sum(bool(s["answer"].get("well_formed")) for s in states),
        "answered": sum(s["answer"].get("answer") is not None for s in states),
    }
    if graph == "med_r3":
        counts["searched"] = sum(bool(s.get("searches")) for s in states)
    if graph == "er_medrag":
        counts["strict"] = sum(bool(e["strict"]) for s in states for e in s["extractions"])
    return counts


def test_a_call_keeps_its_stop_string_and_its_limit(server):
    model = load_chat_model(f"openai:{server.model}", base_url=server.base_url, max_new_tokens=64)
    messages = respondent.build_messages(QUESTION["question"], QUESTION["options"], "(no evidence found)")
    reply = model.invoke(messages, stop=respondent.STOP)
    twin = load_chat_model(server.in_process, max_new_tokens=64).invoke(messages, stop=respondent.STOP)
    print(f"{server.kind}: {reply.text!r} {reply.response_metadata}")
    assert reply.response_metadata["stop_sequence"] == twin.response_metadata["stop_sequence"]
    assert reply.response_metadata["finish_reason"] == twin.response_metadata["finish_reason"]
    assert 0 < reply.usage_metadata["output_tokens"] <= 64


def test_an_assistant_turn_is_continued_through_the_server_as_in_process(server):
    """Answer extraction prefills the assistant turn up to `<answer>`: the server must continue it (through the
    completions endpoint, with the model's chat template), not close it and open a new one."""
    reasoning = "Metformin lowers hepatic glucose output and is the first-line drug for type 2 diabetes."
    messages = respondent.extraction_messages(QUESTION["question"], QUESTION["options"], reasoning)
    unparsed = respondent.parse_answer("", QUESTION["options"])
    read = {}
    for side, model in (
        ("server", load_chat_model(f"openai:{server.model}", base_url=server.base_url, max_new_tokens=8)),
        ("in_process", load_chat_model(server.in_process, max_new_tokens=8)),
    ):
        reply = model.invoke(messages, stop=respondent.STOP)
        read[side] = respondent.parse_extracted(reply.text, QUESTION["options"], unparsed)
        print(f"{server.kind} {side}: {reply.text!r} -> {read[side]['answer']}")
    assert read["in_process"]["ok"], read  # the twin reads a letter back: the server must too
    assert read["server"]["ok"] and read["server"]["answer"] == read["in_process"]["answer"], read


@pytest.mark.parametrize("graph", ["er_medrag", "vanilla_rag", "cot", "med_r3", "mmedagent"])
def test_every_graph_replies_through_the_server_as_in_process(server, graph, tmp_path):
    """The same kinds of replies on both sides, within one reply: greedy decoding of the same weights is not
    bit-identical across them (llama.cpp in process shares prompt prefixes and batches concurrent calls; a near tie
    of this small base model then flips a token), while a protocol fault is systematic (through a server that cut
    the stop strings off, no reply was well formed and Med-R³ never searched)."""
    kinds, states = {}, {}
    for side, spec, base_url in (
        ("server", f"openai:{server.model}", server.base_url),
        ("in_process", server.in_process, ""),
    ):
        started = time.monotonic()
        trace_db = tmp_path / f"{side}.sqlite"
        context = _context(graph, spec, base_url, trace_db)
        states[side] = [load_graph(graph).invoke(dict(q), context=context) for q in QUESTIONS]
        kinds[side] = _kinds(graph, states[side])
        events = list(TraceStore(trace_db).events())
        assert events and all(e["finish_reason"] in ("stop", "length") for e in events)
        assert all(e["completion"].endswith(e["stop_sequence"]) for e in events if e["stop_sequence"])
        print(
            f"{server.kind} {graph} {side}: {time.monotonic() - started:.1f} s {kinds[side]} "
            f"{[s['answer'].get('answer') for s in states[side]]}"
        )
    for kind, count in kinds["in_process"].items():
        assert abs(kinds["server"][kind] - count) <= 1, (kind, kinds)


def test_eval_and_exports_through_the_server(server, tmp_path):
    from ermedrag.evals.report import load_rows
    from ermedrag.evals.runner import run_eval
    from ermedrag.training.export import DPOExportConfig, GRPOExportConfig, export_dpo, export_grpo

    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"id": "q1", "question": QUESTION["question"], "options": QUESTION["options"], "answer": "B"}) + "\n"
    )
    trace_db = str(tmp_path / "traces.sqlite")
    settings = {key: value for key, value in BUDGETS.items() if key in _fields("er_medrag")}
    summary = run_eval(
        ["er_medrag"],
        [str(questions)],
        f"openai:{server.model}",
        tmp_path / "out",
        base_url=server.base_url,
        concurrency=1,
        progress=False,
        trace_db=trace_db,
        request_timeout_s=600.0,
        **settings,
    )
    assert summary["er_medrag"]["answered"] == 1 and summary["er_medrag"]["failed"] == 0, summary
    (row,) = load_rows([tmp_path / "out"])
    assert row["well_formed"] is not None

    extractor_events = list(TraceStore(trace_db).events(agent="extractor"))
    assert extractor_events and all(e["stop_sequence"] in (None, "}]") for e in extractor_events)
    counts = export_dpo(
        DPOExportConfig(
            traces=trace_db,
            out=str(tmp_path / "dpo"),
            base_url=server.base_url,
            samples=2,
            usefulness=False,
            max_new_tokens=48,
        ),
        progress=False,
    )
    pairs = [json.loads(line) for line in (tmp_path / "dpo" / "data.jsonl").read_text().splitlines()]
    print(f"{server.kind} dpo: {counts}")
    for pair in pairs:  # a chosen text that ended at its `}]` keeps it: never cut before the list's end
        chosen = pair["chosen"][0]["content"]
        assert not chosen.rstrip().endswith("}") or chosen.rstrip().endswith("}]"), chosen
    grpo = export_grpo(GRPOExportConfig(traces=trace_db, out=str(tmp_path / "grpo")), progress=False)
    assert grpo["rows"] >= 1, grpo


def test_the_servers_own_refusals_and_a_short_deadline_are_server_errors(server):
    unknown = load_chat_model("openai:not-the-served-model", base_url=server.base_url, max_new_tokens=4, max_retries=0)
    try:
        unknown.invoke("Name one drug used to treat fever.")
    except ModelServerError as err:  # transformers serve refuses a model it does not serve
        assert err.cause.startswith(("http_4xx:", "http_5xx:")) and "\n" not in str(err)
    # (llama.cpp's server answers with its one model whatever the request names)
    hurried = load_chat_model(
        f"openai:{server.model}",
        base_url=server.base_url,
        max_new_tokens=256,
        timeout_s=0.05,
        max_retries=1,
        retry_backoff_s=0.05,
    )
    started = time.monotonic()
    with pytest.raises(ModelServerError) as caught:
        hurried.invoke("List ten symptoms of anaemia.")
    assert (caught.value.cause, caught.value.attempts) == ("timeout", 2) and time.monotonic() - started < 5
