"""The journey report of an encoder: bidirectional attention weights, the encoder's own steps,
and predictions at the mask equal to fill-mask's."""

from __future__ import annotations

import pytest
import torch
from bert_folder import save_bert

from glassformer import load
from glassformer.cli import main
from glassformer.interpret.journey import collect_journey, render_html

pytest.importorskip("transformers")
TEXT = "to be or [MASK] to be"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert-journey")
    save_bert(folder, seed=9)
    return folder


def test_encoder_journey(folder):
    lm = load(folder)
    data = collect_journey(lm.model, lm.tokenizer, TEXT, top_k=5, ig_steps=2)
    fill = lm.fill_mask(TEXT, top_k=5)[0]
    assert data["ids"] == lm.tokenizer.encode_sequence(TEXT)  # [CLS] ... [SEP]
    assert data["prediction"] == {"position": fill.position, "title": "Masked-token probabilities"}
    assert [t["id"] for t in data["next_tokens"]] == [c.token_id for c in fill.candidates]
    assert data["decode_step"] is None
    assert [s["name"] for s in data["sites"]] == list(lm.model.hooks.sites)
    T = len(data["ids"])
    for layer in data["attention"]:
        for head in layer:
            weights = torch.tensor(head).view(T, T)
            assert weights.triu(1).sum() > 0.1  # queries read later keys: bidirectional
            torch.testing.assert_close(weights.sum(-1), torch.ones(T), atol=5e-3, rtol=0)
    input_sites = [s["site"] for s in data["steps"]["input"]]
    assert input_sites == ["embed.tokens", "embed.positions", "embed.token_types", "embed.out"]
    assert data["steps"]["input"][-1]["equation"] == "I_emb = Norm(E_token[ids] + E_pos + E_type)"
    assert [s["site"] for s in data["steps"]["output"]] == ["head_transform", "logits"]
    assert "Masked-token probabilities" in render_html(data)


def test_encoder_journey_cli(folder, tmp_path, capsys):
    out = tmp_path / "journey.html"
    assert main(["journey", "--model", str(folder), TEXT, "-o", str(out), "--ig-steps", "2"]) == 0
    assert out.is_file() and "wrote" in capsys.readouterr().out
