import math
import re

import numpy as np
import pytest

from glassformer.experiments import run_experiment
from glassformer.experiments.length import LENGTHS, widened
from glassformer.formats.checkpoint import load_model
from glassformer.training.data import TokenData
from glassformer.training.perplexity import perplexity


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("length") / "run"
    return out, run_experiment("length", out, budget=4, data=corpus, progress=False)


def test_report_structure(run):
    out, record = run
    page = (out / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 1
    assert (out / "length_perplexity.png").is_file()
    table = record["summary"]["tables"][0]
    assert table["columns"] == ["model", *(f"L={n}" for n in LENGTHS)]
    names = [row[0] for row in table["rows"]]
    assert names[:7] == ["learned", "sinusoidal", "rope", "rope+linear", "rope+ntk", "rope+yarn",
                         "alibi"]
    assert "rope+yarn, fine-tuned" in names and "rope, fine-tuned" in names
    assert len(record["summary"]["claims"]) == 6


def test_numbers_come_from_the_runs(run):
    out, record = run
    cells = record["cells"]
    rows = {row[0]: row[1:] for row in record["summary"]["tables"][0]["rows"]}
    for key, cell in cells.items():
        if not key.startswith("train/"):
            assert rows[cell["variant"]] == cell["perplexity"]
    assert rows["learned"][0] is not None and rows["learned"][1:] == [None] * (len(LENGTHS) - 1)
    # one cell rescored from its saved model: RoPE with YaRN at 256 tokens
    folder = out / "cells" / "train_rope"
    model, _, meta = load_model(folder)
    val = np.asarray(TokenData.open(folder / "tokens.bin", 64, meta["train"]["val_fraction"]).val,
                     dtype=np.int64)
    wide = widened(model.eval(), 256, "yarn")
    assert wide.config.rope_scaling == "yarn" and wide.config.context_length == 256
    score = perplexity(wide, val, batch_size=4, max_tokens=record["settings"]["eval_tokens"])
    assert cells["eval/rope+yarn"]["perplexity"][LENGTHS.index(256)] == pytest.approx(
        score["perplexity"], rel=1e-5)
    assert all(math.isfinite(v) for v in cells["eval/alibi"]["perplexity"])
    assert all(cells[f"finetune/{s}"]["finetune_steps"] >= 1 for s in ("none", "linear", "ntk", "yarn"))
