"""Which keys each query may see: causal, sliding window, padding, documents, plus a distance bias (ALiBi's
slopes, or T5's learned relative position bias).

The mask is described by positions rather than stored as a T×T matrix, so a tiled kernel can
build just the tile it needs, and a decode step needs no mask at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .positions import alibi_bias


@dataclass(frozen=True)
class AttentionMask:
    q_pos: torch.Tensor  # (B, Tq) absolute positions of the queries
    k_pos: torch.Tensor  # (B, Tk) absolute positions of the keys
    causal: bool = True
    window: int | None = None  # a key is visible while q - k < window
    k_valid: torch.Tensor | None = None  # (B, Tk) False for padding
    alibi_slopes: torch.Tensor | None = None  # (H,)
    contiguous: bool = False  # keys are 0..Tk-1 and the queries the last Tq of them
    position_bias: torch.Tensor | None = None  # (B or 1, H, Tq, Tk) added to the scores (T5)
    documents: torch.Tensor | None = None  # (B, T) document index of each token, queries = keys:
    # packed sequences see only their own document (a block-diagonal mask)

    @property
    def is_plain(self) -> bool:
        """Only causality (or nothing) restricts attention, on contiguous positions."""
        return (
            self.contiguous
            and self.window is None
            and self.k_valid is None
            and self.alibi_slopes is None
            and self.position_bias is None
            and self.documents is None
        )

    def narrowed(self, window: int) -> AttentionMask:
        """The same mask with keys at most `window - 1` behind each query (a layer's own
        window, Gemma 2's sliding layers), within any window it had."""
        own = window if self.window is None else min(self.window, window)
        return dataclasses.replace(self, window=own)

    # The row and column ranges default to None, meaning all: a slice as a default value is a
    # constant that torch.compile (PyTorch 2.11) cannot trace.
    def allowed(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """True where query row may attend to key column: (B, 1, tq, tk)."""
        rows, cols = _whole(rows), _whole(cols)
        q = self.q_pos[:, rows, None]  # (B, tq, 1)
        k = self.k_pos[:, None, cols]  # (B, 1, tk)
        ok = torch.ones(q.shape[0], q.shape[1], k.shape[2], dtype=torch.bool, device=q.device)
        if self.causal:
            ok = ok & (k <= q)
        if self.window is not None:
            ok = ok & (q - k < self.window)
        if self.k_valid is not None:
            ok = ok & self.k_valid[:, None, cols]
        if self.documents is not None:
            ok = ok & (self.documents[:, rows, None] == self.documents[:, None, cols])
        return ok[:, None]

    def bias(
        self, dtype: torch.dtype, rows: slice | None = None, cols: slice | None = None
    ) -> torch.Tensor:
        """The additive mask M: 0 where allowed, -inf elsewhere, plus ALiBi or the relative
        position bias: (B, 1 or H, tq, tk).

        A query that may see no key at all (a padding position) is given every key instead, so
        softmax stays finite; `empty_rows` marks those rows so kernels can zero their output.
        """
        rows, cols = _whole(rows), _whole(cols)
        ok = self.allowed(rows, cols)
        if self.k_valid is not None:
            ok = ok | self.empty_rows(rows)
        zero = torch.zeros((), dtype=dtype, device=ok.device)
        bias = torch.where(ok, zero, torch.tensor(float("-inf"), dtype=dtype, device=ok.device))
        if self.alibi_slopes is not None:
            bias = bias + alibi_bias(
                self.alibi_slopes, self.q_pos[:, rows], self.k_pos[:, cols]
            ).to(dtype)
        if self.position_bias is not None:
            bias = bias + self.position_bias[:, :, rows, cols].to(dtype)
        return bias

    def empty_rows(self, rows: slice | None = None) -> torch.Tensor:
        """True for queries that may attend to no key: (B, 1, tq, 1)."""
        return ~self.allowed(rows).any(dim=-1, keepdim=True)


def _whole(part: slice | None) -> slice:
    """`part`, or every index where it is None."""
    return slice(None) if part is None else part
