"""CI's subset of the reliability bench (benches/reliability): the quick cases (hostile documents, inputs, model
servers, parsers, Med-R³'s loop, broken stores, durable resumes, corrupt corpus files) run against the real
public surfaces, and none may be silent_wrong, crash, hang or data_lost. The full bench (index kills, a 5 MB
document, a killed ask, concurrent evals) is `python -m benches.reliability.reliability`.

Also the bench's own judges, on made-up outcomes: a bench that misclassifies would pass anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from benches.reliability.harness import FAILURES, CliResult, judge_call, judge_cli, judge_error, must_refuse, ok

QUICK_TIMEOUT_S = 600  # ~1 min on an idle 2-core machine; far more only when something hangs


def test_quick_reliability_cases_have_no_failures(tmp_path: Path) -> None:
    out = tmp_path / "reliability.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benches.reliability.reliability", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    failing = [
        f"{r['category']}/{r['case']}: {r['outcome']}: {r['detail']}"
        for r in summary["rows"]
        if r["outcome"] in FAILURES
    ]
    assert not failing, "\n".join(failing)
    assert summary["cases"] >= 100 and summary["ok"] + summary["clear_error"] == summary["cases"]
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_a_refusal_must_name_the_field_and_not_be_a_programming_error() -> None:
    assert judge_error(ValueError("input 'options' key '1'"), ("options",)).outcome == "clear_error"
    assert judge_error(ValueError("bad input"), ("options",)).outcome == "crash"
    assert judge_error(KeyError("options"), ("options",)).outcome == "crash"
    assert judge_error(ValueError("input 'options' ..."), ("options",), refusal_expected=False).outcome == "crash"
    assert judge_call(lambda: {"answer": "A"}, must_refuse("keys 1, 2"), ("options",)).outcome == "silent_wrong"
    assert judge_call(lambda: 1, lambda result: ok()).outcome == "ok"


def test_a_cli_refusal_is_one_error_line_without_a_traceback() -> None:
    def result(rc: int | None, stderr: str, stdout: str = "") -> CliResult:
        return CliResult(rc, stdout, stderr, 0.1)

    assert judge_cli(result(2, "Run id: x\nerror: option 'A' is given twice\n"), ("'A'",)).outcome == "clear_error"
    assert (
        judge_cli(
            result(2, "usage: ermedrag ask ...\nermedrag ask: error: argument --snippets\n"), ("--snippets",)
        ).outcome
        == "clear_error"
    )
    assert judge_cli(result(1, "Traceback (most recent call last):\n  ...\nValueError: x\n"), ()).outcome == "crash"
    assert judge_cli(result(2, "error: one\nerror: two\n"), ()).outcome == "crash"
    assert judge_cli(result(2, "error: something else\n"), ("--timeout",)).outcome == "crash"
    assert judge_cli(result(0, "", "Answer: A"), ("x",)).outcome == "silent_wrong"
    assert judge_cli(result(None, ""), ()).outcome == "hang"
