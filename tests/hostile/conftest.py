"""Fixtures of the hostile-input suite: `refused`, which runs a command and checks that it
failed cleanly and changed nothing, and a tiny GGUF model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hostile_helpers import snapshot, write_gguf

from glassformer.cli import main


@pytest.fixture
def refused(capsys):
    """refused(argv, message, *roots): the command exits 2 within `seconds`, prints exactly one
    line on stderr (`glassformer: error: ...` containing `message`, no traceback), and every
    file under `roots` that existed before is byte-for-byte unchanged."""

    def check(argv, message, *roots, code=2, seconds=20.0, prefix="glassformer: error: "):
        before = snapshot(*roots)
        capsys.readouterr()
        start = time.perf_counter()
        status = main([str(a) for a in argv])
        elapsed = time.perf_counter() - start
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert status == code, err
        assert len(lines) == 1, err
        assert lines[0].startswith(prefix) and message in lines[0], err
        assert "Traceback" not in err
        assert elapsed < seconds, f"took {elapsed:.1f} s"
        after = snapshot(*roots)
        assert {p: after.get(p) for p in before} == before, "a file that existed was changed"
        return lines[0]

    return check


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
