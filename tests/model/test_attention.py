import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer.model.config import ModelConfig
from glassformer.model.hooks import Hooks
from glassformer.model.layers.attention import Attention
from glassformer.model.layers.attention_backends import (
    KERNELS,
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


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_attention_module_equals_attention_written_per_head(kernel):
    """One fused QKV product split into heads, GQA sharing, the merge of the heads and W_O
    equal each head computed on its own from its slice of the weights."""
    config = ModelConfig(vocab_size=8, context_length=8, d_model=24, n_layers=1, n_heads=6, n_kv_heads=2,
                         attn_bias=True, attention_kernel=kernel)
    attn = Attention(config, Hooks(), "blocks.0", 0)
    B, T, H, KV, d_head = 2, 5, 6, 2, 4
    x = torch.randn(B, T, 24)
    positions = torch.arange(T).expand(B, T)
    mask = AttentionMask(q_pos=positions, k_pos=positions, causal=True, contiguous=True)
    W, b = attn.qkv.weight.detach(), attn.qkv.bias.detach()

    def project(part, head):  # part 0: Q, 1: K, 2: V; rows of the fused weight, head by head
        start = (0, H * d_head, (H + KV) * d_head)[part] + head * d_head
        rows = slice(start, start + d_head)
        return F.linear(x, W[rows], b[rows])  # (B, T, d_head)

    heads = []
    for head in range(H):
        shared = head // (H // KV)  # consecutive query heads share a key/value head
        q, k, v = project(0, head), project(1, shared), project(2, shared)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d_head)  # (B, T, T)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v)  # (B, T, d_head)
    expected = F.linear(torch.cat(heads, -1), attn.out.weight, attn.out.bias)  # (B, T, d)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, mask), expected)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_kernel_scales_scores_by_the_root_of_d_head(kernel):
    """q = k_0 = (1, ..., 1) and k_1 = 0 score √d_head and 0; with v_0 = 1 and v_1 = 0 the
    context is the softmax weight of k_0, sigmoid(√d_head) (1/d_head or no scale differ)."""
    for d_head in (4, 16, 64):
        q = torch.ones(1, 1, 1, d_head)  # (B, H, Tq, d_head)
        k = torch.stack([torch.ones(d_head), torch.zeros(d_head)])[None, None]  # (1, 1, 2, d_head)
        mask = AttentionMask(q_pos=torch.tensor([[1]]), k_pos=torch.tensor([[0, 1]]))
        out = KERNELS[kernel](q, k, k.clone(), mask)
        weight = torch.sigmoid(torch.tensor(math.sqrt(d_head)))
        torch.testing.assert_close(out, weight.expand(1, 1, 1, d_head))


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
