"""The journey of an encoder-decoder: the decoder's causal self-attention, its cross-attention
maps (decoder tokens × source tokens) recomputed by hand, and the page and summary."""

from __future__ import annotations

import json

import torch

from glassformer.cli import main
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.interpret.journey import collect_journey, render_html, summary
from glassformer.interpret.trace import capture
from glassformer.model.encoder_decoder import EncoderDecoder
from glassformer.model.presets import get_preset

PRINTABLE = "".join(chr(c) for c in range(32, 127))


def journey(name: str):
    torch.manual_seed(0)
    model = EncoderDecoder(get_preset(name).replace(init_std=0.3)).eval()
    return model, collect_journey(model, CharTokenizer(PRINTABLE), "To be, or not")


def test_cross_attention_maps_equal_the_math():
    model, data = journey("tiny-t5")
    S, U, H = len(data["source_ids"]), len(data["ids"]), model.config.n_heads
    assert data["source_tokens"] == list("To be, or not") and data["ids"][0] == 0
    ids, decoder_ids = torch.tensor([data["source_ids"]]), torch.tensor([data["ids"]])
    with torch.no_grad(), capture(model, [f"decoder.blocks.{i}.cross.q" for i in range(2)]) as acts:
        model(ids, decoder_ids)
        memory = model.encode(ids)
    for i, block in enumerate(model.decoder.blocks):
        k, _ = block.cross.project(memory)  # (1, H, S, d_head)
        q = acts[f"decoder.blocks.{i}.cross.q"]  # (1, H, U, d_head)
        expected = torch.softmax(q @ k.transpose(-2, -1), dim=-1)  # T5: no 1/√d_head
        got = torch.tensor(data["cross_attention"][i]).view(H, U, S)
        torch.testing.assert_close(got, expected[0], atol=1e-3, rtol=0)  # sent with 3 decimals


def test_decoder_self_attention_is_causal_and_encoder_sees_everything():
    model, data = journey("tiny-transformer")
    U, S = len(data["ids"]), len(data["source_ids"])
    for layer in data["attention"]:
        for head in layer:
            weights = torch.tensor(head).view(U, U)
            assert torch.all(weights.triu(1) == 0)
            torch.testing.assert_close(weights.sum(-1), torch.ones(U), atol=5e-3, rtol=0)
    encoder = torch.tensor(data["encoder_attention"][0][0]).view(S, S)
    assert (encoder.triu(1) > 0).any()  # bidirectional: later tokens are seen


def test_page_and_summary():
    _, data = journey("tiny-t5")
    html = render_html(data)
    assert "cross-heatmap" in html or "crossView" in html
    out = summary(data)
    assert out["attribution"] is None and len(out["logit_lens"]) == 3  # embedding + 2 layers
    names = [s["name"] for s in out["sites"]]
    assert "decoder.blocks.1.cross.pattern" in names and "encoder.blocks.0.attn.pattern" in names


def test_cli_json(capsys):
    assert main(["journey", "--preset", "tiny-t5", "--json", "hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any(s["name"] == "decoder.blocks.0.cross.pattern" for s in out["sites"])
