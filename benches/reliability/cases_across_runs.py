"""Across runs and between options: a document re-indexed under an id the index holds (policies, Unicode and case
variants of ids), two processes resuming one run, option texts that collide or say nothing, and the command line
saying the same thing everywhere (issue 38). Real index on disk, real processes, the real CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

from benches.reliability.harness import (
    REPO,
    SCRIPTED,
    Verdict,
    Workspace,
    clear_error,
    cli_in_process,
    data_lost,
    judge_call,
    judge_cli,
    must_refuse,
    ok,
    register,
    silent_wrong,
)

QUESTION = "Which drug is first-line for type 2 diabetes?"


# ----------------------------------------------------------------------------- ids already in the index


def _build(directory: Path, records: list[dict[str, Any]], policy: str | None = None) -> dict[str, Any]:
    from ermedrag.testing.vectors import HashVectors  # no encoder: vectors from a hash of each chunk's id
    from ermedrag.tools.retrieval.corpus import Document
    from ermedrag.tools.retrieval.index import build_index

    documents = [Document(id=r["id"], text=r["text"], title="", source="bench") for r in records]
    options = {"on_duplicate_id": policy} if policy else {}
    return build_index(documents, directory, precomputed=HashVectors(), progress=False, **options)


def _texts(directory: Path) -> dict[str, list[str]]:
    """Document id → the texts of its committed chunks, as a fresh open of the index gives them."""
    from ermedrag.tools.retrieval.index import open_index

    index = open_index(directory)
    got = index.collection.get(ids=index.bm25_ids, include=["documents", "metadatas"])
    by_doc: dict[str, list[str]] = {}
    for text, meta in zip(got["documents"], got["metadatas"]):
        by_doc.setdefault(meta["doc_id"], []).append(text)
    return by_doc


def across_runs(name: str, policy: str | None, second_id: str, expect: str, check: Any) -> None:
    @register(f"ids_{name}", "across_runs", expect, quick=True, timeout_s=120)
    def run(workspace: Workspace) -> Verdict:
        directory = workspace.path(f"ids/{name}")
        _build(directory, [{"id": "doc-1", "text": "Metformin lowers hepatic glucose output in type 2 diabetes."}])
        try:
            stats = _build(
                directory, [{"id": second_id, "text": "Metformin raises insulin output in type 2 diabetes."}], policy
            )
        except Exception as err:  # noqa: BLE001 - judged below
            return check(None, _texts(directory), err)
        return check(stats, _texts(directory), None)


def _one_text(expected: str) -> Any:
    def check(stats: Any, texts: dict[str, list[str]], err: BaseException | None) -> Verdict:
        if err is not None:
            return silent_wrong(f"refused: {err}")
        joined = {doc: " ".join(t) for doc, t in texts.items()}
        if len(joined) != 1 or expected not in next(iter(joined.values())):
            return data_lost(f"the index holds {joined}, expected only the text with {expected!r}")
        return ok(f"one document, the {expected!r} text")

    return check


def _both(stats: Any, texts: dict[str, list[str]], err: BaseException | None) -> Verdict:
    if err is not None:
        return silent_wrong(f"refused: {err}")
    joined = " ".join(" ".join(t) for t in texts.values())
    if len(texts) != 2 or "lowers" not in joined or "raises" not in joined:
        return data_lost(f"expected both texts under two ids, the index holds {sorted(texts)}")
    return ok(f"both kept: {sorted(texts)}")


def _refused_unchanged(stats: Any, texts: dict[str, list[str]], err: BaseException | None) -> Verdict:
    if err is None:
        return silent_wrong("a reused id with other text was indexed under --on-duplicate-id error")
    if len(texts) != 1 or "lowers" not in " ".join(texts["doc-1"]):
        return data_lost(f"refused, but the index changed: {texts}")
    message = str(err)
    if "doc-1" not in message or "\n" in message.strip():
        return silent_wrong(f"the refusal does not name the id on one line: {message[:300]}")
    return clear_error(message[:200])


across_runs(
    "replace_same_length",
    "replace",
    "doc-1",
    "a later run, same id, other text of the same length: the new "
    "text replaces the old (not '0 new chunks (1 already indexed)')",
    _one_text("raises"),
)
across_runs("default_is_replace", None, "doc-1", "the default policy replaces an updated document", _one_text("raises"))
across_runs(
    "skip_keeps_indexed", "skip", "doc-1", "--on-duplicate-id skip: the indexed text stays", _one_text("lowers")
)
across_runs(
    "rename_keeps_both", "rename", "doc-1", "--on-duplicate-id rename: both texts, the new one as doc-1~2", _both
)
across_runs(
    "error_refuses_before_writing",
    "error",
    "doc-1",
    "--on-duplicate-id error: refused naming doc-1, the index unchanged",
    _refused_unchanged,
)
across_runs(
    "case_variant_is_another_id", "replace", "DOC-1", "an id differing in case is another document: both kept", _both
)


@register(
    "ids_nfc_nfd_are_one_id",
    "across_runs",
    "a document indexed as 'café' (NFC) then again as 'café' (NFD) with other text: one document, the new text",
    quick=True,
    timeout_s=120,
)
def nfc_nfd(workspace: Workspace) -> Verdict:
    directory = workspace.path("ids/nfc")
    _build(directory, [{"id": unicodedata.normalize("NFC", "café"), "text": "Caffeine raises alertness for hours."}])
    _build(directory, [{"id": unicodedata.normalize("NFD", "café"), "text": "Caffeine lowers sleep quality at night."}])
    texts = _texts(directory)
    if len(texts) != 1 or "lowers" not in " ".join(next(iter(texts.values()))):
        return data_lost(f"expected one document with the new text, the index holds {texts}")
    return ok("one id, the new text")


@register(
    "ids_two_corpora_numbered_alike",
    "across_runs",
    "two corpora that both number ids 0, 1, 2, the second indexed with rename: all six texts kept",
    quick=True,
    timeout_s=120,
)
def two_corpora(workspace: Workspace) -> Verdict:
    directory = workspace.path("ids/corpora")
    _build(directory, [{"id": str(i), "text": f"First corpus passage {i} about asthma inhalers."} for i in range(3)])
    _build(
        directory, [{"id": str(i), "text": f"Second corpus passage {i} about gout flares."} for i in range(3)], "rename"
    )
    texts = " ".join(" ".join(t) for t in _texts(directory).values())
    missing = [
        f"{corpus} {i}"
        for corpus in ("First", "Second")
        for i in range(3)
        if f"{corpus} corpus passage {i}" not in texts
    ]
    return data_lost(f"lost: {missing}") if missing else ok("six documents")


# --------------------------------------------------------------------------------------------- options


def _invoke(options: dict[str, str], reply_module: str = SCRIPTED) -> dict[str, Any]:
    from ermedrag.graphs.registry import load_graph

    context = {"extractor_model": reply_module, "respondent_model": reply_module}
    return load_graph("cot").invoke({"question": QUESTION, "options": options}, context=context)


def refused_option(name: str, text: str, what: str) -> None:
    @register(f"option_{name}", "across_runs", f"an option whose text is {what}: refused naming the option", quick=True)
    def run(workspace: Workspace) -> Verdict:
        return judge_call(lambda: _invoke({"A": "Metformin", "B": text}), must_refuse(what), ("options",))


refused_option("empty_text", "", "empty")
refused_option("punctuation_text", " ... ", "punctuation only")
refused_option("unicode_punctuation_text", "\u2026\u00bb", "Unicode punctuation only (… »)")
refused_option("invisible_text", "\u200b\u200b", "zero-width spaces only")


def matched(name: str, answer: str, options: dict[str, str], expected: str | None, expect: str) -> None:
    @register(f"answer_{name}", "across_runs", expect, quick=True)
    def run(workspace: Workspace) -> Verdict:
        from ermedrag.agents.respondent import parse_answer

        parsed = parse_answer(f"<think>r</think><answer>{answer}</answer>", options)
        if parsed["answer"] != expected or parsed["ok"] != (expected is not None):
            return silent_wrong(f"{answer!r} read as {parsed['answer']!r} (ok={parsed['ok']}): {parsed['error']}")
        return ok(f"{answer!r} → {expected}" + (f" ({parsed['error']})" if parsed["error"] else ""))


matched(
    "longest_prefix",
    "Antegrade and retrograde conduction",
    {"A": "Antegrade", "B": "Antegrade and retrograde"},
    "B",
    "an answer starting with two options' texts matches the longer one",
)
matched(
    "identical_options",
    "Not recalled",
    {"A": "Not recalled", "B": "Not recalled", "C": "Other"},
    None,
    "an answer equal to two identical option texts is ambiguous: no option",
)
matched("empty_answer", "", {"A": "Metformin", "B": "Insulin"}, None, "an empty answer is never an option")
matched("punctuation_answer", ".", {"A": "Metformin", "B": "Insulin"}, None, "a '.' answer is never an option")
matched("symbol_option", "↑ ↓", {"A": "↑ ↓", "B": "↓ ↑"}, "A", "symbols are text: an answer '↑ ↓' is that option")


# ----------------------------------------------------------------------------------------- one process per run


@register(
    "resume_racing",
    "across_runs",
    "a run killed mid fan-out, then resumed by two processes at once: one "
    "answers, the other is refused in one line naming the holder; every call recorded once",
    quick=False,
    timeout_s=400,
)
def resume_racing(workspace: Workspace) -> Verdict:
    import os
    import signal
    import time

    from ermedrag.tools.records.traces import TraceStore

    db, traces, calls = (workspace.path(f"race/{n}") for n in ("checkpoints.sqlite", "traces.sqlite", "calls.tsv"))
    env = {
        **os.environ,
        "ERMEDRAG_CHECKPOINT_DB": str(db),
        "ERMEDRAG_TRACE_DB": str(traces),
        "SCRIPTED_COUNTING_CALLS": str(calls),
        "SCRIPTED_COUNTING_STEP_S": "3",
        "PYTHONPATH": str(REPO),
    }
    command = [
        sys.executable,
        "-m",
        "ermedrag",
        "ask",
        QUESTION,
        "-o",
        "A=Metformin",
        "-o",
        "B=Insulin",
        "--model",
        "scripted:ermedrag.testing.scripted.counting",
        "--snippets",
        "3",
    ]
    log = workspace.path("race/killed.err")
    with log.open("w") as err:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    deadline = time.monotonic() + 300
    while not (calls.exists() and calls.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            return silent_wrong(f"the first run ended before its first call: {log.read_text()[-300:]}")
        time.sleep(0.05)
    time.sleep(0.4)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run_id = re.findall(r"Run id: ([0-9a-f]{32})", log.read_text())[0]
    racers = [
        subprocess.Popen(
            [sys.executable, "-m", "ermedrag", "ask", "--resume", run_id],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(r.wait(timeout=300), r.communicate()[1]) for r in racers]
    codes = sorted(code for code, _ in results)
    lines = calls.read_text().splitlines()
    events = len(list(TraceStore(traces).events(run_id=run_id)))
    if len(set(lines)) != len(lines) or events != 4:
        return data_lost(f"{len(lines)} calls ({len(set(lines))} distinct), {events} events recorded; expected 4 once")
    if codes != [0, 2]:
        return silent_wrong(f"exit codes {codes}: both resumes ran or both failed")
    refusal = next(err for code, err in results if code == 2).strip().splitlines()[-1]
    if not refusal.startswith(f"error: run {run_id} is held by process"):
        return silent_wrong(f"the refused resume said: {refusal[:200]}")
    return ok("one resume answered, the other was refused; 4 calls, each once")


# ------------------------------------------------------------------------------------------------ one CLI


def cli_refused(name: str, argv: list[str], names: tuple[str, ...], expect: str) -> None:
    @register(f"cli_{name}", "across_runs", expect, quick=True, timeout_s=120)
    def run(workspace: Workspace) -> Verdict:
        result = cli_in_process(
            argv,
            ERMEDRAG_TRACE_DB=str(workspace.path("cli/traces.sqlite")),
            ERMEDRAG_CHECKPOINT_DB=str(workspace.path("cli/checkpoints.sqlite")),
        )
        if "Starter knowledge base" in result.stderr:
            return silent_wrong("built or opened the starter index before refusing")
        return judge_cli(result, names)


cli_refused(
    "image_on_a_text_graph",
    ["ask", QUESTION, "--graph", "cot", "--model", SCRIPTED, "--image", "scan.png"],
    ("--image",),
    "ask --graph cot --image: refused naming the graphs that take images, before any work",
)
cli_refused(
    "traces_limit_negative",
    ["traces", "list", "--limit", "-1"],
    ("--limit",),
    "traces list --limit -1: refused (it listed everything)",
)
cli_refused(
    "temperature_nan",
    ["ask", QUESTION, "--temperature", "nan"],
    ("--temperature",),
    "ask --temperature nan: refused before anything is sent",
)
cli_refused(
    "set_unknown_field",
    ["ask", QUESTION, "--graph", "cot", "--set", "no_such_field=1"],
    ("no_such_field",),
    "ask --set of a field no graph has: refused naming it",
)
cli_refused(
    "option_without_text",
    ["ask", QUESTION, "--graph", "cot", "--model", SCRIPTED, "-o", "A=Metformin", "-o", "C="],
    ("options",),
    "ask -o C=: refused naming the option",
)


@register(
    "cli_benchmark_offline",
    "across_runs",
    "eval --bench medqa without --data, the hub unreachable "
    "(HF_HUB_OFFLINE=1): one line naming the dataset and --data, no traceback",
    quick=False,
    timeout_s=240,
)
def benchmark_offline(workspace: Workspace) -> Verdict:
    import os

    from benches.reliability.harness import cli_subprocess

    env = {k: v for k, v in os.environ.items() if k != "ERMEDRAG_SHARED_DATA"} | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(workspace.path("offline/hf")),
        "ERMEDRAG_TRACE_DB": str(workspace.path("offline/t.sqlite")),
    }
    result = cli_subprocess(
        [
            "eval",
            "--system",
            "cot",
            "--bench",
            "medqa",
            "--model",
            SCRIPTED,
            "--out",
            str(workspace.path("offline/out")),
        ],
        env,
        200,
    )
    return judge_cli(result, ("medqa", "--data"))


@register(
    "cli_train_preset_outside_the_repository",
    "across_runs",
    "train dpo --config dpo_extractor from another "
    "folder: the shipped preset is found (then a clear line about its dataset), never 'config not found'",
    quick=True,
    timeout_s=60,
)
def preset_outside(workspace: Workspace) -> Verdict:
    import os

    from ermedrag.training.config import DPOTrainingConfig, load_config

    here = os.getcwd()
    elsewhere = workspace.path("elsewhere")
    elsewhere.mkdir(exist_ok=True)
    os.chdir(elsewhere)
    try:
        config = load_config("dpo_extractor", DPOTrainingConfig)
    except Exception as err:  # noqa: BLE001
        return silent_wrong(f"the preset was not found outside the repository: {err}")
    finally:
        os.chdir(here)
    return ok(f"preset loaded: dataset {json.dumps(config.dataset)}")
