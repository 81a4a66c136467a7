"""`use_fast_training(model)`: a model's training passes through the fused C++ kernels and
oneDNN's products, as an explicit conversion the training loop applies.

The layers in `glassformer.model.layers` are plain PyTorch and stay the reference. This swaps,
in place, each RMSNorm, LayerNorm, rotary application, gated-silu and GELU activation for
its fused twin (fused.py), and each attention on PyTorch's fused kernel for the C++ one
(attention.py), where the C++ kernels are available; and each nn.Linear for a OneDNNLinear
where oneDNN beats MKL on this CPU (onednn.py). The new modules hold the same parameters, so the
state dict, an optimizer built before or after, and tied weights are unchanged; each still
takes the plain expression for any call it does not apply to (no gradient, other dtypes or
devices). The C++ build, when one is due, happens here, with its one-line notice.
`clip_grad_norm_` is the step's gradient clipping in one C++ call.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.layers.attention import Attention
from ..model.layers.attention_backends import sdpa_attention
from ..model.layers.feedforward import Activation
from ..model.layers.norm import LayerNorm, RMSNorm
from ..model.layers.positions import Rotary
from ..model.transformer import Transformer
from .attention import attention
from .build import extension
from .fused import FusedGELU, FusedLayerNorm, FusedRMSNorm, FusedRotary, FusedSwiGLU
from .onednn import OneDNNLinear, onednn_pays


def use_fast_training(model: Transformer) -> Transformer:
    """Convert `model` (float32 on the CPU; otherwise it is returned as it is) and return it."""
    weight = model.embed.tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return model  # the kernels are for float32 CPU tensors: no build for nothing
    fused = extension() is not None
    for module in model.modules():
        if fused and type(module) is Attention and module.kernel is sdpa_attention:
            module.kernel = attention  # takes the calls it applies to, sdpa the others
    for name, module in list(model.named_modules()):
        replacement = _fast_twin(module, fused, onednn_pays())
        if replacement is not None:
            model.set_submodule(name, replacement)
    return model


def _fast_twin(module: nn.Module, fused: bool, onednn: bool) -> nn.Module | None:
    """The replacement for one module, sharing its parameters; None to keep it."""
    if fused and type(module) is RMSNorm:
        twin = FusedRMSNorm(module.weight.shape[0], module.eps)
        twin.weight = module.weight
        return twin
    if fused and type(module) is LayerNorm:
        twin = FusedLayerNorm(module.weight.shape[0], module.eps, module.bias is not None)
        twin.weight, twin.bias = module.weight, module.bias
        return twin
    if fused and type(module) is Rotary:
        return FusedRotary()
    if fused and type(module) is Activation and module.name == "silu" and module.gated:
        return FusedSwiGLU()
    if fused and type(module) is Activation and module.name == "gelu" and not module.gated:
        return FusedGELU()
    if onednn and type(module) is nn.Linear:
        return OneDNNLinear.sharing(module)
    return None


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (foreach): every gradient scaled by
    min(1, max_norm / (total norm + 1e-6)); returns the total norm. One C++ call where the
    gradients are contiguous float32 CPU tensors and the kernels are built (PyTorch's foreach
    path takes a norm and a multiplication per tensor there); PyTorch's otherwise."""
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    plain = any(g.device.type != "cpu" or g.dtype != torch.float32 or g.is_sparse
                or not g.is_contiguous() for g in grads)
    if plain or not grads or extension() is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    return extension().clip_grad_norm(grads, max_norm)
