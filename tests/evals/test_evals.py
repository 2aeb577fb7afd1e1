"""Evaluation harness: loaders (shared and upstream formats), resumable runner, metrics, report."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ermedrag.tools.data import benchmarks
from ermedrag.tools.data.benchmarks import BadRow, gpqa_row, load_benchmark, mirage_rows, normalise
from ermedrag.evals.metrics import answer_entropy, summarise, wilson_interval
from ermedrag.evals.report import write_report
from ermedrag.evals.runner import RESULTS, run_eval
from ermedrag.evals.rows import done_keys
from tests.conftest import SCRIPTED

EXPECTED_SIZES = {
    "medqa": 1273,
    "medmcqa": 4183,
    "pubmedqa": 500,
    "mmlu_med": 1089,
    "mmlu_pro": 1535,
    "gpqa": 78,
    "medxpertqa": 2450,
    "bioasq": 618,
}


def test_all_eight_benchmarks_load_from_the_shared_files(shared_data):
    for name, size in EXPECTED_SIZES.items():
        bad: list[BadRow] = []
        questions = load_benchmark(name, shared_data / "benchmarks", bad_rows=bad)
        assert len(questions) == size and not bad, name
        assert all(q.answer in q.options and list(q.options) == sorted(q.options) for q in questions)
    pubmed = load_benchmark("pubmedqa", shared_data / "benchmarks", limit=1)[0]
    assert pubmed.options == {"A": "yes", "B": "no", "C": "maybe"} and pubmed.contexts


def test_limit_is_a_seeded_sample(shared_data):
    first = [q.id for q in load_benchmark("medqa", shared_data / "benchmarks", limit=5, seed=3)]
    again = [q.id for q in load_benchmark("medqa", shared_data / "benchmarks", limit=5, seed=3)]
    other = [q.id for q in load_benchmark("medqa", shared_data / "benchmarks", limit=5, seed=4)]
    assert first == again != other and len(first) == 5


def test_gpqa_is_only_unzipped_to_a_temporary_folder(shared_data, tmp_path, monkeypatch):
    temp = tmp_path / "temp"  # its own temporary folder: other processes' files in /tmp cannot count
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    made = []

    class Recorded(tempfile.TemporaryDirectory):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(Path(self.name))

    monkeypatch.setattr(tempfile, "TemporaryDirectory", Recorded)
    assert len(load_benchmark("gpqa", shared_data / "benchmarks", limit=2)) == 2
    assert made and all(folder.parent == temp for folder in made)  # unzipped there...
    assert list(temp.iterdir()) == []  # ...and nothing left behind


def test_bad_rows_are_reported_with_their_ids_and_left_out(tmp_path):
    rows = [
        {"id": "ok-1", "question": "Q?", "options": {"B": "no", "A": "yes"}, "answer": "a"},
        {"id": "no-options", "question": "Q?", "answer": "A"},
        {"id": "bad-answer", "question": "Q?", "options": {"A": "x", "B": "y"}, "answer": "E"},
    ]
    (tmp_path / "medqa_us_test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    bad: list[BadRow] = []
    questions = load_benchmark("medqa", tmp_path, bad_rows=bad)
    assert [q.id for q in questions] == ["ok-1"] and questions[0].options == {"A": "yes", "B": "no"}
    assert questions[0].answer == "A"
    assert {b.id: b.problem.split(" ")[0] for b in bad} == {
        "no-options": "no",
        "bad-answer": "answer",
        "medqa_us_test.jsonl:4": "not",
    }


def test_lines_that_are_not_json_objects_become_bad_rows_naming_the_line(tmp_path):
    ok = {"id": "ok-1", "question": "Q?", "options": {"A": "yes", "B": "no"}, "answer": "A"}
    lines = [json.dumps(ok), '["a", "list"]', '"a string"', "42", "null"]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    bad: list[BadRow] = []
    questions = benchmarks.load_questions_file(path, bad_rows=bad)
    assert [q.id for q in questions] == ["ok-1"]
    assert {b.id: b.problem for b in bad} == {
        "mine.jsonl:2": "a JSON array is not a JSON object",
        "mine.jsonl:3": "a JSON string is not a JSON object",
        "mine.jsonl:4": "a JSON number is not a JSON object",
        "mine.jsonl:5": "JSON null is not a JSON object",
    }
    assert normalise(["not", "a", "row"], "upstream") == BadRow("upstream", "?", "a JSON array is not a JSON object")


def test_upstream_formats_normalise_to_the_same_question(monkeypatch):
    hub_rows = {
        "openlifescienceai/medmcqa": [
            {
                "id": "x1",
                "question": "Q?",
                "opa": "a",
                "opb": "b",
                "opc": "c",
                "opd": "d",
                "cop": 2,
                "subject_name": "Anatomy",
            }
        ],
        "qiaojin/PubMedQA": [
            {"pubid": 7, "question": "Q?", "final_decision": "maybe", "context": {"contexts": ["abstract"]}}
        ],
        "TIGER-Lab/MMLU-Pro": [
            {"question_id": 1, "question": "Q?", "options": ["a", "b", "c"], "answer": "C", "category": "health"},
            {"question_id": 2, "question": "Q?", "options": ["a", "b"], "answer": "A", "category": "law"},
        ],
    }
    monkeypatch.setattr(benchmarks, "_hub", lambda name, config, split: iter(hub_rows[name]))
    monkeypatch.delenv("ERMEDRAG_SHARED_DATA", raising=False)  # set, it would name local files to read instead
    medmcqa = load_benchmark("medmcqa")
    assert (medmcqa[0].id, medmcqa[0].answer, medmcqa[0].options["C"]) == ("medmcqa-x1", "C", "c")
    assert load_benchmark("pubmedqa")[0].answer == "C" and load_benchmark("pubmedqa")[0].contexts == ("abstract",)
    assert [q.id for q in load_benchmark("mmlu_pro")] == ["mmlupro-1"]


def test_gpqa_upstream_shuffle_is_fixed_and_mirage_rows_read():
    row = {
        "Record ID": "rec1",
        "Question": "Q?",
        "Correct Answer": "right",
        "Incorrect Answer 1": "w1",
        "Incorrect Answer 2": "w2",
        "Incorrect Answer 3": "w3",
        "Subdomain": "Genetics",
    }
    first, again = gpqa_row(row), gpqa_row(row)
    assert first == again and first["options"][first["answer"]] == "right"
    assert isinstance(normalise(first, "gpqa"), benchmarks.Question)
    mirage = {"bioasq": {"q1": {"question": "Q?", "options": {"A": "yes", "B": "no"}, "answer": "B"}}}
    assert list(mirage_rows(mirage, "bioasq")) == [
        {"id": "bioasq-q1", "question": "Q?", "options": {"A": "yes", "B": "no"}, "answer": "B"}
    ]


def test_metrics_definitions():
    low, high = wilson_interval(8, 10)
    assert math.isclose(low, 0.4902, abs_tol=1e-3) and math.isclose(high, 0.9433, abs_tol=1e-3)
    assert answer_entropy(["A", "A", "A"]) == 0.0
    assert math.isclose(answer_entropy(["A", "B", None, None]), -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)))
    rows = [
        {
            "benchmark": "b",
            "question_id": "q",
            "answer": a,
            "correct": a == "A",
            "ok": a is not None,
            "well_formed": True,
            "token_entropy": 0.5,
            "timings": {"respond_s": 1.0},
        }
        for a in ("A", "B")
    ]
    summary = summarise(rows)
    assert summary["accuracy"] == 0.5 and summary["questions"] == 1
    assert math.isclose(summary["answer_entropy"], math.log(2)) and summary["token_entropy"] == 0.5


def test_wilson_interval_always_holds_the_rate_so_error_bars_are_never_negative(tmp_path):
    for successes, n in [(6, 6), (0, 6), (1, 1), (0, 1), (3, 7), (99, 100), (10**6, 10**6)]:
        low, high = wilson_interval(successes, n)
        assert 0.0 <= low <= successes / n <= high <= 1.0, (successes, n, low, high)
    # 6/6 correct used to give an upper bound of 0.9999999999999999 and matplotlib refused the report
    rows = [
        {
            "benchmark": "b",
            "question_id": f"q{i}",
            "answer": "A",
            "correct": True,
            "ok": True,
            "well_formed": True,
            "config": {"system": "cot", "model": "m"},
        }
        for i in range(6)
    ]
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = write_report([str(tmp_path)], tmp_path)
    assert "100.0 [61–100] (n=6)" in Path(written["report"]).read_text()
    assert all(Path(p).stat().st_size > 1000 for p in written["plots"])


def test_runner_records_resumes_and_reports(shared_data, tmp_path):
    out = tmp_path / "run"
    kwargs = dict(data_dir=str(shared_data / "benchmarks"), limit=3, trace_db=str(tmp_path / "t.sqlite"))
    first = run_eval(["cot", "er_medrag"], ["pubmedqa", "gpqa"], SCRIPTED, out, **kwargs)
    assert first == {s: {"todo": 6, "answered": 6, "failed": 0, "skipped_done": 0} for s in ("cot", "er_medrag")}
    again = run_eval(["cot", "er_medrag"], ["pubmedqa", "gpqa"], SCRIPTED, out, **kwargs)
    assert all(counts["todo"] == 0 and counts["skipped_done"] == 6 for counts in again.values())
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    assert len(rows) == 12 and {r["config"]["system"] for r in rows} == {"cot", "er_medrag"}
    assert all(r["run_id"] and r["ok"] for r in rows)
    written = write_report([str(out)], out)
    table = Path(written["report"]).read_text()
    assert "| cot | scripted:ermedrag.testing.scripted |" in table and "(n=3)" in table
    assert all(Path(p).stat().st_size > 1000 for p in written["plots"])


def test_killed_eval_resumes_without_losing_or_duplicating(shared_data, tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "ermedrag",
        "eval",
        "--system",
        "cot",
        "--bench",
        "medqa,mmlu_med",
        "--limit",
        "12",
        "--concurrency",
        "2",
        "--model",
        f"{SCRIPTED}?delay=0.4",
        "--out",
        str(out),
        "--data",
        str(shared_data / "benchmarks"),
        "--trace-db",
        str(tmp_path / "t.sqlite"),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(done_keys(out / RESULTS)) < 4:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    recorded = len(done_keys(out / RESULTS))
    assert 4 <= recorded < 24, "the kill should land mid-run"
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    keys = []
    for line in (out / RESULTS).read_text().splitlines():
        try:  # a line the kill cut short is junk; its question was answered again
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        keys.append((row["benchmark"], row["question_id"]))
    assert len(keys) == len(set(keys)) == 24


def test_report_adds_rag_quality_from_the_traces(shared_data, tmp_path):
    out = tmp_path / "run"
    trace_db = str(tmp_path / "t.sqlite")
    run_eval(
        ["vanilla_rag"], ["bioasq"], SCRIPTED, out, data_dir=str(shared_data / "benchmarks"), limit=2, trace_db=trace_db
    )
    write_report([str(out)], out, trace_db=trace_db, qrels=str(shared_data / "retrieval" / "bioasq_qrels.jsonl"))
    table = (out / "report.md").read_text()
    assert "## RAG quality" in table and "| vanilla_rag | bioasq | 2 |" in table
    quality = json.loads((out / "rag_quality.json").read_text())
    assert quality["groups"][0]["context_precision"] == 0.0  # the starter index holds no BioASQ snippets


def test_one_eval_at_a_time_writes_a_results_folder(tmp_path):
    from ermedrag.evals.runner import ResultsFolderBusy, results_folder_lock, run_eval

    out = tmp_path / "out"
    with results_folder_lock(out):
        with pytest.raises(ResultsFolderBusy, match=rf"{out} is held by process {os.getpid()}"):
            run_eval(["cot"], ["medqa"], "scripted:ermedrag.testing.scripted", out)
    with results_folder_lock(out):  # released: the next eval may start (a dead holder releases it too)
        pass
