"""A trace store that cannot be opened is one typed error naming the file, and one `error:` line in the CLI."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ermedrag.cli import main
from ermedrag.tools.records.traces import TraceStore, TraceStoreError
from tests.conftest import SCRIPTED

NOT_SQLITE = b"this is not a database\x00" * 100


def test_a_path_under_a_regular_file_names_the_path_and_the_knob(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker.txt"
    blocker.write_text("a file, not a folder")
    with pytest.raises(TraceStoreError) as caught:
        TraceStore(blocker / "traces.sqlite")
    message = str(caught.value)
    assert str(blocker / "traces.sqlite") in message and "FileExistsError" in message
    assert "ERMEDRAG_TRACE_DB" in message and "\n" not in message


def test_a_file_that_is_not_sqlite_is_named_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.sqlite"
    path.write_bytes(NOT_SQLITE)
    with pytest.raises(TraceStoreError, match="corrupt.sqlite.*not a database.*not a trace store") as caught:
        TraceStore(path)
    assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)
    assert path.read_bytes() == NOT_SQLITE  # the user's file is never overwritten
    assert TraceStore(tmp_path / "good.sqlite").runs() == []  # a good path still opens


@pytest.mark.parametrize(
    "make_bad_path",
    [
        lambda tmp: (tmp / "blocker.txt").write_text("x") and tmp / "blocker.txt" / "traces.sqlite",
        lambda tmp: (tmp / "corrupt.sqlite").write_bytes(NOT_SQLITE) and tmp / "corrupt.sqlite",
    ],
    ids=["under_a_file", "not_sqlite"],
)
def test_cli_prints_one_error_line_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make_bad_path
) -> None:
    bad = make_bad_path(tmp_path)
    monkeypatch.setenv("ERMEDRAG_TRACE_DB", str(bad))
    monkeypatch.setenv("ERMEDRAG_CHECKPOINT_DB", str(tmp_path / "checkpoints.sqlite"))
    code = main(
        ["ask", "Which drug first?", "-o", "A=Metformin", "-o", "B=Insulin", "--graph", "cot", "--model", SCRIPTED]
    )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert len(errors) == 1 and errors[0].startswith("error: cannot open the trace store") and str(bad) in errors[0]
