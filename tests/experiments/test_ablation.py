import base64
import json
import re

import pytest

from glassformer.experiments import run_experiment
from glassformer.experiments.ablation import kv_bytes_per_token, model_config
from glassformer.experiments.stats import mean_spread
from glassformer.training.metrics import read_metrics

VARIANTS = ("base", "post-norm", "reference kernel")


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation") / "run"
    return out, run_experiment("ablation", out, budget=4, data=corpus, progress=False,
                               variants=VARIANTS, equal="steps")


def test_report_structure(run):
    out, record = run
    page = (out / "report.html").read_text(encoding="utf-8")
    images = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(images) == len(record["summary"]["figures"]) == 1
    assert base64.b64decode(images[0])[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "ablation_curves.png").read_bytes() == base64.b64decode(images[0])
    table = record["summary"]["tables"][0]
    assert [row[0] for row in table["rows"]] == list(VARIANTS)
    for variant in VARIANTS:
        assert f"<td>{variant}</td>" in page
    claims = {c["claim"] for c in record["summary"]["claims"]}
    assert "pre-norm trains better than post-norm" in claims
    assert json.loads((out / "results.json").read_text()) == record


def test_numbers_come_from_the_runs(run):
    out, record = run
    cells, table = record["cells"], record["summary"]["tables"][0]
    assert len(cells) == len(VARIANTS) * 2
    for key, cell in cells.items():
        logged = read_metrics(out / "cells" / key.replace("/", "_") / "metrics.jsonl")
        assert cell["val_loss"] == [r["val_loss"] for r in logged if "val_loss" in r][-1]
        assert cell["iters"] == logged[-1]["iter"]
    for row in table["rows"]:
        losses = [cells[f"{row[0]}/seed{s}"]["val_loss"] for s in (0, 1)]
        assert (row[2], row[3]) == mean_spread(losses)
    assert cells["base/seed0"]["val_loss"] != cells["base/seed1"]["val_loss"]  # seeds differ
    for seed in (0, 1):  # equal steps; the kernel lands on the base run's loss
        base = cells[f"base/seed{seed}"]
        assert cells[f"post-norm/seed{seed}"]["iters"] == base["iters"]
        kernel = cells[f"reference kernel/seed{seed}"]
        assert kernel["iters"] == base["iters"]
        assert kernel["val_loss"] == pytest.approx(base["val_loss"], abs=1e-3)
    # float32 K and V, 4 layers of 128 numbers each per token; MQA keeps one head of 32
    assert cells["base/seed0"]["kv_bytes_per_token"] == 2 * 4 * 128 * 4
    assert kv_bytes_per_token(model_config("mqa")) == 2 * 4 * 32 * 4


def test_rerun_resumes_without_training_and_refuses_another_budget(run, corpus):
    out, record = run
    stamp = (out / "cells" / "base_seed0" / "metrics.jsonl").stat().st_mtime_ns
    again = run_experiment("ablation", out, budget=4, data=corpus, progress=False,
                           variants=VARIANTS, equal="steps")
    assert again["cells"] == record["cells"]
    assert (out / "cells" / "base_seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="other settings"):
        run_experiment("ablation", out, budget=8, data=corpus, progress=False, variants=VARIANTS,
                       equal="steps")
