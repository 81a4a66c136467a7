import math

import pytest
import torch

from glassformer import PRESETS, KVCache, ModelConfig, Transformer, get_preset
from glassformer.model.layers.positions import (
    alibi_slopes,
    apply_rope,
    rope_cos_sin,
    rope_inverse_frequencies,
)

TINY = sorted(name for name in PRESETS  # decoder-only; encoder-decoders: test_encoder_decoder.py
              if name.startswith("tiny-") and not PRESETS[name].n_encoder_layers)
CAUSAL = [name for name in TINY if PRESETS[name].causal]


def _model(name, **changes):
    return Transformer(get_preset(name).replace(**changes)).eval()


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("kernel", ["reference", "sdpa", "flash"])
def test_logits_shape_and_kernels_agree(name, kernel):
    ids = torch.randint(0, 96, (2, 13))
    reference = _model(name, attention_kernel="reference")
    model = Transformer(reference.config.replace(attention_kernel=kernel)).eval()
    model.load_state_dict(reference.state_dict())
    logits = model(ids)
    assert logits.shape == (2, 13, 96)
    torch.testing.assert_close(logits, reference(ids))


@pytest.mark.parametrize("name", CAUSAL)
def test_changing_a_token_changes_no_earlier_logit(name):
    model = _model(name)
    ids = torch.randint(0, 96, (1, 12))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % 96
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=0)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_bidirectional_mode_sees_the_future():
    model = _model("tiny-bidirectional")
    ids = torch.randint(0, 96, (1, 12))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % 96
    assert not torch.allclose(model(ids)[:, :7], model(changed)[:, :7])


def test_without_positions_attention_is_permutation_equivariant():
    model = _model("tiny-gpt2", position="none", causal=False)
    ids = torch.randint(0, 96, (1, 10))
    perm = torch.randperm(10)
    torch.testing.assert_close(model(ids)[:, perm], model(ids[:, perm]))


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope", "alibi"])
def test_any_position_scheme_breaks_permutation_equivariance(position):
    model = _model("tiny-gpt2", position=position, causal=False)
    ids = torch.randint(0, 96, (1, 10))
    perm = torch.arange(9, -1, -1)
    assert not torch.allclose(model(ids)[:, perm], model(ids[:, perm]), atol=1e-4)


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("kernel", ["reference", "sdpa", "flash"])
def test_incremental_decoding_equals_full_pass(name, kernel):
    model = _model(name, attention_kernel=kernel)
    ids = torch.randint(0, 96, (2, 20))
    full = model(ids)
    cache = KVCache(model.config, batch_size=2)
    pieces = [model(ids[:, :6], cache=cache)]  # a prefill, then one token at a time
    pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(6, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


def test_chunked_prefill_equals_full_pass():
    model = _model("tiny-mistral")  # sliding window 8 across chunk boundaries
    ids = torch.randint(0, 96, (1, 25))
    cache = KVCache(model.config, batch_size=1)
    chunks = [model(ids[:, s : s + 7], cache=cache) for s in range(0, 25, 7)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), model(ids))


def test_cache_holds_kv_heads_not_query_heads():
    model = _model("tiny-mqa")
    cache = KVCache(model.config, batch_size=1)
    model(torch.randint(0, 96, (1, 4)), cache=cache)
    assert cache.keys[0].shape == (1, 1, model.config.context_length, model.config.head_dim)


