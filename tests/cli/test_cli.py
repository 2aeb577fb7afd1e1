"""The `ermedrag` command line through its real entry point, in subprocesses.

Scripted model and the starter knowledge base (built once into the ermedrag cache, then reused): this checks
the command line (arguments, output, exit codes, traces), not model quality.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTED, needs_llamacpp
from ermedrag.tools.records.traces import TraceStore

TIMEOUT_S = 300  # the first ask on a fresh machine builds the starter index (72 passages)
QUESTION = "What is the first-line treatment for anaphylaxis?"
OPTIONS = ["-o", "A=Intramuscular epinephrine", "-o", "B=Oral antihistamine", "-o", "C=Inhaled salbutamol"]


def _entry_point() -> list[str]:
    """The installed `ermedrag` console script beside this interpreter, else the module."""
    script = Path(sys.executable).with_name("ermedrag")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ermedrag"]


def ermedrag(*args: str, trace_db: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ERMEDRAG_TRACE_DB": str(trace_db),
        "ERMEDRAG_CHECKPOINT_DB": str(trace_db.with_name("checkpoints.sqlite")),
    }  # never the user's cache
    for name in (
        "ERMEDRAG_INDEX_DIR",
        "ERMEDRAG_MODEL",
        "ERMEDRAG_EXTRACTOR_MODEL",
        "ERMEDRAG_RESPONDENT_MODEL",
        "OPENAI_BASE_URL",
        "ERMEDRAG_SNIPPETS_K",
        "ERMEDRAG_COARSE_K",
    ):
        env.pop(name, None)
    return subprocess.run(
        [*_entry_point(), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="module")
def trace_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli") / "traces.sqlite"


@pytest.fixture(scope="module")
def asked(trace_db: Path) -> subprocess.CompletedProcess[str]:
    """One plain-text `ermedrag ask` run with the scripted model, recorded in the module's trace db."""
    proc = ermedrag("ask", QUESTION, *OPTIONS, "--model", SCRIPTED, trace_db=trace_db)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _run_id(proc: subprocess.CompletedProcess[str]) -> str:
    match = re.search(r"^Run id: ([0-9a-f]{32}) ", proc.stdout, re.MULTILINE)
    assert match, proc.stdout
    return match.group(1)


def test_ask_prints_snippets_triplets_answer_and_timings(asked: subprocess.CompletedProcess[str]) -> None:
    out = asked.stdout
    assert f"Question: {QUESTION}" in out
    assert "  A. Intramuscular epinephrine" in out and "  C. Inhaled salbutamol" in out
    assert "Retrieved snippets (4):" in out
    snippet_lines = re.findall(
        r"^  \[(\d)\] (\S+@\d+-\d+)  score=-?\d+\.\d{3}  source=(.+?)  title='(.+)'$", out, re.MULTILINE
    )
    assert [n for n, *_ in snippet_lines] == ["1", "2", "3", "4"], out
    assert all(source.startswith("ermedrag-starter-kb") for _, _, source, _ in snippet_lines)
    assert any("naphylaxis" in title for *_, title in snippet_lines)
    assert "Extracted triplets:" in out
    triplets = re.findall(r"^  from (\S+): ok$", out, re.MULTILINE)
    assert sorted(triplets) == sorted(sid for _, sid, _, _ in snippet_lines)
    assert len(re.findall(r"^    \(.+\) —\[states\]→ \(.+\)$", out, re.MULTILINE)) == 4
    assert "Reasoning: Scripted reasoning." in out
    assert "Answer: A  (parsed=True, well-formed=True)" in out
    (timings,) = re.findall(r"^Timings: (.*)$", out, re.MULTILINE)
    parts = timings.split(", ")
    assert all(re.fullmatch(r"\w+=\d+\.\d\ds", part) for part in parts), timings
    # The stages come in the order the graph's parallel branches merged them; total is last.
    assert sorted(part.split("=")[0] for part in parts[:-1]) == ["extract_s", "respond_s", "retrieve_s"], timings
    assert parts[-1].startswith("total="), timings
    _run_id(asked)


