"""Layer-by-layer comparison: equal models agree everywhere; a corrupted layer is named first."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.cli import main
from glassformer.errors import InputError
from glassformer.formats.export import export_hf
from glassformer.formats.huggingface import load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.interpret.compare import compare, hf_reference, sites

transformers = pytest.importorskip("transformers")
VOCAB = 300
FAMILIES = {
    "llama": dict(position="rope", norm="rmsnorm", activation="silu", gated=True, attn_bias=False,
                  attn_out_bias=False, mlp_bias=False, n_kv_heads=2),
    "gpt2": dict(position="learned", norm="layernorm", activation="gelu_tanh"),
    # the layouts of GPT-NeoX (a parallel block) and Phi-3 (fused products), half of each head turning
    "gpt_neox": dict(position="rope", norm="layernorm", activation="gelu", parallel_block=True,
                     rotary_dim=4),
    "phi3": dict(position="rope", norm="rmsnorm", activation="silu", gated=True, attn_bias=False,
                 attn_out_bias=False, mlp_bias=False, n_kv_heads=2, rotary_dim=4),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_folder(request, tmp_path_factory):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, context_length=32, d_model=32, n_layers=3, n_heads=4,
                         init_std=0.2, **FAMILIES[request.param])
    tokenizer = HFTokenizer.train_bpe(["the quick brown fox jumps over a lazy dog"] * 9, VOCAB)
    return export_hf(Transformer(config), tokenizer, tmp_path_factory.mktemp("m") / "hf")


def test_equal_models_agree_everywhere(hf_folder):
    model, tokenizer = load_hf(hf_folder)
    reference = hf_reference(str(hf_folder), model, tokenizer)
    result = compare(model, reference, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
    assert [s.site for s in result.sites] == sites(3)
    assert result.first_failure is None
    assert max(s.max_abs_diff for s in result.sites) < 1e-5


def test_a_corrupted_layer_is_named_first(hf_folder):
    model, tokenizer = load_hf(hf_folder)
    reference = hf_reference(str(hf_folder), model, tokenizer)
    with torch.no_grad():
        model.blocks[1].attn.out.weight.mul_(1.01)
    result = compare(model, reference, torch.tensor([[3, 1, 4, 1, 5]]))
    assert result.first_failure.site == "blocks.1.attn.out"
    assert all(s.ok for s in result.sites[:3])  # embeddings and block 0 still agree
    assert not any(s.ok for s in result.sites[3:])


def test_checkpoint_source_is_exported_for_the_reference(hf_folder):
    model, tokenizer = load_hf(hf_folder)
    reference = hf_reference("/nonexistent/checkpoint", model, tokenizer)  # not HF: export ours
    assert compare(model, reference, torch.tensor([[7, 8, 9]])).first_failure is None


def test_cli_json(hf_folder, capsys):
    assert main(["compare", "--model", str(hf_folder), "--json", "the lazy dog"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["first_failure"] is None
    assert [s["site"] for s in report["sites"]] == sites(3)


@pytest.mark.parametrize("content", [b'{"model_type": ', b"\xff not text"])
def test_a_reference_folder_whose_config_is_not_json_is_refused_by_name(tmp_path, content):
    model = Transformer(ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, context_length=8))
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(InputError, match="config.json"):
        hf_reference(str(tmp_path), model, None)
