import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer.model.layers.attention_backends import (
    flash_attention,
    reference_attention,
    repeat_kv,
    sdpa_attention,
)
from glassformer.model.layers.masking import AttentionMask
from glassformer.model.layers.positions import alibi_slopes


def _mask(B, Tq, Tk, causal, window, alibi, H, padding, generator):
    start = Tk - Tq
    q_pos = torch.arange(start, Tk).expand(B, Tq)
    k_pos = torch.arange(Tk).expand(B, Tk)
    k_valid = None
    if padding:  # left padding of a random length per row
        lengths = torch.randint(0, Tk, (B,), generator=generator)
        k_valid = torch.arange(Tk)[None, :] >= lengths[:, None]
    return AttentionMask(
        q_pos=q_pos, k_pos=k_pos, causal=causal, window=window, k_valid=k_valid,
        alibi_slopes=alibi_slopes(H) if alibi else None,
        contiguous=True,
    )


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2),
    kv=st.sampled_from([1, 2, 3]),
    rep=st.sampled_from([1, 2, 3]),
    Tq=st.integers(1, 70),
    extra=st.integers(0, 9),
    d_head=st.sampled_from([4, 8, 10]),
    causal=st.booleans(),
    window=st.sampled_from([None, 1, 5]),
    alibi=st.booleans(),
    padding=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_kernel_equals_reference(B, kv, rep, Tq, extra, d_head, causal, window, alibi,
                                       padding, seed):
    generator = torch.Generator().manual_seed(seed)
    H, Tk = kv * rep, Tq + extra
    q = torch.randn(B, H, Tq, d_head, generator=generator)
    k = torch.randn(B, kv, Tk, d_head, generator=generator)
    v = torch.randn(B, kv, Tk, d_head, generator=generator)
    mask = _mask(B, Tq, Tk, causal, window, alibi, H, padding, generator)
    expected, weights = reference_attention(q, k, v, mask)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask), expected)
    torch.testing.assert_close(flash_attention(q, k, v, mask, block_q=16, block_k=16), expected)
    assert torch.isfinite(weights).all()


def test_reference_is_the_literal_math():
    q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
    mask = AttentionMask(q_pos=torch.arange(5)[None], k_pos=torch.arange(5)[None], contiguous=True)
    out, weights = reference_attention(q, k, v, mask)
    scores = q @ k.transpose(-1, -2) / 2.0  # √d_head = 2
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(weights, torch.softmax(scores, -1))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    assert (weights[..., torch.ones(5, 5).triu(1).bool()] == 0).all()


def test_gqa_shares_each_kv_head_with_consecutive_query_heads():
    k = torch.randn(1, 2, 3, 4)
    shared = repeat_kv(k, 3)
    assert shared.shape == (1, 6, 3, 4)
    for head in range(6):
        torch.testing.assert_close(shared[:, head], k[:, head // 3])


def test_two_views_of_multi_head_projection():
    """One large W_Q sliced into H heads equals H separate per-head projections."""
    d, H = 12, 3
    d_head = d // H
    x = torch.randn(2, 5, d)
    W_Q = torch.randn(d, d)  # columns grouped by head: x @ W_Q -> (B, T, H·d_head)
    big = (x @ W_Q).view(2, 5, H, d_head).transpose(1, 2)  # (B, H, T, d_head)
    for h in range(H):
        per_head = x @ W_Q[:, h * d_head : (h + 1) * d_head]  # (B, T, d_head)
        torch.testing.assert_close(big[:, h], per_head)


def test_scaling_keeps_score_variance_near_one():
    generator = torch.Generator().manual_seed(1)
    for d_head in (16, 64, 256):
        q = torch.randn(200_000, d_head, generator=generator)
        k = torch.randn(200_000, d_head, generator=generator)
        scaled = (q * k).sum(-1) / math.sqrt(d_head)
        assert abs(scaled.var().item() - 1.0) < 0.03
        assert abs((q * k).sum(-1).var().item() / d_head - 1.0) < 0.03  # unscaled grows as d


def test_flash_skips_no_keys_and_needs_no_full_matrix():
    q, k, v = torch.randn(3, 1, 1, 130, 8).unbind(0)
    mask = AttentionMask(q_pos=torch.arange(130)[None], k_pos=torch.arange(130)[None],
                         contiguous=True)
    tiles = []
    original = mask.bias

    def spy(dtype, rows=slice(None), cols=slice(None)):
        out = original(dtype, rows, cols)
        tiles.append(out.shape[-2:])
        return out

    object.__setattr__(mask, "bias", spy)
    flash_attention(q, k, v, mask, block_q=32, block_k=32)
    assert max(r * c for r, c in tiles) == 32 * 32


def test_flash_rejects_dropout():
    q = torch.randn(1, 1, 2, 4)
    mask = AttentionMask(q_pos=torch.arange(2)[None], k_pos=torch.arange(2)[None])
    with pytest.raises(ValueError, match="flash"):
        flash_attention(q, q, q, mask, dropout=0.1)
