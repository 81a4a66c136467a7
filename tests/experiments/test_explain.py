import re

import numpy as np
import pytest
import torch

from glassformer.experiments import run_experiment
from glassformer.experiments.explain import METHODS, _setup, task_loss
from glassformer.experiments.stats import spearman, top_overlap
from glassformer.formats import hub
from glassformer.interpret.trace import intervene, run_with_cache

pytestmark = pytest.mark.slow  # the real pretrained model
LAYERS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if hub.cached_path("smollm2-135m-instruct") is None:
        pytest.skip("SmolLM2-135M-Instruct is not in the model cache")
    out = tmp_path_factory.mktemp("explain") / "run"
    return out, run_experiment("explain", out, budget=10, progress=False, layers=LAYERS)


def test_report_structure(run):
    out, record = run
    page = (out / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 2
    table = record["summary"]["tables"][0]
    assert [row[0] for row in table["rows"]] == [*METHODS, "ablation"]
    assert table["rows"][-1][1:3] == [1.0, 1.0]  # ablation agrees with itself
    assert "attention weights are not explanations" in page


def test_numbers_come_from_the_runs(run):
    out, record = run
    cells, settings = record["cells"], record["settings"]
    truth = np.array([cells[f"ablation/{layer}"]["loss_rise"] for layer in range(LAYERS)]).ravel()
    rows = {row[0]: row for row in record["summary"]["tables"][0]["rows"]}
    ig = np.array(cells["integrated_gradients"]["scores"][:LAYERS]).ravel()
    assert rows["integrated gradients"][1] == spearman(ig, truth)
    assert rows["integrated gradients"][2] == top_overlap(ig, truth, 10)
    gap = cells["integrated_gradients"]
    assert gap["completeness_gap"] == pytest.approx(
        np.sum(gap["scores"]) - (gap["loss_all_mean"] - gap["loss_all_on"]), abs=1e-4)

    # recompute one head's attention score and its mean-ablation loss rise directly
    state = _setup({}, settings)
    model, ids, queries, keys = state["model"], state["ids"], state["queries"], state["keys"]
    logits, cache = run_with_cache(model, ids, ["blocks.1.attn.pattern", "blocks.1.attn.context"])
    pattern = cache["blocks.1.attn.pattern"]  # (B, H, T, T)
    assert cells["clean"]["attention"][1][3] == pytest.approx(
        pattern[:, 3, queries, keys].mean().item(), rel=1e-4)
    assert cells["clean"]["loss"] == pytest.approx(task_loss(logits, ids, queries).item(), rel=1e-5)
    mean = cache["blocks.1.attn.context"][:, 3].mean(dim=(0, 1))  # (d_head,)

    def ablate_head(context, site):
        context = context.clone()
        context[:, 3] = mean
        return context

    with torch.no_grad(), intervene(model, {"blocks.1.attn.context": ablate_head}):
        rise = task_loss(model(ids), ids, queries).item() - cells["clean"]["loss"]
    assert cells["ablation/1"]["loss_rise"][3] == pytest.approx(rise, abs=1e-4)
