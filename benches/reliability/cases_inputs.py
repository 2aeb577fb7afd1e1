"""Hostile inputs: each must be refused with an error naming the field (graph: a ValueError; CLI: exit != 0 with
one error line) or answered correctly. Graph cases use `cot` with the scripted model (it answers the first
option, "A"); the input check is shared by every graph (`graphs.steps.begin_run`), which one case per graph
confirms."""

from __future__ import annotations

import json
import string
from typing import Any, Mapping

from benches.reliability.harness import (
    SCRIPTED,
    CliResult,
    Verdict,
    Workspace,
    answer_problem,
    cli_in_process,
    cli_subprocess,
    judge_call,
    judge_cli,
    must_refuse,
    ok,
    one_line,
    recorded_answer_problem,
    register,
    silent_wrong,
)

QUESTION = "Which drug is first-line for type 2 diabetes?"
OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Glipizide"}
CONTEXT = {"extractor_model": SCRIPTED, "respondent_model": SCRIPTED}
CLI_MODEL = ["--graph", "cot", "--model", SCRIPTED]
CLI_OPTIONS = ["-o", "A=Metformin", "-o", "B=Insulin"]


def invoke(inputs: Mapping[str, Any], graph: str = "cot", **context: Any) -> dict[str, Any]:
    from ermedrag.graphs.registry import load_graph

    return load_graph(graph).invoke(dict(inputs), context={**CONTEXT, **context})


def answered(workspace: Workspace, expected: str | None = "A") -> Any:
    """`check` for inputs that may be answered: the answer is the scripted model's, recorded as returned."""

    def check(state: dict[str, Any]) -> Verdict:
        problem = answer_problem(state, expected) or recorded_answer_problem(state, workspace)
        return silent_wrong(problem) if problem else ok(f"answered {expected!r}")

    return check


def refused(
    name: str, category: str, inputs: dict[str, Any], names: tuple[str, ...], what: str, graph: str = "cot"
) -> None:
    @register(name, category, f"refused with a ValueError naming {' / '.join(names)} ({what})", quick=True)
    def run(workspace: Workspace) -> Verdict:
        return judge_call(lambda: invoke(inputs, graph), must_refuse(what), names)


# ------------------------------------------------------------------------------------------------ graph inputs

refused(
    "option_keys_digits",
    "inputs",
    {"question": QUESTION, "options": {"1": "Metformin", "2": "Insulin"}},
    ("options",),
    "option keys '1', '2'",
)
for _graph in ("er_medrag", "vanilla_rag", "med_r3"):
    refused(
        f"option_keys_digits_{_graph}",
        "inputs",
        {"question": QUESTION, "options": {"1": "Metformin", "2": "Insulin"}},
        ("options",),
        f"option keys '1', '2' given to {_graph}",
        graph=_graph,
    )
refused("question_empty", "inputs", {"question": "", "options": OPTIONS}, ("question",), "an empty question")
refused(
    "question_whitespace", "inputs", {"question": " \n\t ", "options": OPTIONS}, ("question",), "a whitespace question"
)
refused("question_not_a_string", "inputs", {"question": 42, "options": OPTIONS}, ("question",), "question=42")
refused("question_a_list", "inputs", {"question": [QUESTION], "options": OPTIONS}, ("question",), "question=[...]")
refused("question_missing", "inputs", {"options": OPTIONS}, ("question",), "no question")
refused(
    "options_a_list",
    "inputs",
    {"question": QUESTION, "options": ["Metformin", "Insulin"]},
    ("options",),
    "options as a list",
)
refused(
    "options_a_string", "inputs", {"question": QUESTION, "options": "A=Metformin"}, ("options",), "options as a string"
)
refused(
    "options_27",
    "inputs",
    {"question": QUESTION, "options": {**{c: f"drug {c}" for c in string.ascii_uppercase}, "AA": "drug AA"}},
    ("options",),
    "27 options",
)
refused(
    "option_value_a_dict",
    "inputs",
    {"question": QUESTION, "options": {"A": {"name": "x"}, "B": "Insulin"}},
    ("options",),
    "an option whose text is a dict",
)
refused(
    "option_key_empty",
    "inputs",
    {"question": QUESTION, "options": {"": "Metformin", "B": "Insulin"}},
    ("options",),
    "an empty option key",
)


