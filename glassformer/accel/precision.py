"""How inference computes on its device: the weights' number format and the precision of
float32 products, decided in one place (`choose_precision`, asked by generate, chat and serve),
and the process's settings for it (`use_precision`, called once at a command's start).

    device   --quantize    --deterministic   weights                       float32 products
    cpu      not given     either            float32 (the fast kernels;    full float32
                                             plain modules with --compile)
    cuda     not given     no                bfloat16, plain modules       TF32
    cuda     not given     yes               bfloat16, plain modules       full float32, deterministic
    any      given         either            the given format              as the row above says

On the CPU nothing here changes a number: the engine is batch invariant there already. On CUDA,
--deterministic turns on PyTorch's deterministic algorithms (an operation without one refuses
to run), gives cuBLAS a fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts, so
before the first product) and turns TF32 off; the serving engine's part (fixed shapes, one
attention call per request) is EngineConfig.deterministic's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's fixed workspace setting for reproducible products


@dataclass(frozen=True)
class Precision:
    device_type: str  # "cpu", "cuda", "mps"
    quantize: str | None  # what load(quantize=...) gets: None keeps plain nn.Linear modules
    dtype: torch.dtype  # the plain modules' weights
    tf32: bool  # float32 products may round their inputs to TF32 (CUDA)
    deterministic: bool  # deterministic algorithms, a fixed cuBLAS workspace, no TF32 (CUDA)

    def place(self, model: nn.Module, device: str | torch.device) -> nn.Module:
        """`model` moved to `device`, its plain weights cast to `dtype` where that is not
        float32 (a converted model's formats are kept as they are)."""
        if self.dtype == torch.float32:
            return model.to(device)
        return model.to(device=device, dtype=self.dtype)

    def describe(self) -> str:
        """One line naming the choice."""
        weights = (f"{self.quantize} weights" if self.quantize not in (None, "none")
                   else f"{str(self.dtype).removeprefix('torch.')} weights")
        products = "TF32 float32 products" if self.tf32 else "full float32 products"
        extra = ", deterministic algorithms" if self.deterministic and self.device_type == "cuda" else ""
        return f"{self.device_type}: {weights}, {products}{extra}"


def choose_precision(device_type: str, quantize: str | None = None, compile: bool = False,
                     deterministic: bool = False) -> Precision:
    """The weights and products for a device of type `device_type`, where the user chose
    `quantize` (None: not chosen) and maybe --compile (plain modules) and --deterministic."""
    cuda = device_type == "cuda"
    dtype = torch.float32
    if quantize is not None:
        chosen = quantize
    elif cuda:
        chosen, dtype = None, torch.bfloat16
    else:
        chosen = None if compile else "none"
    return Precision(device_type, chosen, dtype, tf32=cuda and not deterministic,
                     deterministic=deterministic)


def use_precision(precision: Precision) -> None:
    """Set this process's CUDA settings for `precision` (before its first CUDA product); on
    other devices nothing. A command calls it once at its start: the settings are the process's."""
    if precision.device_type != "cuda":
        return
    if precision.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cuda.matmul.allow_tf32 = precision.tf32
    torch.backends.cudnn.allow_tf32 = precision.tf32
