"""The order in which the C++ kernels read int8 / int4 weights, scales and minimums.

Block order (GGUF's, weight_formats.py) keeps each row's blocks of 32 weights together. The
kernels (csrc/quantized.cpp) compute TILE output rows at once, one per 32-bit lane (AVX2: two
halves of 8), so
in tile order a tile's rows are interleaved unit by unit: for each of a row's units (a dword of
`qweight`, a block's scale or minimum), the tile's rows side by side. One plain load then
gives every lane its row's next 4 bytes (or its block's scale), with no regrouping per call. A
last tile of R < TILE rows is interleaved the same way, R rows a unit. A tensor in tile order
keeps its shape (N, C) and its bytes; only the order of the values within each tile changes.

A layer multiplied by the kernels holds its blocks so (made once,
when the layer is built or loaded) and writes block order to its state dict (`TileOrdered`):
checkpoints are the same on every CPU.
"""

from __future__ import annotations

import torch
from torch import nn

TILE = 16  # rows a tile: one per 32-bit lane of a 512-bit register (two 256-bit ones)
BLOCK_TENSORS = {"qweight": 4, "scales": 1, "mins": 1}  # each one's unit: bytes or values


def to_tile_order(t: torch.Tensor, unit: int) -> torch.Tensor:
    """(N, C) rows of C / unit units in block order -> a new (N, C) tensor in tile order."""
    return _reorder(t, unit, to_tiles=True)


def from_tile_order(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The inverse of `to_tile_order`: a new tensor in block order."""
    return _reorder(t, unit, to_tiles=False)


def _reorder(t: torch.Tensor, unit: int, to_tiles: bool, rows: int = 64 * TILE) -> torch.Tensor:
    """`rows` at a time (whole tiles), so that no temporary as large as t is made."""
    N, C = t.shape
    out = torch.empty_like(t)  # (N, C)
    whole = N // TILE * TILE
    spans = [(start, min(start + rows, whole)) for start in range(0, whole, rows)]
    for start, end in spans + [(whole, N)]:  # the whole tiles, then a last shorter one
        R = min(TILE, end - start)
        if R:
            shape = (-1, R, C // unit, unit) if to_tiles else (-1, C // unit, R, unit)
            out[start:end] = t[start:end].reshape(shape).transpose(1, 2).reshape(end - start, C)
    return out


def rows_in_block_order(t: torch.Tensor, ids: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows `ids` (M,) of a tensor (N, C) held in tile order, in block order: (M, C)."""
    N, C = t.shape
    first = ids // TILE * TILE  # (M,) each row's tile
    R = (N - first).clamp(max=TILE)  # (M,) its tile's rows
    units = torch.arange(C // unit, device=t.device)  # (C / unit,)
    at = first[:, None] * C + (units[None] * R[:, None] + (ids - first)[:, None]) * unit  # (M, C / unit)
    index = at[:, :, None] + torch.arange(unit, device=t.device)  # (M, C / unit, unit)
    return t.reshape(-1)[index.reshape(len(ids), C)]


def in_order(tiles: bool, tiled: bool, **tensors: torch.Tensor) -> list[torch.Tensor]:
    """A layer's block tensors (qweight, scales[, mins]) held in tile order or not (`tiled`), in
    tile order or not (`tiles`): as held, or moved (a copy) to the other order."""
    if tiles == tiled:
        return list(tensors.values())
    move = to_tile_order if tiles else from_tile_order
    return [move(t, BLOCK_TENSORS[name]) for name, t in tensors.items()]


class TileOrdered(nn.Module):
    """A module with int8 / int4 `qweight`, `scales` (and `mins`) buffers that holds them in tile
    order where `tiled` is set, and reads and writes its state dict in block order."""

    tiled = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:
            for name, unit in BLOCK_TENSORS.items():
                if prefix + name in destination:
                    destination[prefix + name] = from_tile_order(getattr(self, name), unit)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        errors = args[-1]
        before = len(errors)
        super()._load_from_state_dict(state_dict, prefix, *args)
        if self.tiled and len(errors) == before:
            for name, unit in BLOCK_TENSORS.items():
                if prefix + name in state_dict:
                    setattr(self, name, to_tile_order(getattr(self, name), unit))