@register(
    "option_keys_upper_and_lower",
    "inputs",
    "'A' and 'a' together: refused naming both, or canonicalised to one option 'A'",
    quick=True,
)
def option_keys_upper_and_lower(workspace: Workspace) -> Verdict:
    def check(state: dict[str, Any]) -> Verdict:
        keys = list(state.get("options") or {})
        if keys != ["A"]:
            return silent_wrong(f"accepted keys 'A' and 'a' as options {keys}")
        return answered(workspace)(state)

    return judge_call(
        lambda: invoke({"question": QUESTION, "options": {"A": "Metformin", "a": "Insulin"}}), check, ("options",)
    )


@register(
    "option_keys_lowercase", "inputs", "keys 'a', 'b': canonicalised to 'A', 'B' (answer 'A') or refused", quick=True
)
def option_keys_lowercase(workspace: Workspace) -> Verdict:
    def check(state: dict[str, Any]) -> Verdict:
        keys = list(state.get("options") or {})
        if keys != ["A", "B"]:
            return silent_wrong(f"options kept as {keys}")
        return answered(workspace)(state)

    return judge_call(
        lambda: invoke({"question": QUESTION, "options": {"a": "Metformin", "b": "Insulin"}}), check, ("options",)
    )


def answered_or_refused(name: str, inputs: dict[str, Any], names: tuple[str, ...], what: str) -> None:
    @register(name, "inputs", f"{what}: answered 'A' (recorded) or refused naming {' / '.join(names)}", quick=True)
    def run(workspace: Workspace) -> Verdict:
        return judge_call(lambda: invoke(inputs), answered(workspace), names)


answered_or_refused(
    "question_1mb",
    {"question": "Consider this. " * 70_000 + QUESTION, "options": OPTIONS},
    ("question",),
    "a 1 MB question",
)
answered_or_refused(
    "question_nul_bytes",
    {"question": "Which\x00 drug is\x00 first-line?", "options": OPTIONS},
    ("question",),
    "NUL bytes in the question",
)
answered_or_refused(
    "question_lone_surrogates",
    {"question": "Which drug \ud800 is first-line \udfff?", "options": OPTIONS},
    ("question",),
    "lone surrogates in the question",
)
answered_or_refused(
    "option_text_lone_surrogates",
    {"question": QUESTION, "options": {"A": "Met\udc80formin", "B": "Insulin"}},
    ("options", "option"),
    "a lone surrogate in an option's text",
)


# ------------------------------------------------------------------------------------------------ the CLI


def cli_refused(name: str, argv: list[str], names: tuple[str, ...], what: str, **env: str | None) -> None:
    @register(name, "inputs", f"CLI: exit != 0, one error line naming {' / '.join(names)} ({what})", quick=True)
    def run(workspace: Workspace) -> Verdict:
        return judge_cli(cli_in_process(argv, **env), names)


