"""compare --reference hf on an encoder: a BertForMaskedLM folder agrees at every place (the
masked-LM transform included); a corrupted layer is named first."""

from __future__ import annotations

import json

import pytest
import torch
from bert_folder import save_bert

from glassformer.cli import main
from glassformer.formats.huggingface import load_hf
from glassformer.interpret.compare import compare, hf_reference, sites

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert-compare")
    save_bert(folder, seed=5)
    return folder


def test_equal_models_agree_everywhere(folder, capsys):
    model, tokenizer = load_hf(folder)
    reference = hf_reference(str(folder), model, tokenizer)
    assert type(reference).__name__ == "BertForMaskedLM"
    result = compare(model, reference, torch.tensor([[2, 31, 44, 4, 60, 3]]))
    assert [s.site for s in result.sites] == sites(2, final_norm=False, head_transform=True)
    assert result.first_failure is None and max(s.max_abs_diff for s in result.sites) < 1e-5
    assert main(["compare", "--model", str(folder), "to be or [MASK] to be", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_a_corrupted_layer_is_named_first(folder):
    model, tokenizer = load_hf(folder)
    reference = hf_reference(str(folder), model, tokenizer)
    with torch.no_grad():
        model.blocks[1].attn.out.weight.mul_(1.01)
    result = compare(model, reference, torch.tensor([[2, 31, 44, 4, 60, 3]]))
    assert result.first_failure.site == "blocks.1.attn.out"
    assert all(s.ok for s in result.sites[:3]) and not any(s.ok for s in result.sites[3:])
