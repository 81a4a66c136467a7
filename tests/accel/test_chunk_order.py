"""Chunk order (chunk_order.py): a permutation of each row's bytes that layers hold where the
kernels read it, while everything that reads the blocks themselves sees block order.

The oracle for the order is its definition written as loops; for layers, the block-order
tensors `weight_formats` makes and their dequantized product.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from glassformer.accel import QuantizedLinear, kernels, ops
from glassformer.accel import weight_formats as quant
from glassformer.accel.chunk_order import CHUNK, from_chunk_order, to_chunk_order
from glassformer.accel.quantized_embedding import QuantizedEmbedding

BLOCK_COUNTS = (1, 2, 3, 4, 5, 15, 16, 17, 18, 20, 21, 33, 48)


def chunk_order_by_loops(row: list[int], n_blocks: int, block_bytes: int) -> list[int]:
    tail = n_blocks % CHUNK if (n_blocks % CHUNK) * block_bytes <= 64 else 0
    body, out = n_blocks - tail, []
    for b0 in range(0, body, CHUNK):
        length = min(CHUNK, body - b0)
        for t in range(block_bytes // 4):
            for j in range(length):
                start = (b0 + j) * block_bytes + 4 * t
                out += row[start : start + 4]
    return out + row[body * block_bytes :]


@pytest.mark.parametrize("block_bytes", (16, 32))
@pytest.mark.parametrize("n_blocks", BLOCK_COUNTS)
def test_chunk_order_is_its_definition_and_inverts(n_blocks, block_bytes):
    gen = torch.Generator().manual_seed(n_blocks)
    q = torch.randint(0, 256, (3, n_blocks * block_bytes), generator=gen, dtype=torch.uint8)
    chunked = to_chunk_order(q, n_blocks)
    for row, got in zip(q.tolist(), chunked.tolist(), strict=True):
        assert got == chunk_order_by_loops(row, n_blocks, block_bytes)
    assert torch.equal(from_chunk_order(chunked, n_blocks), q)


def _layer(fmt: str, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    blocks = quant.quantize_int8(w) if fmt == "int8" else quant.quantize_int4(w)
    return QuantizedLinear.from_weight(w, fmt, torch.randn(n, generator=gen)), blocks


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_layers_hold_the_kernels_order_and_show_block_order(fmt):
    layer, blocks = _layer(fmt, 12, 600, seed=1)  # 19 blocks: a chunk and a longer rest
    assert layer.chunked == (kernels.available() and kernels.chunk_order())
    nb = blocks[1].shape[1]
    held = to_chunk_order(blocks[0], nb) if layer.chunked else blocks[0]
    assert torch.equal(layer.qweight, held)  # the only copy of the bytes, in the kernels' order
    for got, expected in zip(layer.blocks(), blocks, strict=True):
        assert torch.equal(got, expected)
    state = layer.state_dict()
    assert torch.equal(state["qweight"], blocks[0])
    dequantize = quant.dequantize_int8 if fmt == "int8" else quant.dequantize_int4
    assert torch.equal(layer.dequantized_weight(), dequantize(*blocks, 600))


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_state_dict_and_safetensors_round_trip(fmt):
    layer, _ = _layer(fmt, 10, 200, seed=2)
    other, _ = _layer(fmt, 10, 200, seed=3)
    x = torch.randn(5, 200)
    with torch.no_grad():
        expected = layer(x)
        other(x)  # resolves its fast path before the load
        other.load_state_dict(load_safetensors(save_safetensors(layer.state_dict())))
        assert torch.equal(other.qweight, layer.qweight)
        assert torch.equal(other(x), expected)
        tensors = {name: t for name, t in layer.state_dict().items() if name != "bias"}
        rebuilt = QuantizedLinear(200, 10, fmt, tensors, layer.bias)
        assert torch.equal(rebuilt(x), expected)


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_torch_path_reads_a_chunked_layer_as_block_order(fmt):
    layer, blocks = _layer(fmt, 9, 700, seed=4)
    x = torch.randn(3, 700)
    product = ops.linear_int8 if fmt == "int8" else ops.linear_int4
    with torch.no_grad():
        expected = product(x, *blocks, layer.bias, backend="torch")
        got = product(x, layer.qweight, *blocks[1:], layer.bias, backend="torch",
                      chunked=layer.chunked)
    assert torch.equal(got, expected)
    weight = quant.dequantize_int8(*blocks, 700) if fmt == "int8" else quant.dequantize_int4(*blocks, 700)
    x.requires_grad_(True)  # the straight-through path dequantizes
    y = layer(x)
    torch.testing.assert_close(y, x @ weight.T + layer.bias)


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_an_embedding_sharing_a_chunked_table_looks_up_block_order_rows(fmt):
    layer, blocks = _layer(fmt, 30, 96, seed=5)
    table = QuantizedEmbedding(layer)
    assert table.qweight.data_ptr() == layer.qweight.data_ptr()  # shared, not copied
    dequantize = quant.dequantize_int8 if fmt == "int8" else quant.dequantize_int4
    ids = torch.tensor([[3, 0, 29], [7, 7, 1]])
    assert torch.equal(table(ids), dequantize(*blocks, 96)[ids])
    assert torch.equal(table.state_dict()["qweight"], blocks[0])