cli_refused(
    "cli_option_repeated",
    ["ask", QUESTION, *CLI_MODEL, "-o", "A=Metformin", "-o", "A=Insulin"],
    ("'A'",),
    "-o A= given twice",
)
cli_refused(
    "cli_option_repeated_other_case",
    ["ask", QUESTION, *CLI_MODEL, "-o", "a=Metformin", "-o", "A=Insulin"],
    ("'A'", "'a'"),
    "-o a= and -o A=",
)
cli_refused(
    "cli_option_keys_digits",
    ["ask", QUESTION, *CLI_MODEL, "-o", "1=Metformin", "-o", "2=Insulin"],
    ("option",),
    "-o 1= -o 2=",
)
cli_refused(
    "cli_option_without_text", ["ask", QUESTION, *CLI_MODEL, "-o", "Metformin"], ("KEY=TEXT",), "-o without '='"
)
cli_refused("cli_question_empty", ["ask", "", *CLI_MODEL, *CLI_OPTIONS], ("question",), "an empty question")
cli_refused(
    "cli_snippets_negative",
    ["ask", QUESTION, "--graph", "er_medrag", "--model", SCRIPTED, *CLI_OPTIONS, "--snippets", "-1"],
    ("snippets",),
    "--snippets -1",
)
cli_refused(
    "cli_timeout_zero", ["ask", QUESTION, *CLI_MODEL, *CLI_OPTIONS, "--timeout", "0"], ("--timeout",), "--timeout 0"
)
cli_refused(
    "cli_retries_negative",
    ["ask", QUESTION, *CLI_MODEL, *CLI_OPTIONS, "--retries", "-1"],
    ("--retries",),
    "--retries -1",
)
cli_refused(
    "cli_unknown_provider",
    ["ask", QUESTION, "--graph", "cot", "--model", "foo:bar", *CLI_OPTIONS],
    ("foo",),
    "--model foo:bar",
)
cli_refused(
    "cli_openai_without_base_url",
    ["ask", QUESTION, "--graph", "cot", "--model", "openai:some-model", *CLI_OPTIONS],
    ("base_url", "base-url", "OPENAI_BASE_URL"),
    "an openai: model and no server",
)
cli_refused(
    "cli_env_snippets_not_a_number",
    ["ask", QUESTION, "--graph", "er_medrag", "--model", SCRIPTED, *CLI_OPTIONS],
    ("ERMEDRAG_SNIPPETS_K",),
    "ERMEDRAG_SNIPPETS_K=abc",
    ERMEDRAG_SNIPPETS_K="abc",
)


def _cli_answer(expected: str, snippets: int | None = None) -> Any:
    def check(result: CliResult) -> Verdict:
        try:
            state = json.loads(result.stdout)
        except json.JSONDecodeError:
            return silent_wrong(f"exit 0 without the JSON state: {one_line(result.stdout, 200)}")
        problem = answer_problem(state, expected)
        if problem:
            return silent_wrong(problem)
        if snippets is not None and len(state.get("snippets") or []) != snippets:
            return silent_wrong(f"asked for {snippets} snippets, used {len(state.get('snippets') or [])}")
        return ok(f"answered {expected!r}" + (f" from {snippets} snippets" if snippets is not None else ""))

    return check


@register(
    "cli_snippets_zero", "inputs", "CLI --snippets 0: answered from no snippets, or refused naming snippets", quick=True
)
def cli_snippets_zero(workspace: Workspace) -> Verdict:
    result = cli_in_process(
        ["ask", QUESTION, "--graph", "er_medrag", "--model", SCRIPTED, *CLI_OPTIONS, "--snippets", "0", "--json"]
    )
    return judge_cli(result, ("snippets",), check=_cli_answer("A", snippets=0))


@register(
    "cli_question_1mb", "inputs", "CLI with a 1 MB question: answered 'A', or refused naming the question", quick=True
)
def cli_question_1mb(workspace: Workspace) -> Verdict:
    result = cli_in_process(["ask", "Consider this. " * 70_000 + QUESTION, *CLI_MODEL, *CLI_OPTIONS, "--json"])
    return judge_cli(result, ("question",), check=_cli_answer("A"))


@register(
    "cli_question_invalid_utf8",
    "inputs",
    "ermedrag ask (a real process) with bytes that are not UTF-8 in its question argument: answered 'A', or "
    "one error line naming the question; no traceback",
    timeout_s=180,
)
def cli_question_invalid_utf8(workspace: Workspace) -> Verdict:
    result = cli_subprocess(
        ["ask", b"Which drug \xff\xfe is first-line for type 2 diabetes?", *CLI_MODEL, *CLI_OPTIONS],
        workspace.env(),
        timeout_s=150,
    )

    def check(result: CliResult) -> Verdict:
        if "Answer: A" not in result.stdout:
            return silent_wrong(f"exit 0 without 'Answer: A': {one_line(result.stdout[-300:])}")
        return ok("answered 'A'")

    return judge_cli(result, ("question", "utf-8", "UTF-8"), check=check)
