"""The journey shows each piece a family switches on in the equation of the step it changes, and
the tensors the journey shows at those sites satisfy that equation (computed here from the
captured tensors and the model's weights, the plain math)."""

from __future__ import annotations

import math

import pytest
import torch

from glassformer.formats.families import BY_MODEL_TYPE
from glassformer.interpret.journey.steps import input_steps, layer_steps, output_steps
from glassformer.interpret.trace import run_with_cache
from glassformer.model.encoder_decoder import build_model


def _config(model_type: str, **changes):
    family = BY_MODEL_TYPE[model_type]
    return family.read(family.example | changes)


def _steps(config) -> dict[str, dict]:
    layer = layer_steps(config, build_model(config).hooks.sites)
    return {step["site"]: step for step in input_steps(config) + layer + output_steps(config)}


def _run(config):
    torch.manual_seed(0)
    model = build_model(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # large weights, so that the caps bite
            p.normal_(0, 1.0)
    ids = torch.randint(0, config.vocab_size, (1, 6))
    _, cache = run_with_cache(model, ids)
    return model, ids, cache


def test_gemma2_pieces_are_shown():
    steps = _steps(_config("gemma2"))
    assert steps["embed.tokens"]["equation"] == "E_token[ids] · √d"
    assert steps["norm1"]["equation"] == "x̂ = RMSNorm(x) = x / √(mean(x²) + ε) ⊙ (1 + g)"
    assert steps["attn.scores"]["equation"] == "A = c · tanh(Q Kᵀ / √256 / c),  c = 50"
    assert "local layers 0 (W = 16)" in steps["attn.masked_scores"]["note"]
    assert steps["resid_mid"]["equation"] == "x ← x + Norm(MultiHead(x̂))"  # sandwich
    assert steps["resid_post"]["equation"] == "x ← x + Norm(FFN(x̂))"
    assert steps["logits"]["equation"] == "logits = c · tanh((h W_headᵀ) / c),  c = 30"


def test_gemma2_tensors_follow_the_equations_shown():
    config = _config("gemma2", attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    model, ids, cache = _run(config)
    b = "blocks.0."
    scaled = model.embed.tokens.weight[ids] * math.sqrt(config.d_model)
    torch.testing.assert_close(cache["embed.tokens"], scaled)
    torch.testing.assert_close(cache[b + "resid_mid"], cache[b + "resid_pre"] + cache[b + "attn_out_norm"])
    torch.testing.assert_close(cache[b + "resid_post"], cache[b + "resid_mid"] + cache[b + "mlp_out_norm"])
    q, k = cache[b + "attn.q"], cache[b + "attn.k"].repeat_interleave(config.n_rep, dim=1)
    raw = q @ k.transpose(-1, -2) / math.sqrt(config.attn_scale)  # (B, H, T, T)
    torch.testing.assert_close(cache[b + "attn.scores"], 5 * torch.tanh(raw / 5))
    assert raw.abs().max() > 5  # the cap bites here
    head = cache["final_norm"] @ model.embed.tokens.weight.T  # tied
    torch.testing.assert_close(cache["logits"], 3 * torch.tanh(head / 3))
    assert head.abs().max() > 3


def test_the_parallel_residual_and_partial_rotary_are_shown():
    steps = _steps(_config("gpt_neox"))
    assert steps["norm2"]["equation"] == "x̂₂ = Norm₂(x_in)"
    assert steps["mlp.hidden"]["equation"] == "GELU(x̂₂ W_1 + b_1)"
    assert steps["resid_post"]["equation"] == "x ← x + MultiHead(x̂) + FFN(x̂₂)"
    assert steps["attn.q"]["equation"] == "Q = RoPE_r(x̂ W_Q)"
    assert "first r = 2 of its 8 dimensions" in steps["attn.k"]["note"]


def test_neox_tensors_follow_the_equations_shown():
    config = _config("gpt_neox")
    model, _, cache = _run(config)
    block, b = "blocks.1.", model.blocks[1]
    x = cache[block + "resid_pre"]
    torch.testing.assert_close(cache[block + "norm2"], b.norm2(x))  # reads the block's input
    torch.testing.assert_close(cache[block + "resid_post"],
                               x + cache[block + "attn.out"] + cache[block + "mlp.out"])
    B, T, r = x.shape[0], x.shape[1], config.rotary_dim
    projected = b.attn.qkv(cache[block + "norm1"])[..., :config.d_model]  # x̂ W_Q (+ b)
    projected = projected.view(B, T, config.n_heads, config.head_dim).transpose(1, 2)
    torch.testing.assert_close(cache[block + "attn.q"][..., r:], projected[..., r:])  # unturned
    assert not torch.allclose(cache[block + "attn.q"][..., 1:, :r], projected[..., 1:, :r])


def test_qk_norm_and_output_norms_are_shown():
    qwen, olmo = _steps(_config("qwen3")), _steps(_config("olmo2"))
    assert qwen["attn.q"]["equation"] == "Q = RoPE(Norm_Q(x̂ W_Q))"
    assert "over each head's d_head" in qwen["attn.q_norm"]["note"]
    assert "over all heads together" in olmo["attn.k_norm"]["note"]
    assert olmo["resid_mid"]["equation"] == "x ← x + Norm(MultiHead(x))"
    assert "norm1" not in olmo and "attn_out_norm" in olmo


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_a_model_without_the_pieces_shows_none_of_them(model_type):
    shown = " ".join(f"{s['equation']} {s['note']}" for s in _steps(_config(model_type)).values())
    for piece in ("c · tanh", "√d ", "(1 + g)", "RoPE_r", "x̂₂", "Norm_Q", "local layers"):
        assert piece not in shown
