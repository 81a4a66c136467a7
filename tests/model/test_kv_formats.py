"""The KV formats against plain reference math: e4m3 rounding written out from its bit layout,
and decoding through an fp8 cache against a float32 cache that holds the rounded keys."""

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.accel.quantize import quantize_model
from glassformer.generation.core import decode_one_token, prefill
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.kv_cache import KVCache
from glassformer.model.kv_formats import bytes_per_vector, dequantize_kv, quantize_kv


def _e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3 value in order, and whether its mantissa is even."""
    values, even = [], []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:  # the NaN code
                continue
            if exponent == 0:  # subnormal
                values.append(mantissa / 8 * 2.0**-6)
            else:
                values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
            even.append(mantissa % 2 == 0)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(even)


def _reference_fp8(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize per vector: scale = amax / 448, clamp, round to the nearest e4m3
    value (ties to the even mantissa), times the scale."""
    grid, even = _e4m3_grid()
    assert grid[-1] == 448
    scale = x.abs().amax(-1, keepdim=True) / 448  # (..., 1)
    y = torch.where(scale > 0, x / scale, 0.0).clamp(-448, 448).double()
    upper = torch.searchsorted(grid, y.abs()).clamp(max=len(grid) - 1)
    lower = (upper - 1).clamp(min=0)
    d_low, d_up = y.abs() - grid[lower], grid[upper] - y.abs()
    pick_up = (d_up < d_low) | ((d_up == d_low) & even[upper])
    rounded = torch.where(pick_up, grid[upper], grid[lower]) * y.sign()
    return rounded.float() * scale


class RoundTripCache(KVCache):
    """A float32 cache that stores the reference quantize-dequantized keys and values."""

    def update(self, layer, k, v):
        return super().update(layer, _reference_fp8(k), _reference_fp8(v))


def test_fp8_round_trip_equals_the_reference_math_exactly():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 16) * torch.logspace(-3, 3, 16)  # (N, KV, d): a wide range per vector
    x[0, 0] = 0.0  # an all-zero vector keeps scale 0
    q, scale = quantize_kv(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 3)
    assert torch.equal(dequantize_kv(q, scale), _reference_fp8(x))
    assert (q.float().abs().amax(-1)[scale > 0] == 448).all()


def test_the_dense_cache_stores_fp8_and_reads_back_the_round_trip():
    config = get_preset("tiny-llama").replace(n_layers=1)
    cache = KVCache(config, 2, max_length=8, kv_dtype="fp8")
    k = torch.randn(2, config.kv_heads, 5, config.head_dim)  # (B, KV, T, d_head)
    keys, values = cache.update(0, k, -k)
    assert cache.keys[0].dtype == torch.float8_e4m3fn and cache.key_scales[0].shape == (2, config.kv_heads, 8)
    assert torch.equal(keys, _reference_fp8(k)) and torch.equal(values, _reference_fp8(-k))


def _greedy(model, cache, prompt, n):
    tokens, logits = [], prefill(model, torch.tensor([prompt]), cache)
    for _ in range(n):
        tokens.append(int(logits.argmax(-1)))
        logits = decode_one_token(model, torch.tensor(tokens[-1:]), cache)
    return tokens, logits


def test_generating_with_the_fp8_cache_equals_a_cache_holding_the_rounded_keys():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-llama").replace(init_std=0.3, context_length=64)).eval()
    prompt = torch.randint(0, 96, (9,)).tolist()
    with torch.inference_mode():
        fp8, fp8_logits = _greedy(model, KVCache(model.config, 1, kv_dtype="fp8"), prompt, 12)
        ref, ref_logits = _greedy(model, RoundTripCache(model.config, 1), prompt, 12)
        _, fp32_logits = _greedy(model, KVCache(model.config, 1), prompt, 12)
    assert fp8 == ref
    torch.testing.assert_close(fp8_logits, ref_logits)
    assert not torch.allclose(fp8_logits, fp32_logits, atol=1e-4)  # the cache does round
    config = GenerationConfig(max_new_tokens=12, eos_ids=(), kv_dtype="fp8")
    assert generate(model, prompt, config).generated_ids == fp8


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
def test_the_dense_cache_stores_each_format(kv_dtype):
    model = Transformer(get_preset("tiny-llama").replace(n_layers=1)).eval()
    cache = KVCache(model.config, 1, kv_dtype=kv_dtype)
    with torch.inference_mode():
        prefill(model, torch.tensor([[1, 2, 3]]), cache)
    assert cache.keys[0].dtype == {"bf16": torch.bfloat16, "int8": torch.int8,
                                   "fp8": torch.float8_e4m3fn}[kv_dtype]


def test_bytes_and_a_bad_format():
    assert bytes_per_vector("fp8", 64) == bytes_per_vector("int8", 64) == 64 + 4
    assert bytes_per_vector("fp32", 64) == 4 * 64
    for make in (lambda: KVCache(get_preset("tiny-llama"), 1, kv_dtype="fp4"),
                 lambda: GenerationConfig(kv_dtype="fp4")):
        with pytest.raises(ValueError, match="^kv_dtype: choose one of .*'fp4'$"):
            make()


def test_a_converted_model_decodes_an_fp8_cache_on_the_module_path(kernels):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-llama").replace(init_std=0.3, context_length=64)).eval()
    quantize_model(model, "int8")
    prompt = torch.randint(0, 96, (9,)).tolist()
    with torch.inference_mode():
        assert model.fused_step() is not None  # it reads float32 keys: the fp8 cache refuses it
        module_path = model.with_products(lambda layer: layer)  # a view with no fused step
        ref, _ = _greedy(module_path, RoundTripCache(model.config, 1), prompt, 12)
    config = GenerationConfig(max_new_tokens=12, eos_ids=(), kv_dtype="fp8")
    assert generate(model, prompt, config).generated_ids == ref
