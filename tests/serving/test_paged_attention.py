"""Attention over block tables against dense attention over the same keys in order."""

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.model.layers.attention_backends import reference_attention
from glassformer.serving.kv_pool import KVPool, bytes_per_block, quantize_kv
from glassformer.serving.paged_attention import PagedView
from glassformer.serving.step import RequestRows, slots_of


def _setup(kv_dtype="fp32", block_size=4, n_blocks=32, H=4, KV=2, d=8, **changes):
    config = get_preset("tiny-llama").replace(n_heads=H, n_kv_heads=KV, d_model=H * d, n_layers=1,
                                              **changes)
    pool = KVPool(config, n_blocks, block_size, kv_dtype)
    pool.reserve(n_blocks)
    return config, pool


@pytest.mark.parametrize("changes", [
    {}, {"sliding_window": 3}, {"position": "alibi"}, {"position": "relative"},
    {"scale_scores": False}, {"attention_kernel": "flash"},
])
def test_fast_and_reference_equal_the_layers_attention_over_dense_keys(changes):
    torch.manual_seed(0)
    config, pool = _setup(**changes)
    model = Transformer(config).eval()
    attn = model.blocks[0].attn
    # three requests: a decode (1 new token of 7), a chunk (5 new of 9), a fresh prompt (6)
    shapes = [(7, 1), (9, 5), (6, 6)]
    free = torch.randperm(32).tolist()  # blocks scattered over the pool
    parts, keys, start = [], [], 0
    for context, n in shapes:
        table = [free.pop() for _ in range(-(-context // 4))]
        slots = slots_of(table, context, 4)
        k, v = torch.randn(context, 2, 8), torch.randn(context, 2, 8)  # (S, KV, d)
        pool.write(0, slots[: context - n], k[: context - n], v[: context - n])  # cached
        parts.append(RequestRows(None, start, n, slots))
        keys.append((k, v))
        start += n
    q = torch.randn(1, 4, start, 8)  # (1, H, N, d)
    new_k = torch.cat([k[-p.n :] for p, (k, _) in zip(parts, keys, strict=True)]).transpose(0, 1)[None]
    new_v = torch.cat([v[-p.n :] for p, (_, v) in zip(parts, keys, strict=True)]).transpose(0, 1)[None]
    expected = torch.empty_like(q)
    for part, (k, v) in zip(parts, keys, strict=True):
        S = part.context
        mask = model.attention_mask(torch.arange(S - part.n, S)[None], torch.arange(S)[None],
                                    contiguous=True)
        qp = q[:, :, part.rows]
        expected[:, :, part.rows] = reference_attention(
            qp, k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale=attn.scale)[0]
    for fast in (False, True):
        view = PagedView(pool, parts, fast, model)
        got = view.attend(0, q, new_k, new_v, None, attn.context)
        torch.testing.assert_close(got, expected)


def test_int8_pool_round_trip_error_is_bounded():
    torch.manual_seed(0)
    _, pool = _setup("int8")
    x = torch.randn(10, 2, 8)
    slots = torch.arange(3, 13)
    pool.write(0, slots, x, -x)
    k, v = pool.read(0, slots)
    bound = x.abs().amax(-1, keepdim=True) / 127 / 2 + 1e-7  # half a quantization step
    assert ((k - x).abs() <= bound).all() and ((v + x).abs() <= bound).all()
    q, scale = quantize_kv(torch.zeros(2, 8))
    assert (q == 0).all() and (scale == 0).all()


def test_fp8_pool_round_trip_is_the_formats_quantize_dequantize_and_copies_are_exact():
    torch.manual_seed(0)
    _, pool = _setup("fp8")
    x = torch.randn(4, 2, 8) * 10
    pool.write(0, torch.arange(4, 8), x, -x)  # block 1
    pool.copy_blocks([(1, 5)])
    q, scale = quantize_kv(x, "fp8")
    expected = q.float() * scale[..., None]
    k, v = pool.read(0, torch.arange(20, 24))
    assert pool.keys[0].dtype == torch.float8_e4m3fn
    assert torch.equal(k, expected) and torch.equal(v, -expected)
    assert not torch.equal(k, x)  # the pool rounds


def test_fp32_pool_round_trip_and_block_copies_are_exact():
    torch.manual_seed(0)
    _, pool = _setup()
    x = torch.randn(4, 2, 8)
    pool.write(0, torch.arange(4, 8), x, x)  # block 1
    pool.copy_blocks([(1, 5)])
    torch.testing.assert_close(pool.read(0, torch.arange(20, 24))[0], x, rtol=0, atol=0)


def test_memory_per_block():
    config, pool = _setup()
    assert pool.nbytes() == 32 * bytes_per_block(config, 4, "fp32")
    int8, fp8, fp32 = (bytes_per_block(config, 4, name) for name in ("int8", "fp8", "fp32"))
    assert int8 == fp8 < bytes_per_block(config, 4, "bf16") < fp32
    d = config.head_dim  # a quarter of fp32, plus a float32 scale per d_head values
    assert fp8 / fp32 == (d + 4) / (4 * d)
    smollm2 = get_preset("tiny-llama").replace(n_heads=9, n_kv_heads=3, d_model=576)  # d_head 64
    assert bytes_per_block(smollm2, 16, "fp8") / bytes_per_block(smollm2, 16, "fp32") == 68 / 256
    with pytest.raises(ValueError, match="kv_dtype"):
        bytes_per_block(config, 4, "fp4")


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "fp8"])
def test_the_pool_grows_with_the_blocks_used_and_keeps_what_it_holds(kv_dtype):
    config = get_preset("tiny-llama").replace(n_layers=2)
    pool = KVPool(config, 40, 4, kv_dtype)
    assert pool.nbytes() == 0
    x = torch.randn(4, config.kv_heads, config.head_dim)
    pool.reserve(3)
    pool.write(1, torch.arange(8, 12), x, -x)  # block 2
    before = pool.read(1, torch.arange(8, 12))
    pool.reserve(5)  # a quarter of 3 blocks is less than one: what is asked
    assert pool.allocated == 5 and pool.nbytes() == 5 * bytes_per_block(config, 4, kv_dtype)
    pool.reserve(20)
    pool.reserve(21)  # grows by a quarter: 25 blocks
    assert pool.allocated == 25 and pool.nbytes() == 25 * bytes_per_block(config, 4, kv_dtype)
    for got, want in zip(pool.read(1, torch.arange(8, 12)), before, strict=True):
        assert torch.equal(got, want)
    pool.copy_blocks([(2, 30)])  # a copy past the held blocks grows the pool first
    assert pool.allocated == 31 and torch.equal(pool.read(1, torch.arange(120, 124))[0], before[0])
    with pytest.raises(ValueError, match="blocks"):
        pool.reserve(41)


def test_a_preallocated_pool_holds_every_block_at_fixed_addresses():
    """On an accelerator (or when asked) the pool takes all its blocks at once: reserving and
    writing never move a layer's storage."""
    config = get_preset("tiny-llama").replace(n_layers=2)
    pool = KVPool(config, 40, 4, preallocate=True)
    assert pool.allocated == 40 and pool.nbytes() == 40 * bytes_per_block(config, 4, "fp32")
    addresses = [t.data_ptr() for t in pool.keys + pool.values]
    pool.reserve(40)
    pool.write(0, torch.arange(150, 154), *torch.randn(2, 4, config.kv_heads, config.head_dim))
    assert [t.data_ptr() for t in pool.keys + pool.values] == addresses
    assert KVPool(config, 40, 4).allocated == 0  # the CPU's default: grown as used
