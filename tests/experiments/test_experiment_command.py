import json

import pytest

from glassformer.cli import main
from glassformer.formats import hub


def test_json_output_and_resume(tmp_path, capsys):
    if hub.cached_path("smollm2-135m-instruct") is None:
        pytest.skip("the cache experiment times SmolLM2, which is not in the model cache")
    out = tmp_path / "run"
    args = ["experiment", "cache", "--budget", "1", "--out", str(out), "--threads", "1",
            "--no-progress", "--json"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # one JSON object, nothing else on stdout
    first = json.loads(lines[0])
    assert first["experiment"] == "cache" and first["report"] == f"{out}/report.html"
    assert {"tables", "figures", "claims", "settings", "machine"} <= set(first)
    saved = json.loads((out / "results.json").read_text())
    assert main(args) == 0  # resumed: every cell already finished
    assert json.loads((out / "results.json").read_text())["cells"] == saved["cells"]


@pytest.mark.parametrize("extra, message", [
    (["--budget", "0"], "budget: must be positive"),
    (["--equal", "steps"], "--equal: applies to the ablation experiment only"),
    (["--data", "x.txt"], "--data: the cache experiment reads no training text"),
])
def test_user_mistakes_are_one_line(tmp_path, capsys, extra, message):
    assert main(["experiment", "cache", "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_foreign_folder_is_left_alone(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["experiment", "cache", "--budget", "1", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_missing_corpus_is_reported(tmp_path, capsys):
    assert main(["experiment", "length", "--data", str(tmp_path / "none.txt"),
                 "--out", str(tmp_path / "run")]) == 2
    assert "no text at" in capsys.readouterr().err