def test_left_padding_with_explicit_positions_equals_unpadded():
    model = _model("tiny-llama")
    ids = torch.randint(1, 96, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    pad_mask = torch.tensor([[False] * 3 + [True] * 6])
    positions = (pad_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(padded, positions=positions, pad_mask=pad_mask)
    torch.testing.assert_close(logits[:, 3:], model(ids))


def test_going_past_the_context_is_a_clear_error():
    model = _model("tiny-gpt2")
    with pytest.raises(ValueError, match="context_length=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = KVCache(model.config, batch_size=1)
    model(torch.zeros(1, 32, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_rope_score_depends_only_on_relative_position():
    config = ModelConfig(vocab_size=8, context_length=64, d_model=16, n_layers=1, n_heads=1,
                         position="rope")
    inv_freq, _ = rope_inverse_frequencies(config)
    q, k = torch.randn(2, 1, 1, 1, 16).unbind(0)

    def score(m, n):
        cos_m, sin_m = rope_cos_sin(inv_freq, torch.tensor([[m]]))
        cos_n, sin_n = rope_cos_sin(inv_freq, torch.tensor([[n]]))
        return (apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum().item()

    for offset in (0, 3, 17):
        assert score(5 + offset, 2 + offset) == pytest.approx(score(5, 2), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
    # a rotation keeps norms
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([[9]]))
    torch.testing.assert_close(apply_rope(q, cos, sin).norm(), q.norm())


def test_sliding_layers_turn_by_their_own_rope_base():
    """rope_local_theta: a sliding layer's angles are m·base^(-2i/d) of its own base, unscaled;
    a global layer keeps rope_theta and the scaling. Where the bases agree and nothing scales,
    the model computes what it computes without the field."""
    config = ModelConfig(vocab_size=50, context_length=32, d_model=32, n_layers=2, n_heads=2,
                         position="rope", rope_theta=500.0, rope_scaling="linear", rope_factor=2.0,
                         layer_windows=(4, None), rope_local_theta=50.0)
    model = Transformer(config)
    assert [block.attn.rope_kind for block in model.blocks] == [1, 0]
    positions = torch.arange(6)[None]  # (1, T)
    d = config.head_dim
    for (cos, sin), base, scale in zip(model.rope_angles(positions), (500.0, 50.0), (2.0, 1.0),
                                       strict=True):
        angles = positions[0, :, None] * base ** (-torch.arange(0, d, 2).float() / d) / scale
        angles = torch.cat((angles, angles), dim=-1)  # (T, d)
        torch.testing.assert_close(cos[0, 0], angles.cos())
        torch.testing.assert_close(sin[0, 0], angles.sin())
    alike = config.replace(rope_local_theta=500.0, rope_scaling="none", rope_factor=1.0)
    same, plain = Transformer(alike), Transformer(alike.replace(rope_local_theta=None))
    plain.load_state_dict(same.state_dict())
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(same(ids), plain(ids))
        one_base = Transformer(config.replace(rope_local_theta=None))
        one_base.load_state_dict(model.state_dict())
        assert not torch.allclose(one_base(ids), model(ids), atol=1e-4)  # the base is used


def test_alibi_slopes_follow_the_geometric_schedule():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** (-k) for k in range(1, 9)]))
    assert alibi_slopes(4).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    twelve = alibi_slopes(12)  # 8 slopes of the 8-head schedule, then odd ones of the 16-head
    expected = [2.0 ** (-k) for k in range(1, 9)] + [2.0 ** (-(2 * j + 1) / 2) for j in range(4)]
    torch.testing.assert_close(twelve, torch.tensor(expected))
    assert len(set(alibi_slopes(6).tolist())) == 6


def test_gpt2_initialisation():
    model = Transformer(get_preset("gpt2").replace(n_layers=4, vocab_size=2000))
    assert abs(model.embed.tokens.weight.std().item() - 0.02) < 1e-3
    assert abs(model.blocks[0].attn.qkv.weight.std().item() - 0.02) < 1e-3
    residual = 0.02 / math.sqrt(2 * 4)
    assert abs(model.blocks[0].attn.out.weight.std().item() - residual) < 1e-3
    assert abs(model.blocks[0].mlp.down.weight.std().item() - residual) < 1e-3
    assert model.lm_head.weight is model.embed.tokens.weight


def test_runs_in_bfloat16_with_dtype_from_the_weights():
    model = _model("tiny-llama").to(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 9))
    cache = KVCache(model.config, batch_size=1)
    logits = model(ids, cache=cache)
    assert logits.dtype == torch.bfloat16 and cache.keys[0].dtype == torch.bfloat16
    reference = _model("tiny-llama")
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    torch.testing.assert_close(logits.float(), reference(ids), atol=0.05, rtol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_runs_on_cuda_like_on_cpu():
    model = _model("tiny-llama")
    ids = torch.randint(0, 96, (1, 9))
    expected = model(ids)
    cache = KVCache(model.config, batch_size=1)
    logits = model.cuda()(ids.cuda(), cache=cache)
    assert cache.keys[0].device.type == "cuda"
    torch.testing.assert_close(logits.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_layernorm_without_bias():
    model = _model("tiny-gpt2", norm_bias=False)
    assert model.blocks[0].norm1.bias is None and model.final_norm.bias is None
    assert not any(name.endswith("norm1.bias") for name, _ in model.named_parameters())
    x = torch.randn(2, 5, 32)
    expected = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(model.final_norm(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_linear_layers_lists_every_weight_matrix_once(name):
    model = _model(name)
    layers = model.linear_layers()
    linears = {id(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert {id(m) for m in layers.values()} == linears and len(layers) == len(linears)
    assert list(layers)[:4] == ["blocks.0.attn.qkv", "blocks.0.attn.out", "blocks.0.mlp.up",
                                "blocks.0.mlp.down"]
    extra = (model.config.head == "mlm") + model.config.pooler  # head_transform, pooler
    assert list(layers)[-1] == "lm_head" and len(layers) == 4 * model.config.n_layers + 1 + extra


def test_no_fused_step_without_a_conversion():
    model = _model("tiny-llama")
    with torch.no_grad():
        assert model.fused_step() is None
        built = []
        model.install_fused_step(lambda m: built.append(m) or (lambda token, cache: None))
        assert model.fused_step() is not None and model.fused_step() is not None
        assert built == [model]  # built once, on first use
        model.train()
        assert model.fused_step() is None  # training mode: the module path
    assert model.eval().fused_step() is None  # gradients enabled: the module path
