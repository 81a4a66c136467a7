"""The encoder-decoder's parts against plain math: T5's relative position buckets and bias,
cross-attention, the kernels agreeing, cached decoding equal to the whole pass for both
presets (T5 and the original sinusoidal post-norm Transformer), and config validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer import ModelConfig
from glassformer.model.encoder_decoder import EncoderDecoder, build_model
from glassformer.model.kv_cache import KVCache
from glassformer.model.layers.masking import AttentionMask
from glassformer.model.layers.positions import RelativeBias, relative_bucket
from glassformer.model.presets import get_preset
from glassformer.model.transformer import Transformer

PRESETS = ["tiny-t5", "tiny-transformer"]


def bucket_reference(distance: int, bidirectional: bool, n_buckets: int, max_distance: int) -> int:
    """T5's bucket for one key-minus-query distance, written with Python scalars."""
    offset = 0
    if bidirectional:
        n_buckets //= 2
        offset = n_buckets if distance > 0 else 0
        distance = abs(distance)
    else:
        distance = max(-distance, 0)
    exact = n_buckets // 2
    if distance < exact:
        return offset + distance
    far = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (n_buckets - exact))
    return offset + min(far, n_buckets - 1)


@settings(max_examples=60, deadline=None)
@given(st.integers(-300, 300), st.booleans(), st.sampled_from([8, 16, 32]), st.sampled_from([20, 64, 128]))
def test_relative_bucket_equals_the_formula(distance, bidirectional, n_buckets, max_distance):
    got = relative_bucket(torch.tensor([distance]), bidirectional, n_buckets, max_distance)
    assert int(got) == bucket_reference(distance, bidirectional, n_buckets, max_distance)


def test_relative_bucket_equals_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    distance = torch.arange(-200, 201)[None]
    for bidirectional in (True, False):
        expected = t5.T5Attention._relative_position_bucket(distance, bidirectional, 32, 128)
        assert torch.equal(relative_bucket(distance, bidirectional, 32, 128), expected)


def test_relative_bias_looks_up_the_table_per_head():
    config = get_preset("tiny-t5")
    bias = RelativeBias(config, bidirectional=False)
    q, k = torch.tensor([[3, 4]]), torch.tensor([[0, 1, 2, 3, 4]])
    out = bias(q, k)  # (1, H, 2, 5)
    for i, m in enumerate(q[0].tolist()):
        for j, n in enumerate(k[0].tolist()):
            b = bucket_reference(n - m, False, config.relative_buckets, config.relative_max_distance)
            torch.testing.assert_close(out[0, :, i, j], bias.table.weight[b])


def test_cross_attention_equals_plain_math():
    torch.manual_seed(0)
    config = get_preset("tiny-t5")
    model = EncoderDecoder(config).eval()
    cross = model.decoder.blocks[0].cross
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    k, v = cross.project(memory)
    mask = AttentionMask(q_pos=torch.zeros(2, 3, dtype=torch.long), k_pos=torch.arange(5).expand(2, 5),
                         causal=False, k_valid=valid)
    out = cross(x, k, v, mask)
    H, dh = config.n_heads, config.head_dim
    Wk, Wv = cross.kv.weight.split(H * dh)
    for b in range(2):
        S = int(valid[b].sum())
        q_ = (x[b] @ cross.q.weight.T).view(3, H, dh).transpose(0, 1)  # (H, 3, dh)
        k_ = (memory[b, :S] @ Wk.T).view(S, H, dh).transpose(0, 1)
        v_ = (memory[b, :S] @ Wv.T).view(S, H, dh).transpose(0, 1)
        weights = torch.softmax(q_ @ k_.transpose(1, 2), dim=-1)  # T5: no 1/√d_head
        expected = (weights @ v_).transpose(0, 1).reshape(3, H * dh) @ cross.out.weight.T
        torch.testing.assert_close(out[b], expected)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("kernel", ["reference", "flash"])
def test_kernels_agree(name, kernel):
    torch.manual_seed(0)
    sdpa = build_model(get_preset(name)).eval()
    other = build_model(get_preset(name).replace(attention_kernel=kernel)).eval()
    other.load_state_dict(sdpa.state_dict())
    ids, targets = torch.randint(0, 96, (2, 9)), torch.randint(0, 96, (2, 6))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        torch.testing.assert_close(other(ids, targets, mask), sdpa(ids, targets, mask), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", PRESETS)
def test_cached_decoding_equals_the_whole_pass(name):
    torch.manual_seed(1)
    model = build_model(get_preset(name)).eval()
    ids, targets = torch.randint(0, 96, (2, 11)), torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        whole = model(ids, targets)
        memory, cache = model.encode(ids), KVCache(model.config, 2, max_length=7)
        steps = [model.head(model.forward_hidden(targets[:, t : t + 1], memory, cache=cache))
                 for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-4)


def test_the_source_matters_and_the_future_does_not():
    torch.manual_seed(2)
    model = build_model(get_preset("tiny-transformer")).eval()
    ids, targets = torch.randint(0, 96, (1, 8)), torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        base = model(ids, targets)
        changed_future = targets.clone()
        changed_future[0, 4:] = (targets[0, 4:] + 1) % 96
        torch.testing.assert_close(model(ids, changed_future)[:, :4], base[:, :4])
        other_source = ids.clone()
        other_source[0, -1] = (ids[0, -1] + 1) % 96
        assert not torch.allclose(model(other_source, targets), base)


def test_presets_are_the_published_shapes():
    t5 = get_preset("t5-small")
    assert (t5.n_encoder_layers, t5.n_layers, t5.d_model, t5.head_dim, t5.ff_dim) == (6, 6, 512, 64, 2048)
    assert not t5.scale_scores and t5.scale_head_input and t5.position == "relative"
    base = get_preset("transformer-base")
    assert (base.n_encoder_layers, base.n_layers, base.norm_placement, base.position) == (
        6, 6, "post", "sinusoidal")


def test_config_validation():
    tiny = dict(vocab_size=10, context_length=8, d_model=8, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match="^n_encoder_layers: must be 0 or more"):
        ModelConfig(**tiny, n_encoder_layers=-1)
    with pytest.raises(ValueError, match="^causal: an encoder-decoder's decoder is causal"):
        ModelConfig(**tiny, n_encoder_layers=1, causal=False)
    with pytest.raises(ValueError, match="^decoder_start_id: 10 is not a token id"):
        ModelConfig(**tiny, decoder_start_id=10)
    with pytest.raises(ValueError, match="^relative_buckets: needs at least 4"):
        ModelConfig(**tiny, position="relative", relative_buckets=2)
    with pytest.raises(ValueError, match="^n_encoder_layers: an encoder-decoder is an EncoderDecoder"):
        Transformer(ModelConfig(**tiny, n_encoder_layers=1))
    with pytest.raises(ValueError, match="^n_encoder_layers: 0 means a decoder-only"):
        EncoderDecoder(ModelConfig(**tiny))


def test_decoder_only_relative_bias_decodes_with_the_cache():
    torch.manual_seed(3)
    model = Transformer(get_preset("tiny-llama").replace(position="relative")).eval()
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache(model.config, 1, max_length=9)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache) for t in range(9)], dim=1)
    torch.testing.assert_close(steps, whole, atol=1e-5, rtol=1e-4)
