"""Each row's argmax, the greedy pick of a decode step: one C++ pass (csrc/greedy.cpp) for
float32 rows on the CPU, `torch.argmax` otherwise; the same indices either way (the first
index of the maximum; a NaN counts as the maximum)."""

from __future__ import annotations

import torch

from . import kernels


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for logits (R, V): (R,) int64."""
    fits = (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0)
    if not (fits and kernels.available()):
        return logits.argmax(dim=-1)
    return kernels.argmax_rows(logits.contiguous())
