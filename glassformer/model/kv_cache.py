"""The KV cache: keys and values of past positions, kept so each new token costs one query.

Attention reaches its cache through one small interface, `AttentionCache.attend`: it hands
over the new rows' queries, keys and values and its own attention function, and the cache
stores the keys and values where it keeps them and calls that function over what each query
may see. Two caches implement it:
- `KVCache` (here): dense, preallocated per layer as (B, n_kv_heads, S_max, d_head) and
  written by position, so shapes stay static; one call over every row;
- the serving engine's paged view of its pool (serving/paged_attention.py): block tables,
  slots, and one call per request (or one for all decoding rows).
The cache holds n_kv_heads, not n_heads: grouped-query attention shrinks it. Given a
`kv_dtype` (kv_formats.py: fp32, bf16, int8, fp8), the dense cache stores keys and values in
that format, as the pool does, and attention reads them back (new rows included) in the
queries' dtype; without one it stores them as they come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..errors import InputError
from .config import ModelConfig
from .kv_formats import KV_DTYPES, check_kv_dtype, dequantize_kv, is_scaled, quantize_kv
from .layers.masking import AttentionMask

# An attention module's own math: context (B, H, Tq, d_head) from q (B, H, Tq, d_head),
# k and v (B, KV, Tk, d_head) and the mask between them.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]


class AttentionCache(Protocol):
    # True where the cache places keys at positions of its own (the sink policy, sink.py): the
    # layer then hands it unrotated keys, and a fused step writing keys by position must not
    # serve it.
    rotates_keys: bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: AttentionMask | None, attention: AttentionFn) -> torch.Tensor:
        """Store the new keys and values k, v (B, KV, T, d_head) of `layer`, and return
        `attention` of the queries q (B, H, T, d_head) over every key each may see:
        (B, H, T, d_head). `mask` is the model's mask over the dense cache's positions; a
        cache that keeps its own positions (the engine's) builds its own."""
        ...


class KVCache:
    rotates_keys = False

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_length: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        self.max_length = max_length or config.context_length
        if self.max_length > config.context_length:
            raise InputError("max_length",
                f"{self.max_length} exceeds context_length={config.context_length}"
            )
        self.batch_size = batch_size
        self.shape = (batch_size, config.kv_heads, self.max_length, config.head_dim)
        self.n_layers = config.n_layers
        if kv_dtype is not None:
            check_kv_dtype(kv_dtype)
            dtype = KV_DTYPES[kv_dtype]
        self.kv_dtype = kv_dtype
        self.device, self.dtype = device, dtype  # None: taken from the first keys written
        self.keys: list[torch.Tensor | None] = [None] * config.n_layers
        self.values: list[torch.Tensor | None] = [None] * config.n_layers
        # int8 / fp8: one float32 scale per position and head, (B, KV, S_max) per layer
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        self.positions = torch.zeros(batch_size, self.max_length, dtype=torch.long)  # (B, S_max)
        self.valid = torch.ones(batch_size, self.max_length, dtype=torch.bool)  # (B, S_max)
        self.padded = False  # whether any stored position is padding
        # An encoder-decoder's cross-attention keys and values per decoder layer, each
        # (B, KV, S, d_head): the encoder's output projected once, at the first decode step.
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0  # positions filled so far

    def reserve(self, positions: torch.Tensor, pad_mask: torch.Tensor | None) -> None:
        """Record the positions (B, T) about to be written; raises when they would not fit."""
        T = positions.shape[1]
        if self.length + T > self.max_length:
            raise InputError("context",
                f"{self.length} cached + {T} new tokens exceed the cache's "
                f"{self.max_length} positions"
            )
        if self.positions.device != positions.device:
            self.positions = self.positions.to(positions.device)
            self.valid = self.valid.to(positions.device)
        self.positions[:, self.length : self.length + T] = positions
        if pad_mask is not None:
            self.valid[:, self.length : self.length + T] = pad_mask
            self.padded = True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: AttentionMask | None, attention: AttentionFn) -> torch.Tensor:
        if mask is None:
            raise InputError("mask", "the dense cache attends under the model's mask")
        keys, values = self.update(layer, k, v)  # (B, KV, S, d_head): cached + new rows
        return attention(q, keys, values, mask)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows k, v (B, KV, T, d_head) and return all rows so far (B, KV, S, d_head)."""
        if self.keys[layer] is None:
            self.allocate(k.device, k.dtype)
        end = self.length + k.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        if is_scaled(self.kv_dtype):
            new = slice(self.length, end)
            return (self._write_scaled(keys, self.key_scales[layer], k, new),
                    self._write_scaled(values, self.value_scales[layer], v, new))
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        if self.kv_dtype is not None:  # read in the queries' dtype
            return keys[:, :, :end].to(k.dtype), values[:, :, :end].to(k.dtype)
        return keys[:, :, :end], values[:, :, :end]

    def _write_scaled(self, store: torch.Tensor, scales: torch.Tensor, x: torch.Tensor,
                      new: slice) -> torch.Tensor:
        """Quantize x (B, KV, T, d_head) into store and scales at positions `new`; returns every
        row so far read back, (B, KV, new.stop, d_head) in x's dtype."""
        store[:, :, new], scales[:, :, new] = quantize_kv(x, self.kv_dtype)
        return dequantize_kv(store[:, :, : new.stop], scales[:, :, : new.stop]).to(x.dtype)

    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        """Create the per-layer tensors (unless given at construction, device and dtype are
        those of the first keys written)."""
        device, dtype = self.device or device, self.dtype or dtype
        for layer in range(self.n_layers):
            if self.keys[layer] is None:
                self.keys[layer] = torch.zeros(self.shape, device=device, dtype=dtype)
                self.values[layer] = torch.zeros(self.shape, device=device, dtype=dtype)
        if is_scaled(self.kv_dtype) and not self.key_scales:
            scales = [torch.zeros(self.shape[:3], device=device) for _ in range(2 * self.n_layers)]
            self.key_scales, self.value_scales = scales[: self.n_layers], scales[self.n_layers :]

    def advance(self, n_tokens: int) -> None:
        """Called by the model once every layer has written its n_tokens new rows."""
        self.length += n_tokens

    def query_start(self, n_new: int) -> int:
        """The position of the first of n_new new tokens: right after the cached ones."""
        return self.length

    def key_positions(self, n_new: int) -> torch.Tensor:
        return self.positions[:, : self.length + n_new]  # (B, S)

    def key_valid(self, n_new: int) -> torch.Tensor | None:
        return self.valid[:, : self.length + n_new] if self.padded else None

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (e.g. to rewind a rejected continuation)."""
        if not 0 <= length <= self.length:
            raise InputError("length", f"must be within 0..{self.length}, got {length}")
        self.length = length
        self.valid[:, length:] = True
        self.padded = bool((~self.valid[:, :length]).any())

    def reset(self) -> None:
        self.crop(0)
