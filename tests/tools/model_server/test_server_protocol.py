"""The openai: backend's protocol: stop strings whatever the server does with them, the token limit held on the client,
one deadline per attempt, replies of the wrong shape as one clear error, the request in the form each server takes.

Servers here are `ermedrag.testing.misbehaving_server` flavours (the OpenAI API's and llama.cpp's way of cutting the
stop string, vLLM's `stop_reason`, `transformers serve` keeping it): what real servers do on demand only in part.
The same graphs against real server implementations: tests/tools/model_server/test_real_servers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ermedrag.agents import reasoner, respondent
from ermedrag.testing.misbehaving_server import FLAVOURS, MisbehavingServer, scripted_content
from ermedrag.tools.agent_calls import text_with_stop
from ermedrag.tools.model_server import ModelServerError
from ermedrag.tools.models import load_chat_model
from ermedrag.tools.model_server import server_traits
from ermedrag.tools.model_server.replies import EventDecoder, ReplyAssembler, ReplyShapeError, StopScanner
from ermedrag.tools.records.traces import TraceStore
from tests.conftest import REPO

QUESTION = {
    "question": "What is the first-line treatment for anaphylaxis?",
    "options": {"A": "Intramuscular epinephrine", "B": "Oral antihistamine"},
}
FAST = dict(timeout_s=2.0, connect_timeout_s=1.0, retry_backoff_s=0.05)
# vLLM's ChatCompletionRequest fields (vllm/entrypoints/openai/chat_completion/protocol.py, vLLM 0.34.0, commit
# 62d4bc3c7): every field the backend sends to a vLLM server must be one of these, with the documented type.
VLLM_FIELDS = {
    "model": str,
    "messages": list,
    "stream": bool,
    "stream_options": dict,
    "temperature": float,
    "top_p": float,
    "max_tokens": int,
    "max_completion_tokens": int,
    "seed": int,
    "logprobs": bool,
    "top_logprobs": int,
    "stop": list,
    "stop_token_ids": list,
    "include_stop_str_in_output": bool,
    "add_generation_prompt": bool,
    "continue_final_message": bool,
    "echo": bool,
    "skip_special_tokens": bool,
    "chat_template_kwargs": dict,
    "n": int,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}


def _model(server: MisbehavingServer, tokens: int = 64, **kwargs):
    return load_chat_model(
        "openai:x", base_url=server.base_url, max_new_tokens=tokens, max_retries=0, **(FAST | kwargs)
    )


def _respondent_messages():
    return respondent.build_messages(QUESTION["question"], QUESTION["options"], "(no evidence found)")


# ------------------------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("how", ["invoke", "stream"])
def test_the_closing_tag_comes_back_whatever_the_server_does_with_it(flavour, how):
    with MisbehavingServer("ok", flavour=flavour) as server:
        model = _model(server)
        for _ in range(2):  # the second call is sent as the first reply taught (vLLM: `stop` + keep it)
            if how == "invoke":
                reply = model.invoke(_respondent_messages(), stop=respondent.STOP)
            else:
                first, *rest = model.stream(_respondent_messages(), stop=respondent.STOP)
                reply = sum(rest, start=first)
            assert reply.text == "<think>Scripted reasoning.</think><answer>A", reply.text
            assert reply.response_metadata["stop_sequence"] == "</answer>"
            assert reply.response_metadata["finish_reason"] == "stop"
            parsed = respondent.parse_answer(text_with_stop(reply, respondent.STOP), QUESTION["options"])
            assert parsed["well_formed"] and parsed["answer"] == "A"
        second = server.bodies[-1]
    if flavour == "vllm":
        assert second["stop"] == ["</answer>"] and second["include_stop_str_in_output"] is True
    else:
        assert "stop" not in second and "include_stop_str_in_output" not in second


def test_a_reply_that_ends_without_its_stop_string_is_not_closed_for_it():
    """An end of sequence is not a stop string: nothing is put back, the parser sees an unclosed answer."""
    with MisbehavingServer("ok") as server:
        reply = _model(server).invoke(_respondent_messages(), stop=["</never>"])
    assert reply.response_metadata["stop_sequence"] is None
    assert reply.text.endswith("as models do.") and text_with_stop(reply, ["</never>"]) == reply.text


def test_vllm_names_the_stop_string_it_cut_without_keeping_it():
    """An older vLLM (or one that ignores include_stop_str_in_output) cuts it and says which in `stop_reason`."""
    assembler = ReplyAssembler(["</search>", "</answer>"], 64)
    assembler.add_chunk(
        json.dumps(
            {
                "choices": [
                    {"index": 0, "delta": {"content": "<search>aspirin"}, "finish_reason": None, "stop_reason": None}
                ]
            }
        )
    )
    assembler.add_chunk(
        json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "</search>"}]})
    )
    reply, _ = assembler.finish(stream_closed_cleanly=True)
    assert (reply.text, reply.stop_sequence, reply.server_stop_reason) == ("<search>aspirin", "</search>", "</search>")


def test_vllm_gets_its_fields_in_the_documented_form():
    with MisbehavingServer("ok", flavour="vllm") as server:
        model = _model(server)
        model.invoke(_respondent_messages(), stop=respondent.STOP)  # learns the server is vLLM
        transcript = "<think>I should check. <search>epinephrine</search><document>[1] x</document>"
        reply = model.invoke(
            reasoner.build_messages(QUESTION["question"], QUESTION["options"], transcript), stop=reasoner.STOP
        )
        body = server.bodies[-1]
    assert reply.response_metadata["stop_sequence"] in reasoner.STOP
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["messages"][-1] == {"role": "assistant", "content": transcript}
    for name, value in body.items():
        assert name in VLLM_FIELDS, f"{name} is not a vLLM request field"
        assert isinstance(value, VLLM_FIELDS[name]) or (VLLM_FIELDS[name] is float and isinstance(value, int)), name
    assert body["stop"] == reasoner.STOP and body["max_tokens"] == body["max_completion_tokens"] == 64
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_a_server_that_is_not_vllm_never_gets_vllm_fields():
    with MisbehavingServer("ok", flavour="keeps_stop") as server:
        model = _model(server)
        transcript = "<think>I should check. <search>epinephrine</search><document>[1] x</document>"
        for _ in range(2):
            model.invoke(
                reasoner.build_messages(QUESTION["question"], QUESTION["options"], transcript), stop=reasoner.STOP
            )
        bodies = server.bodies
    for body in bodies:
        assert not {"stop", "include_stop_str_in_output", "continue_final_message", "add_generation_prompt"} & set(body)


def test_the_openai_api_refusing_fields_is_asked_again_at_once_and_remembered():
    """It refuses llama.cpp's and vLLM's sampling fields (all go at its first refusal), then both token-limit
    fields together (`max_tokens` goes); the next call is sent in the form it took."""
    with MisbehavingServer("ok", strict=True) as server:
        model = _model(server)
        first = model.invoke(_respondent_messages(), stop=respondent.STOP)
        model.invoke(_respondent_messages(), stop=respondent.STOP)
        bodies = server.bodies
    assert first.response_metadata["stop_sequence"] == "</answer>"
    assert len(bodies) == 4  # refused twice, answered, then the next call at once
    assert {"top_k", "min_p", "repeat_penalty", "repetition_penalty"} <= set(bodies[0])
    assert not {"top_k", "min_p", "repeat_penalty", "repetition_penalty"} & set(bodies[1])
    assert "max_tokens" in bodies[1] and "max_tokens" not in bodies[2] and bodies[2] == bodies[3]
    assert bodies[2]["max_completion_tokens"] == 64
    assert server_traits(server.base_url).refused == {
        "max_tokens",
        "top_k",
        "min_p",
        "repeat_penalty",
        "repetition_penalty",
    }


# ------------------------------------------------------------------------------------------ the token limit


def test_a_server_that_ignores_the_token_limit_is_cut_on_the_client_and_hung_up_on():
    with MisbehavingServer("ignores_limit") as server:
        started = time.monotonic()
        reply = _model(server, tokens=16).invoke("Say more.")
        seconds = time.monotonic() - started
        time.sleep(0.2)
        disconnects = server.disconnects
    assert reply.text == " more" * 16 and reply.usage_metadata["output_tokens"] == 16
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.response_metadata["cut_by_client"] == "length"
    assert seconds < 2 and disconnects == 1  # never waited for: the connection is closed at the limit


def test_a_token_limit_of_zero_sends_nothing():
    with MisbehavingServer("ok") as server:
        reply = _model(server, tokens=0).invoke("Say nothing.")
        assert server.requests == 0
    assert reply.text == "" and reply.response_metadata["finish_reason"] == "length"


# ------------------------------------------------------------------------------------- the parsers, hostile


def test_stop_scanner_finds_a_stop_string_split_across_pieces_and_releases_nothing_past_it():
    scanner = StopScanner(["</answer>", "</search>"])
    released = [scanner.feed(piece) for piece in ["<answer>B</an", "sw", "er> and then </search>"]]
    assert "".join(released) == "<answer>B" and scanner.matched == "</answer>"
    assert StopScanner([]).feed("anything") == "anything"


def test_stop_scanner_is_linear_in_the_text():
    scanner = StopScanner(["</answer>"])
    started = time.perf_counter()
    total = sum(len(scanner.feed("<" * 50)) for _ in range(40_000))  # 2 MB of near-misses
    assert total + len(scanner.flush()) == 2_000_000 and scanner.matched is None
    assert time.perf_counter() - started < 5


def test_event_decoder_reads_events_in_any_split_and_bounds_a_line():
    stream = b'data: {"a": 1}\r\n\r\n: comment\nevent: x\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'
    for size in (1, 2, 7, len(stream)):
        decoder = EventDecoder()
        payloads = [p for i in range(0, len(stream), size) for p in decoder.feed(stream[i : i + size])]
        assert payloads + decoder.close() == ['{"a": 1}', '{"b":\n2}', "[DONE]"]
    with pytest.raises(ReplyShapeError, match="longer than 4 MB"):
        EventDecoder().feed(b"data: " + b"x" * (4 * 1024 * 1024 + 1))


@pytest.mark.parametrize(
    ("chunk", "words"),
    [
        ('{"choices": "x"}', "choices is a str"),
        ('{"choices": [7]}', "choices[0] is a int"),
        ('{"choices": [{"delta": []}]}', "delta is a list"),
        ('{"choices": [{"delta": {"content": 3}}]}', "delta.content is a int"),
        ('{"choices": [{"delta": {}, "finish_reason": 1}]}', "finish_reason is a int"),
        ("[1, 2]", "a JSON list, not an object"),
    ],
)
def test_a_chunk_of_the_wrong_shape_is_named(chunk, words):
    with pytest.raises(ReplyShapeError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ReplyAssembler([], 8).add_chunk(chunk)


# ---------------------------------------------------------------------------------- failures: one clear line


@pytest.mark.parametrize(
    ("mode", "cause", "words"),
    [
        ("empty_choices", "wrong_shape", "choices is empty"),
        ("no_message", "wrong_shape", "no message"),
        ("null_content", "wrong_shape", "content is null"),
        ("wrong_types", "wrong_shape", "content is a int"),
        ("stream_error", "stream_error", "engine crashed"),
    ],
)
def test_a_reply_of_the_wrong_shape_is_one_server_error_naming_the_url(mode, cause, words):
    with MisbehavingServer(mode) as server:
        with pytest.raises(ModelServerError) as caught:
            _model(server).invoke("Which drug first?")
    message = str(caught.value)
    assert caught.value.cause == cause and words in message and "\n" not in message
    assert message.startswith(f"model server {server.base_url} ") and "openai:x" in message


def test_the_timeout_is_a_deadline_for_the_whole_attempt_even_for_a_trickling_server():
    with MisbehavingServer("trickle", delay_s=0.2) as server:
        started = time.monotonic()
        with pytest.raises(ModelServerError) as caught:
            _model(server, timeout_s=1.0).invoke("Which drug first?")
        seconds = time.monotonic() - started
    assert caught.value.cause == "timeout" and 0.9 < seconds < 2.5, seconds


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"temperature": float("nan")}, "temperature must be a finite number from 0 to 2"),
        ({"temperature": 2.5}, "temperature must be a finite number from 0 to 2"),
        ({"top_p": 0.0}, "top_p must be a finite number above 0"),
        ({"top_p": float("inf")}, "top_p must be a finite number above 0"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer from 0"),
    ],
)
def test_sampling_settings_are_checked_before_anything_is_sent(settings, words):
    with MisbehavingServer("ok") as server:
        with pytest.raises(ValueError, match=words):
            load_chat_model("openai:x", base_url=server.base_url, **({"max_new_tokens": 8} | settings))
        assert server.requests == 0


def _ermedrag(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ERMEDRAG_TRACE_DB": str(tmp_path / "traces.sqlite"),
        "ERMEDRAG_CHECKPOINT_DB": str(tmp_path / "checkpoints.sqlite"),
    }
    for name in ("OPENAI_BASE_URL", "ERMEDRAG_MODEL", "ERMEDRAG_INDEX_DIR"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "ermedrag", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )


def test_cli_ask_against_empty_choices_is_one_line_and_exit_3(tmp_path):
    with MisbehavingServer("empty_choices") as server:
        proc = _ermedrag(
            "ask",
            QUESTION["question"],
            "-o",
            "A=Epinephrine",
            "-o",
            "B=Antihistamine",
            "--graph",
            "cot",
            "--model",
            "openai:x",
            "--base-url",
            server.base_url,
            "--retries",
            "0",
            tmp_path=tmp_path,
        )
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: model server {server.base_url} answered with something that is not a chat completion")
    )


def test_cli_refuses_a_nan_temperature_before_calling_the_server(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "q1", **QUESTION, "answer": "A"}) + "\n")
    with MisbehavingServer("ok") as server:
        proc = _ermedrag(
            "eval",
            "--system",
            "cot",
            "--bench",
            str(questions),
            "--out",
            str(tmp_path / "out"),
            "--model",
            "openai:x",
            "--base-url",
            server.base_url,
            "--set",
            "temperature=nan",
            tmp_path=tmp_path,
        )
        assert server.requests == 0
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "temperature" in proc.stderr.strip().splitlines()[-1] and "finite" in proc.stderr


# ------------------------------------------------------------------------------- the graphs, through a server


def _context(tmp_path: Path, base_url: str) -> dict:
    return {
        "extractor_model": "openai:x",
        "respondent_model": "openai:x",
        "base_url": base_url,
        "trace_db": str(tmp_path / "traces.sqlite"),
        "max_retries": 0,
        "index_dir": "",
        "chroma_url": "",
        "snippets_k": 2,
    }


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_reply_is_well_formed_and_med_r3_searches_through_a_server(tmp_path, flavour):
    from ermedrag.graphs.registry import load_graph

    with MisbehavingServer("ok", flavour=flavour) as server:
        er = load_graph("er_medrag").invoke(dict(QUESTION), context=_context(tmp_path, server.base_url))
        r3 = load_graph("med_r3").invoke(dict(QUESTION), context=_context(tmp_path, server.base_url))
    assert er["answer"]["well_formed"] and er["answer"]["answer"] == "A"
    assert all(e["strict"] for e in er["extractions"]), er["extractions"]
    assert r3["answer"]["well_formed"] and len(r3["searches"]) == 2, r3["transcript"]
    events = list(TraceStore(tmp_path / "traces.sqlite").events())
    # The answer scorer (vLLM only: it returns top logprobs) asks for one token: no stop string can end it.
    written = [e for e in events if e["agent"] != "answer_scorer"]
    assert {e["stop_sequence"] for e in written} == {"}]", "</answer>", "</search>"}
    assert all(e["completion"].endswith(e["stop_sequence"]) for e in written)


def test_scripted_content_sees_the_text_of_content_blocks():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Question: q\nA. x\nB. y"}]}]}
    assert scripted_content(body).endswith("<answer>A</answer>")
