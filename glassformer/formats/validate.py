"""Checks on weights as they are loaded: every value finite, every magnitude plausible.

A min and a max per tensor (no copy): NaN propagates to both and ±Inf shows at one of them.
A non-finite value refuses the file, naming the tensor; a magnitude far beyond what such a
tensor holds in trained models (embeddings and matrices stay within tens; the limits are a
hundred times that) is a warning, since it may be deliberate. Norm gains get no such warning:
trained ones reach past a thousand in some families (Gemma 3's post-feed-forward norms), and
a warning users learn to ignore hides the one that matters.
What is written (an export, a merged adapter) is checked again for finite values only.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..errors import InputError

LIMITS = {"norm": math.inf, "embedding": 1e3, "bias": 1e4, "matrix": 1e3}
_NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)


class WeightWarning(UserWarning):
    """A weight far outside what trained models hold."""


def kind(name: str) -> str:
    """The kind of tensor a parameter name (ours, GGUF's or Hugging Face's) describes."""
    if "norm" in name or ".ln_" in name or name.startswith("ln_"):
        return "norm"
    if "emb" in name or name.endswith(("wte.weight", "wpe.weight")):
        return "embedding"
    return "bias" if name.endswith(".bias") else "matrix"


def check_tensor(tensor: torch.Tensor, name: str, where: str) -> None:
    """Refuse a non-finite value in `tensor`; warn about an absurd magnitude."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = _extremes(tensor.detach())
    if not (math.isfinite(low) and math.isfinite(high)):
        _refuse(tensor, name, where)
    peak, limit = max(-low, high), LIMITS[kind(name)]
    if peak > limit:
        warnings.warn(f"{where}: tensor {name} reaches {peak:.3g}, above {limit:g}: far more than a "
                      f"trained {kind(name)} holds", WeightWarning, stacklevel=2)


def check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """Refuse a non-finite value in `tensor` (weights about to be written or merged)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor.detach()).all()):
        _refuse(tensor, name, where)


def _refuse(tensor: torch.Tensor, name: str, where: str) -> None:
    bad = int((~torch.isfinite(tensor.detach())).sum())
    raise InputError(where, f"tensor {name} holds {bad} non-finite value(s) (NaN or Inf)")


def _extremes(tensor: torch.Tensor) -> tuple[float, float]:
    """(min, max), NaN if any value is NaN. numpy on CPU: one thread, no waiting for a
    second one on a busy machine (torch's aminmax took 10x longer there)."""
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS:
        values = tensor.numpy()
        return float(values.min()), float(values.max())
    return tuple(float(v) for v in torch.aminmax(tensor))


def check_model(model: torch.nn.Module, where: str, parameters: bool = True) -> None:
    """Every parameter and floating-point buffer (RoPE tables, block scales) of a loaded model."""
    for name, tensor in model.named_parameters() if parameters else ():
        check_tensor(tensor, name, where)
    for name, tensor in model.named_buffers():
        check_tensor(tensor, name, where)


def check_model_finite(model: torch.nn.Module, where: str) -> None:
    """Every tensor of a model about to be written (or just merged): finite, or refused by name."""
    for name, tensor in model.state_dict().items():
        check_finite(tensor, name, where)