def test_ask_json_prints_the_final_state(trace_db: Path) -> None:
    proc = ermedrag("ask", QUESTION, *OPTIONS, "--model", SCRIPTED, "--json", "--snippets", "2", trace_db=trace_db)
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = json.loads(proc.stdout)  # the whole of stdout: banners go to stderr
    assert state["question"] == QUESTION
    assert state["options"] == {"A": "Intramuscular epinephrine", "B": "Oral antihistamine", "C": "Inhaled salbutamol"}
    assert state["answer"]["answer"] == "A" and state["answer"]["ok"] is True
    assert len(state["snippets"]) == 2
    for snippet in state["snippets"]:
        assert {"id", "text", "doc_id", "source", "title", "start", "end", "score"} <= set(snippet)
        assert snippet["id"] == f"{snippet['doc_id']}@{snippet['start']}-{snippet['end']}"
    assert {e["snippet_id"] for e in state["extractions"]} == {s["id"] for s in state["snippets"]}
    assert {"retrieve_s", "extract_s", "respond_s"} <= set(state["timings"])
    assert re.fullmatch(r"[0-9a-f]{32}", state["run_id"])
    assert TraceStore(trace_db).run(state["run_id"])["answer"]["answer"] == "A"


def test_lowercase_option_keys_are_the_uppercase_options(tmp_path: Path) -> None:
    proc = ermedrag(
        "ask",
        QUESTION,
        "-o",
        "a=Intramuscular epinephrine",
        "-o",
        "b=Oral antihistamine",
        "--graph",
        "cot",
        "--model",
        SCRIPTED,
        "--json",
        trace_db=tmp_path / "traces.sqlite",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads(proc.stdout)
    assert state["options"] == {"A": "Intramuscular epinephrine", "B": "Oral antihistamine"}
    assert state["answer"]["answer"] == "A"


def test_traces_list_shows_the_run(asked: subprocess.CompletedProcess[str], trace_db: Path) -> None:
    run_id = _run_id(asked)
    proc = ermedrag("traces", "list", trace_db=trace_db)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith(run_id)]
    assert "er_medrag" in line and "events=5" in line and "retrievals=1" in line and "answer=A" in line
    assert QUESTION[:40] in line


def test_traces_show_reads_as_a_run(asked: subprocess.CompletedProcess[str], trace_db: Path) -> None:
    """Stages in the order they ran, each call with what it wrote and how it ended, then the answer."""
    run_id = _run_id(asked)
    proc = ermedrag("traces", "show", run_id, trace_db=trace_db)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert text.startswith(f"Run {run_id} (er_medrag, finished, ") and f"Question: {QUESTION}" in text
    assert "Steps (6):" in text and text.count("] extractor (") == 4 and "] respondent (" in text
    assert text.index("[retrieve] retrieve") < text.index("] extractor (") < text.index("] respondent (")
    assert "ended stop at '}]'" in text and "ended stop at '</answer>'" in text and "—[states]→" in text
    assert "\nAnswer: A  (well-formed=True" in text


def test_traces_show_json_prints_the_run_and_its_events(
    asked: subprocess.CompletedProcess[str], trace_db: Path
) -> None:
    run_id = _run_id(asked)
    proc = ermedrag("traces", "show", run_id, "--json", trace_db=trace_db)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = json.loads(proc.stdout)
    assert shown["run"]["run_id"] == run_id
    assert shown["run"]["question"]["question"] == QUESTION and shown["run"]["answer"]["answer"] == "A"
    events = shown["events"]
    assert [e["agent"] for e in events].count("extractor") == 4
    assert [e["agent"] for e in events][-1] == "respondent" and len(events) == 5
    assert all(e["run_id"] == run_id and e["model"] == SCRIPTED for e in events)
    assert all("logprobs" not in e for e in events)
    assert "<answer>A</answer>" in events[-1]["completion"]
    (retrieval,) = shown["retrievals"]
    assert (retrieval["node"], retrieval["query"], retrieval["settings"]["k"]) == ("retrieve", QUESTION, 4)
    assert len(retrieval["snippets"]) == 4 and all(
        re.fullmatch(r"\S+@\d+-\d+  -?\d+\.\d{4}", line) for line in retrieval["snippets"]
    )


