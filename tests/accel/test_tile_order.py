"""Tile order (tile_order.py): the block tensors of each tile of 16 rows interleaved unit by
unit, held by layers where the kernels read it, while everything that reads the blocks
themselves sees block order.

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
from glassformer.accel.quantized_embedding import QuantizedEmbedding
from glassformer.accel.tile_order import TILE, from_tile_order, rows_in_block_order, to_tile_order


def tile_order_by_loops(rows: list[list[int]], unit: int) -> list[list[int]]:
    """Each tile's rows, unit by unit: for each unit index, every row of the tile."""
    flat = []
    for first in range(0, len(rows), TILE):
        tile = rows[first : first + TILE]
        for j in range(0, len(rows[0]), unit):
            for row in tile:
                flat += row[j : j + unit]
    width = len(rows[0])
    return [flat[i : i + width] for i in range(0, len(flat), width)]


@pytest.mark.parametrize("unit", (4, 1))
@pytest.mark.parametrize("n_rows", (1, 5, 16, 17, 33, 48))
def test_tile_order_is_its_definition_and_inverts(n_rows, unit):
    gen = torch.Generator().manual_seed(n_rows)
    q = torch.randint(0, 256, (n_rows, 18 * 4), generator=gen, dtype=torch.uint8)
    tiled = to_tile_order(q, unit)
    assert tiled.tolist() == tile_order_by_loops(q.tolist(), unit)
    assert torch.equal(from_tile_order(tiled, unit), q)
    ids = torch.tensor([n_rows - 1, 0, n_rows // 2, n_rows - 1])
    assert torch.equal(rows_in_block_order(tiled, ids, unit), q[ids])


def _layer(fmt: str, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    blocks = quant.quantize_int8(w) if fmt == "int8" else quant.quantize_int4(w)
    return QuantizedLinear.from_weight(w, fmt, torch.randn(n, generator=gen)), blocks


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_layers_hold_the_kernels_order_and_show_block_order(fmt):
    layer, blocks = _layer(fmt, 20, 600, seed=1)  # a tile and 4 rows; 19 blocks a row
    assert layer.tiled == kernels.available()
    for held, expected, unit in zip((layer.qweight, layer.scales), blocks, (4, 1), strict=False):
        # the only copy of the blocks, in the kernels' order
        assert torch.equal(held, to_tile_order(expected, unit) if layer.tiled else expected)
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
def test_torch_path_reads_a_tiled_layer_as_block_order(fmt):
    layer, blocks = _layer(fmt, 9, 700, seed=4)
    x = torch.randn(3, 700)
    product = ops.linear_int8 if fmt == "int8" else ops.linear_int4
    with torch.no_grad():
        expected = product(x, *blocks, layer.bias, backend="torch")
        held = [layer.qweight, layer.scales] + ([layer.mins] if fmt == "int4" else [])  # as held
        got = product(x, *held, layer.bias, backend="torch", tiled=layer.tiled)
    assert torch.equal(got, expected)
    weight = quant.dequantize_int8(*blocks, 700) if fmt == "int8" else quant.dequantize_int4(*blocks, 700)
    x.requires_grad_(True)  # the straight-through path dequantizes
    y = layer(x)
    torch.testing.assert_close(y, x @ weight.T + layer.bias)


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_an_embedding_sharing_a_tiled_table_looks_up_block_order_rows(fmt):
    layer, blocks = _layer(fmt, 30, 96, seed=5)
    table = QuantizedEmbedding(layer)
    assert table.qweight.data_ptr() == layer.qweight.data_ptr()  # shared, not copied
    dequantize = quant.dequantize_int8 if fmt == "int8" else quant.dequantize_int4
    ids = torch.tensor([[3, 0, 29], [7, 7, 1]])
    assert torch.equal(table(ids), dequantize(*blocks, 96)[ids])
    assert torch.equal(table.state_dict()["qweight"], blocks[0])
