"""fill-mask: Glassformer's top-k at each mask equals transformers' fill-mask pipeline on the
same BertForMaskedLM folder and tokenizer; the CLI prints what the library returns."""

from __future__ import annotations

import json

import pytest
import torch
from bert_folder import save_bert

from glassformer import load
from glassformer.cli import main

transformers = pytest.importorskip("transformers")
TEXTS = ["To be or [MASK] to be", "the king [MASK] his crown", "[MASK] my lord , [MASK] the queen"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert-fill")
    save_bert(folder, seed=3)
    return folder


@pytest.fixture(scope="module")
def pipeline(folder):
    return transformers.pipeline("fill-mask", model=str(folder), device="cpu", top_k=5)


@pytest.mark.parametrize("text", TEXTS)
def test_top5_equals_the_transformers_pipeline(folder, pipeline, text):
    fills = load(folder).fill_mask(text, top_k=5)
    theirs = pipeline(text)
    theirs = [theirs] if isinstance(theirs[0], dict) else theirs  # one mask: a flat list
    assert len(fills) == len(theirs) == text.count("[MASK]")
    for fill, expected in zip(fills, theirs, strict=True):
        assert [c.token_id for c in fill.candidates] == [e["token"] for e in expected]
        assert [c.token for c in fill.candidates] == [e["token_str"] for e in expected]
        torch.testing.assert_close(torch.tensor([c.score for c in fill.candidates]),
                                   torch.tensor([e["score"] for e in expected]), rtol=1e-5, atol=1e-6)


def test_cli_prints_the_library_result(folder, capsys):
    text = TEXTS[2]
    assert main(["fill-mask", "--model", str(folder), text, "--top-k", "3", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = [f.to_dict() for f in load(folder).fill_mask(text, top_k=3)]
    assert printed == {"text": text, "masks": expected}
    assert main(["fill-mask", "--model", str(folder), text, "--top-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"mask 1 (token {expected[0]['position']}):" and len(lines) == 8
    best = expected[0]["candidates"][0]
    assert lines[1].split() == [f"{best['score']:.4f}", repr(best["token"]), "(id", f"{best['token_id']})"]


def test_refusals_are_one_line(folder, tmp_path, capsys):
    assert main(["fill-mask", "--model", str(folder), "no mask here"]) == 2
    assert "holds no mask token '[MASK]'" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder), "To be"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an encoder" in err and "fill-mask" in err
    assert main(["fill-mask", "--model", str(folder), "[MASK]", "--top-k", "0"]) == 2
    capsys.readouterr()


def test_a_decoder_is_refused(tmp_path):
    from glassformer import Transformer, get_preset
    from glassformer.formats.tokenizers import CharTokenizer
    from glassformer.generation.fill_mask import fill_mask

    model = Transformer(get_preset("tiny-gpt2"))
    with pytest.raises(ValueError, match="causal"):
        fill_mask(model, CharTokenizer("ab", mask_token="[MASK]"), "a[MASK]")
    encoder = Transformer(get_preset("tiny-bert"))
    with pytest.raises(ValueError, match="no mask token"):
        fill_mask(encoder, CharTokenizer("ab"), "ab")


def test_the_serving_engine_refuses_an_encoder(folder):
    from glassformer.serving import Engine

    lm = load(folder)
    with pytest.raises(ValueError, match="encoder"):
        Engine(lm.model, lm.tokenizer)
