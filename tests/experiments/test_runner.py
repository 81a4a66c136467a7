import json

import pytest

from glassformer.errors import InputError
from glassformer.experiments.runner import Cell, Runner


def _cells(calls):
    def make(key, value):
        def run(ctx):
            calls.append(key)
            return {"value": value, "seen": sorted(ctx.results)}
        return run
    return [Cell("a", make("a", 1)), Cell("b/c", make("b/c", 2))]


def test_cells_run_once_and_resume(tmp_path):
    calls = []
    runner = Runner(tmp_path / "run", "demo", {"budget": 1})
    results = runner.run(_cells(calls), progress=False)
    assert calls == ["a", "b/c"]
    assert results["b/c"]["seen"] == ["a"]  # later cells see earlier results
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["cells"]["a"]["value"] == 1 and saved["cells"]["a"]["cell_seconds"] >= 0
    assert saved["machine"]["threads"] >= 1

    again = Runner(tmp_path / "run", "demo", {"budget": 1})
    again.run(_cells(calls), progress=False)
    assert calls == ["a", "b/c"]  # nothing ran again


def test_interrupted_run_resumes_after_the_last_finished_cell(tmp_path):
    def broken(ctx):
        raise KeyboardInterrupt

    runner = Runner(tmp_path / "run", "demo", {"budget": 1})
    calls = []
    first, second = _cells(calls)
    with pytest.raises(KeyboardInterrupt):
        runner.run([first, Cell("b/c", broken)], progress=False)
    Runner(tmp_path / "run", "demo", {"budget": 1}).run([first, second], progress=False)
    assert calls == ["a", "b/c"]


def test_refuses_other_settings_other_experiments_and_foreign_folders(tmp_path):
    Runner(tmp_path / "run", "demo", {"budget": 1}).run([], progress=False)
    with pytest.raises(ValueError, match="other settings.*budget"):
        Runner(tmp_path / "run", "demo", {"budget": 2})
    with pytest.raises(ValueError, match="holds the 'demo' experiment"):
        Runner(tmp_path / "run", "other", {"budget": 1})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        Runner(tmp_path / "mine", "demo", {"budget": 1})
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cell_folder_starts_empty(tmp_path):
    def write(ctx):
        folder = ctx.folder("x/y")
        assert not any(folder.iterdir())
        (folder / "out.txt").write_text("done")
        return {}

    runner = Runner(tmp_path / "run", "demo", {})
    stale = tmp_path / "run" / "cells" / "x_y"
    stale.mkdir(parents=True)
    (stale / "partial.txt").write_text("left by an interrupted attempt")
    (tmp_path / "run" / "results.json").write_text(json.dumps(runner.record))
    Runner(tmp_path / "run", "demo", {}).run([Cell("x/y", write)], progress=False)
    assert sorted(p.name for p in stale.iterdir()) == ["out.txt"]


@pytest.mark.parametrize("content", [b'{"experiment": "demo", ', b"\xff\xfe not text", b"[1, 2]"])
def test_a_torn_or_foreign_results_file_is_refused_by_name(tmp_path, content):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_bytes(content)
    with pytest.raises(InputError, match="results.json"):
        Runner(tmp_path / "run", "demo", {"budget": 1})