def test_traces_show_of_an_unknown_run_exits_2(asked: subprocess.CompletedProcess[str], trace_db: Path) -> None:
    proc = ermedrag("traces", "show", "nonexistent", trace_db=trace_db)
    assert proc.returncode == 2
    assert "error: no run 'nonexistent'" in proc.stderr and str(trace_db) in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_traces_show_without_a_run_id_exits_2(asked: subprocess.CompletedProcess[str], trace_db: Path) -> None:
    proc = ermedrag("traces", "show", trace_db=trace_db)
    assert proc.returncode == 2 and "traces show needs a run id" in proc.stderr


def test_traces_list_of_a_missing_db_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "path.sqlite"
    proc = ermedrag("traces", "list", "--db", str(missing), trace_db=tmp_path / "unused.sqlite")
    assert proc.returncode == 2
    assert f"error: no trace database at {missing}" in proc.stderr and "Traceback" not in proc.stderr
    assert not missing.parent.exists()  # looking does not create it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ask", ""], "error: input 'question' must be a non-empty string"),
        (["ask", "   "], "error: input 'question' must be a non-empty string"),
        (["ask", QUESTION, "-o", "notakeyvalue"], "error: option 'notakeyvalue' must look like KEY=TEXT"),
        (["ask", QUESTION, "-o", "=Metformin"], "error: option '=Metformin' must look like KEY=TEXT"),
        (["ask", QUESTION, "--model", "foo:bar"], "error: unknown model provider 'foo' in 'foo:bar'"),
        (
            ["ask", QUESTION, "-o", "A=Epinephrine", "-o", "a=Salbutamol"],
            "error: option 'a' is given twice (-o A=... and -o a=...)",
        ),
        (["ask", QUESTION, "-o", "B=x", "-o", "B=y"], "error: option 'B' is given twice"),
        (
            ["ask", QUESTION, "-o", "1=Epinephrine", "-o", "2=Salbutamol"],
            "error: input 'options' key '1': option keys are single letters A-Z",
        ),
        (["ask", QUESTION, "--timeout", "0"], "error: request_timeout_s (--timeout) must be a positive number"),
        (["ask", QUESTION, "--retries", "-1"], "error: max_retries (--retries) must be an integer from 0 to 10"),
    ],
    ids=[
        "empty-question",
        "blank-question",
        "option-without-equals",
        "option-without-key",
        "unknown-provider",
        "option-twice-any-case",
        "option-twice",
        "digit-option-keys",
        "zero-timeout",
        "negative-retries",
    ],
)
def test_bad_input_exits_2_naming_the_problem(tmp_path: Path, args: list[str], message: str) -> None:
    model = [] if "--model" in args else ["--model", SCRIPTED]
    proc = ermedrag(*args, *model, trace_db=tmp_path / "traces.sqlite")
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-3000:])
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_unknown_command_is_an_argparse_error(tmp_path: Path) -> None:
    proc = ermedrag("frobnicate", trace_db=tmp_path / "traces.sqlite")
    assert proc.returncode == 2 and "invalid choice: 'frobnicate'" in proc.stderr


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("ermedrag")
    if not script.exists():
        pytest.skip("no ermedrag console script beside this interpreter (not installed into this environment)")
    assert shutil.which(str(script))


def test_dpo_export_defaults_are_the_ones_the_dpo_bench_chose() -> None:
    from ermedrag.cli import _parser

    base = ["export", "dpo", "--traces", "t.sqlite", "--out", "out"]
    assert _parser().parse_args(base).close_cut_lists is True  # the default the 3-seed DPO bench chose
    assert _parser().parse_args(base).temperature == 0.7  # likewise: plausible rejected samples
    assert _parser().parse_args([*base, "--no-close-cut-lists"]).close_cut_lists is False


