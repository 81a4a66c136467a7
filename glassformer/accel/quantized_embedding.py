"""QuantizedEmbedding: a token table held in int8 / int4 or GGUF's blocks, dequantized a row at
a lookup.

A GGUF file's token table is usually Q4_x / Q8_0 like the rest, and a tied head multiplies by
it in those blocks (QuantizedLinear). Dequantizing the whole table for the lookup would hold a
float32 copy of what stays quantized (4 bytes a value instead of about 0.6); this module
shares the head's blocks and dequantizes only the rows of the ids looked up, with the same
math (weight_formats.py, kquants.py), so every row equals the dequantized table's row bit for bit.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from . import ops
from . import weight_formats as quant
from .quantized_linear import BLOCK_NAMES, QuantizedLinear
from .tile_order import BLOCK_TENSORS, TileOrdered, rows_in_block_order
from .weight_formats import GGUF_FORMATS, WeightFormat


class QuantizedEmbedding(TileOrdered):
    """E_token[ids] for a (V, d) table stored as the block buffers of a QuantizedLinear
    with V outputs and d inputs (shared with it, not copied, in the order it holds them)."""

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        if table.mode not in BLOCK_NAMES:
            raise InputError("mode", f"a quantized embedding takes block formats, not {table.mode}")
        self.mode = table.mode
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.tiled = table.tiled
        for name in BLOCK_NAMES[self.mode]:
            self.register_buffer(name, getattr(table, name))

    @property
    def weight(self) -> torch.Tensor:
        """No float table is held: an empty (0, d) float32 tensor on the blocks' device, the
        dtype and device a lookup returns (what callers read `.weight` for);
        `dequantized_weight()` builds the whole table."""
        return torch.empty(0, self.embedding_dim, device=self.qweight.device)  # (0, d)

    def dequantized_weight(self) -> torch.Tensor:
        """The (V, d) float32 table."""
        return self(torch.arange(self.num_embeddings, device=self.qweight.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # (M,)
        if self.tiled:
            rows = [rows_in_block_order(getattr(self, name), flat, BLOCK_TENSORS[name])
                    for name in BLOCK_NAMES[self.mode]]
        else:
            rows = [getattr(self, name)[flat] for name in BLOCK_NAMES[self.mode]]
        if self.mode == WeightFormat.INT8:
            x = quant.dequantize_int8(*rows, self.embedding_dim)  # (M, d)
        elif self.mode in GGUF_FORMATS:
            x = ops.dequantize_gguf(*rows, self.mode, self.embedding_dim)  # (M, d), C++ where built
        else:
            x = quant.dequantize_int4(*rows, self.embedding_dim)  # (M, d)
        return x.reshape(*ids.shape, self.embedding_dim)  # (..., d)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode}"
