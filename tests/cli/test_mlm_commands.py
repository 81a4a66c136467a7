"""The command line around masked-LM: train --objective mlm, then fill-mask on the run."""

from __future__ import annotations

import json

from glassformer import load
from glassformer.cli import main


def test_train_mlm_then_fill_mask(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("to be or not to be, that is the question. " * 40, encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--preset", "tiny-bert", "--objective", "mlm",
                 "--max-iters", "4", "--eval-interval", "4", "--eval-iters", "1", "--batch-size", "2",
                 "--no-progress", "--out", str(run), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["iters"] == 4
    assert main(["fill-mask", "--model", str(run), "to be or [MASK]ot", "--top-k", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["masks"] == [f.to_dict() for f in load(run).fill_mask("to be or [MASK]ot", 2)]
    assert printed["masks"][0]["position"] == 9
    assert main(["train", "--data", str(data), "--preset", "tiny-gpt2", "--objective", "mlm",
                 "--out", str(tmp_path / "refused")]) == 2
    assert "mlm trains a bidirectional" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    assert main(["train", "--data", str(data), "--objective", "span2", "--out", str(run)]) == 2
    assert "--objective" in capsys.readouterr().err