# ------------------------------------------------------------------------------------------- one CLI


def test_ask_takes_the_same_context_flags_as_eval(tmp_path: Path) -> None:
    """--set, --trace-db and --temperature reach the run's context; a graph that retrieves nothing opens no index."""
    db = tmp_path / "other-traces.sqlite"
    proc = ermedrag(
        "ask",
        QUESTION,
        *OPTIONS,
        "--graph",
        "cot",
        "--model",
        SCRIPTED,
        "--set",
        "respondent_max_new_tokens=17",
        "--set",
        "answer_extraction=false",
        "--trace-db",
        str(db),
        "--temperature",
        "0.5",
        "--json",
        trace_db=tmp_path / "traces.sqlite",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starter knowledge base" not in proc.stderr  # cot retrieves nothing: no index is built or opened
    run_id = json.loads(proc.stdout)["run_id"]
    (event,) = TraceStore(db).events(run_id=run_id)
    assert event["sampling"] == {"model": SCRIPTED, "temperature": 0.5, "max_new_tokens": 17}
    assert not (tmp_path / "traces.sqlite").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ask", QUESTION, "--set", "no_such_field=1"], "no_such_field"),
        (["ask", QUESTION, "--graph", "cot", "--image", "scan.png"], "--image: the cot graph takes no images"),
        (["ask", QUESTION, "--snippets", "-1"], "argument --snippets: expected a whole number from 0"),
        (["ask", QUESTION, "--temperature", "nan"], "argument --temperature: expected a number from 0 to 2"),
        (["traces", "list", "--limit", "-1"], "argument --limit: expected a whole number from 1"),
        (["eval", "--out", "o", "--concurrency", "0"], "argument --concurrency: expected a whole number from 1"),
        (["eval", "--out", "o", "--limit", "0"], "argument --limit: expected a whole number from 1"),
        (["export", "grpo", "--out", "o", "--noise", "1.5"], "argument --noise: expected a number from 0 to 0.99"),
        (["index", "x.jsonl", "--index-dir", "i", "--chunk-size", "3"], "argument --chunk-size"),
    ],
)
def test_numbers_and_flags_are_checked_before_any_work(tmp_path: Path, args: list[str], message: str) -> None:
    proc = ermedrag(*args, trace_db=tmp_path / "traces.sqlite")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Starter knowledge base" not in proc.stderr


def test_the_trace_database_flag_is_the_same_on_every_command(tmp_path: Path) -> None:
    from ermedrag.cli import _parser

    for argv in (
        ["traces", "list"],
        ["export", "grpo", "--out", "o"],
        ["report", "r"],
        ["eval", "--out", "o"],
        ["run", "--bench", "b"],
        ["ask", "q"],
    ):
        assert _parser().parse_args([*argv, "--trace-db", "t.sqlite"]).trace_db == "t.sqlite", argv
    assert _parser().parse_args(["traces", "list", "--db", "t.sqlite"]).trace_db == "t.sqlite"  # the old spelling


@needs_llamacpp
def test_demo_answers_on_the_default_model_in_a_fresh_process(tmp_path: Path) -> None:
    """What `make demo` runs, as a newcomer's shell runs it: the default model (llama.cpp, installed here), its
    encoder and tokenizer loaded in a process that imported none of them before (they once raced there)."""
    proc = ermedrag("demo", trace_db=tmp_path / "traces.sqlite")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "loading model llamacpp:gemma3-270m" in proc.stderr
    assert re.search(r"^Answer: [A-D]  \(parsed=True, well-formed=(True|False)\)$", proc.stdout, re.MULTILINE)
    setup = r"^Setup: \d+\.\d\ds \(model llamacpp:gemma3-270m=\d+\.\d\ds, index=\d+\.\d\ds\)$"
    assert re.search(setup, proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^Timings: .*extract_s=\d+\.\d\ds.*total=\d+\.\d\ds$", proc.stdout, re.MULTILINE)
