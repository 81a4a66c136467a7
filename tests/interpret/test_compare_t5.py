"""Layer-by-layer comparison of an encoder-decoder with transformers' T5: equal models agree at
every place of both stacks; a corrupted cross-attention is named first."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.cli import main
from glassformer.formats.export import export_hf
from glassformer.formats.huggingface import load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.interpret.compare import compare, hf_reference, seq2seq_sites
from glassformer.model.encoder_decoder import EncoderDecoder
from glassformer.model.presets import get_preset

transformers = pytest.importorskip("transformers")
VOCAB = 300


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = get_preset("tiny-t5").replace(vocab_size=VOCAB, n_encoder_layers=3, init_std=0.2)
    tokenizer = HFTokenizer.train_bpe(["the quick brown fox jumps over a lazy dog"] * 9, VOCAB)
    return export_hf(EncoderDecoder(config), tokenizer, tmp_path_factory.mktemp("m") / "t5")


def test_equal_models_agree_everywhere(t5_folder):
    model, tokenizer = load_hf(t5_folder)
    reference = hf_reference(str(t5_folder), model, tokenizer)
    result = compare(model, reference, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
    assert [s.site for s in result.sites] == seq2seq_sites(3, 2)
    assert result.first_failure is None
    assert max(s.max_abs_diff / max(s.reference_max, 1) for s in result.sites) < 1e-5


def test_a_corrupted_cross_attention_is_named_first(t5_folder):
    model, tokenizer = load_hf(t5_folder)
    reference = hf_reference(str(t5_folder), model, tokenizer)
    with torch.no_grad():
        model.decoder.blocks[1].cross.out.weight.mul_(1.01)
    result = compare(model, reference, torch.tensor([[3, 1, 4, 1, 5]]))
    assert result.first_failure.site == "decoder.blocks.1.cross.out"
    names = [s.site for s in result.sites]
    assert all(s.ok for s in result.sites[: names.index("decoder.blocks.1.cross.out")])


def test_cli_json(t5_folder, capsys):
    assert main(["compare", "--model", str(t5_folder), "--json", "the lazy dog"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["first_failure"] is None
    assert [s["site"] for s in report["sites"]] == seq2seq_sites(3, 2)
