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
