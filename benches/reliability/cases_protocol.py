"""Model servers that answer, each in its own way (`ermedrag.testing.misbehaving_server` flavours): what the openai:
backend reads from them must be the model's own text with the stop string that ended it, within the token limit.

- The OpenAI API and llama.cpp's server cut the stop string off, vLLM cuts it and names it (`stop_reason`),
  `transformers serve` keeps it: every graph's replies are well formed and Med-R³ searches through each.
- A server that ignores the token limit is cut on the client, promptly; one that refuses fields the OpenAI API does
  not know gets the request again without them; settings no server can honour are refused before a request is sent.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from benches.reliability.cases_servers import OPTIONS, QUESTION, invoke, server, server_context, warm_up
from benches.reliability.harness import Verdict, Workspace, judge_error, ok, register, silent_wrong

FLAVOURS = ("openai", "vllm", "keeps_stop")


def _graph_problem(graph: str, state: dict[str, Any]) -> str | None:
    answer = state.get("answer") or {}
    if answer.get("answer") != "A" or not answer.get("well_formed"):
        return f"answer {answer.get('answer')!r}, well formed {answer.get('well_formed')}: {answer.get('error')}"
    if graph == "med_r3" and len(state.get("searches") or []) != 2:
        return f"{len(state.get('searches') or [])} searches, the scripted reasoner asks for 2"
    if graph == "er_medrag" and not all(e["strict"] for e in state.get("extractions") or []):
        return "an extraction through the server is not strict JSON: its `}]` was lost"
    return None


def flavour_case(flavour: str, graph: str) -> None:
    @register(
        f"protocol_{flavour}_{graph}",
        "protocol",
        f"{graph} through a server that treats stop strings the {flavour} way: answer 'A', well formed"
        + (", 2 searches" if graph == "med_r3" else ", strict JSON extractions" if graph == "er_medrag" else ""),
        quick=True,
        timeout_s=60,
    )
    def run(workspace: Workspace) -> Verdict:
        warm_up(workspace)
        with server("ok", flavour=flavour) as (url, _):
            try:
                state = invoke(graph, server_context(url, timeout_s=10.0), uuid.uuid4().hex)
            except Exception as err:  # noqa: BLE001
                return judge_error(err, (url,), refusal_expected=False)
        problem = _graph_problem(graph, state)
        return (
            silent_wrong(problem)
            if problem
            else ok(f"{flavour}: well formed" + (", 2 searches" if graph == "med_r3" else ""))
        )


for _flavour in FLAVOURS:
    for _graph in ("cot", "er_medrag", "med_r3"):
        flavour_case(_flavour, _graph)
flavour_case("vllm", "mmedagent")


@register(
    "protocol_ignores_token_limit",
    "protocol",
    "a server streaming past any token limit, limit 16: 16 tokens back within 2 s, flagged cut_by_client, the "
    "connection closed",
    quick=True,
    timeout_s=30,
)
def ignores_limit(workspace: Workspace) -> Verdict:
    from ermedrag.tools.models import load_chat_model

    with server("ignores_limit") as (url, running):
        started = time.monotonic()
        try:
            reply = load_chat_model("openai:x", base_url=url, max_new_tokens=16, timeout_s=5).invoke("Say more.")
        except Exception as err:  # noqa: BLE001
            return judge_error(err, (url,), refusal_expected=False)
        seconds = time.monotonic() - started
        time.sleep(0.2)
        disconnects = running.disconnects
    meta = reply.response_metadata
    if reply.usage_metadata["output_tokens"] != 16 or meta["cut_by_client"] != "length" or seconds > 2:
        return silent_wrong(
            f"{reply.usage_metadata['output_tokens']} tokens, cut {meta['cut_by_client']}, {seconds:.1f} s"
        )
    return (
        ok(f"16 tokens in {seconds:.2f} s, cut by the client")
        if disconnects
        else silent_wrong("the client kept the connection open past the limit")
    )


@register(
    "protocol_strict_server_negotiated",
    "protocol",
    "a server refusing what the OpenAI API refuses (unknown fields, both token-limit fields): cot answered "
    "'A', well formed, after the request was sent again without them",
    quick=True,
    timeout_s=60,
)
def strict_server(workspace: Workspace) -> Verdict:
    with server("ok", strict=True) as (url, running):
        try:
            state = invoke("cot", server_context(url, timeout_s=10.0), uuid.uuid4().hex)
        except Exception as err:  # noqa: BLE001
            return judge_error(err, (url,), refusal_expected=False)
        requests = running.requests
    problem = _graph_problem("cot", state)
    return silent_wrong(problem) if problem else ok(f"answered after {requests} requests")


def bad_setting_case(name: str, setting: str, value: Any) -> None:
    @register(
        f"protocol_bad_{name}",
        "protocol",
        f"{setting}={value!r}: a clear error naming {setting}, and nothing sent to the server",
        quick=True,
        timeout_s=30,
    )
    def run(workspace: Workspace) -> Verdict:
        with server("ok") as (url, running):
            try:
                state = invoke("cot", server_context(url) | {setting: value}, uuid.uuid4().hex)
            except Exception as err:  # noqa: BLE001
                verdict = judge_error(err, (setting,))
                if verdict.outcome == "clear_error" and running.requests:
                    return silent_wrong(f"{running.requests} requests were sent before the error")
                return verdict
        return silent_wrong(f"answered {state.get('answer')} with {setting}={value!r}")


bad_setting_case("temperature_nan", "temperature", float("nan"))
bad_setting_case("temperature_inf", "temperature", float("inf"))
bad_setting_case("temperature_too_high", "temperature", 7.0)
bad_setting_case("budget_negative", "respondent_max_new_tokens", -5)


@register(
    "protocol_vllm_continues_its_turn",
    "protocol",
    "med_r3 through a vLLM server: the calls that continue the reasoner's turn ask it to "
    "(continue_final_message, add_generation_prompt false) and keep any stop string (include_stop_str_in_output)",
    quick=True,
    timeout_s=60,
)
def vllm_continuation(workspace: Workspace) -> Verdict:
    with server("ok", flavour="vllm") as (url, running):
        try:
            invoke("med_r3", server_context(url, timeout_s=10.0), uuid.uuid4().hex)
        except Exception as err:  # noqa: BLE001
            return judge_error(err, (url,), refusal_expected=False)
        bodies = running.bodies
    continued = [b for b in bodies if (b.get("messages") or [{}])[-1].get("role") == "assistant"]
    wrong = [
        b
        for b in continued
        if not (
            b.get("continue_final_message")
            and b.get("add_generation_prompt") is False
            and (b.get("include_stop_str_in_output") or not b.get("stop"))  # the answer scorer sends no stop
        )
    ]
    if not continued or wrong:
        return silent_wrong(f"{len(wrong)} of {len(continued)} continued calls without vLLM's fields")
    return ok(f"{len(continued)} continued calls asked vLLM to continue the turn")


@register(
    "protocol_cli_ask_med_r3",
    "protocol",
    "ermedrag ask --graph med_r3 through a server that cuts stop strings: 'Searches (2)' and well-formed=True "
    "printed, exit 0",
    quick=True,
    timeout_s=90,
)
def cli_med_r3(workspace: Workspace) -> Verdict:
    from benches.reliability.harness import cli_in_process, judge_cli

    with server("ok") as (url, _):
        result = cli_in_process(
            [
                "ask",
                QUESTION,
                *(f"-o{k}={v}" for k, v in OPTIONS.items()),
                "--graph",
                "med_r3",
                "--model",
                "openai:x",
                "--base-url",
                url,
            ]
        )

    def check(done: Any) -> Verdict:
        if "Searches (2)" not in done.stdout or "well-formed=True" not in done.stdout:
            return silent_wrong(f"printed: {done.stdout[-400:]}")
        return ok("Searches (2), well-formed=True")

    return judge_cli(result, (url,), check=check, refusal_expected=False)
