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
`CAPABILITIES` says, field by field of the config, what the fused passes compute: each pass
checks its own calls, so every value is taken today; a config it refuses keeps its modules.
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
from . import kernels
from .attention import attention
from .capabilities import CapabilityTable, any_value
from .fused import FusedGELU, FusedLayerNorm, FusedRMSNorm, FusedRotary, FusedSwiGLU
from .onednn import OneDNNLinear, onednn_pays

_PER_CALL = "each fused pass takes only the calls it computes, the plain module the rest"
_MODULES = "the model's own modules, unconverted"
_SIZES = "any shape: the passes read it from their tensors"

# What the fused passes compute, field by field; the passes themselves check each call
# (attention.py: a plain causal or full mask, no dropout: padding, a window or packed
# documents go to sdpa, which builds them from AttentionMask; fused.py: float32 CPU tensors that
# need a gradient), so a value outside a pass's reach keeps the plain expression.
CAPABILITIES = CapabilityTable("fused training passes", {
    "vocab_size": any_value(_SIZES), "context_length": any_value(_SIZES),
    "d_model": any_value(_SIZES), "n_layers": any_value(_SIZES), "n_heads": any_value(_SIZES),
    "n_kv_heads": any_value(_SIZES), "d_head": any_value(_SIZES), "d_ff": any_value(_SIZES),
    "position": any_value("RoPE fused; ALiBi and T5's bias make a mask the C++ attention leaves "
                          "to sdpa"),
    "rope_theta": any_value("the angles come from the model"),
    "rope_scaling": any_value("the angles come from the model"),
    "rope_factor": any_value("the angles come from the model"),
    "rope_original_context": any_value("the angles come from the model"),
    "rope_low_freq_factor": any_value("the angles come from the model"),
    "rope_high_freq_factor": any_value("the angles come from the model"),
    "rope_local_theta": any_value("the angles come from the model, each layer its kind's"),
    **{name: any_value("the angles come from the model") for name in (
        "rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_attention_factor",
        "rope_short_factors", "rope_long_factors")},
    "rotary_dim": any_value("the RoPE pass turns whole heads; a partial turn keeps the plain "
                            "expression"),
    "norm": any_value("RMSNorm and LayerNorm passes"), "norm_placement": any_value(_MODULES),
    "qk_norm": any_value("query/key norms stay the model's own modules"),
    "parallel_block": any_value(_MODULES),
    "norm_eps": any_value(), "norm_bias": any_value("LayerNorm with or without its bias"),
    "activation": any_value("silu (gated) and gelu passes; " + _PER_CALL),
    "gated": any_value(_PER_CALL), "attn_bias": any_value(_MODULES),
    "attn_out_bias": any_value(_MODULES), "mlp_bias": any_value(_MODULES),
    "lm_head_bias": any_value(_MODULES), "final_norm": any_value(_MODULES),
    "tie_embeddings": any_value("the new modules hold the same parameters"),
    "causal": any_value("causal or full masks"), "sliding_window": any_value(_PER_CALL),
    "dropout": any_value(_PER_CALL),
    "attention_kernel": any_value("only sdpa's attention is swapped, for the same function"),
    "init_std": any_value(), "n_token_types": any_value(_MODULES),
    "embed_norm": any_value("a norm like the others"), "head": any_value(_MODULES),
    "pooler": any_value(_MODULES), "n_encoder_layers": any_value("cross-attention stays as is"),
    "decoder_start_id": any_value(), "relative_buckets": any_value(_MODULES),
    "relative_max_distance": any_value(_MODULES),
    "scale_scores": any_value("the attention pass takes the scale"),
    "scale_head_input": any_value(_MODULES),
    "norm_weight_offset": any_value("an RMSNorm with an offset keeps its module"),
    "embed_scale": any_value(_MODULES), "final_softcap": any_value(_MODULES),
    "attn_softcap": any_value("soft-capped attention runs the reference kernel, unconverted"),
    "attn_scale": any_value("the attention pass takes the scale"),
    "layer_windows": any_value(_PER_CALL),
})


def use_fast_training(model: Transformer) -> Transformer:
    """Convert `model` (float32 on the CPU, a config the passes compute; otherwise it is
    returned as it is) and return it."""
    weight = model.embed.tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return model  # the kernels are for float32 CPU tensors: no build for nothing
    if CAPABILITIES.why_not(model.config) is not None:
        return model
    fused = kernels.available()
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
    if fused and type(module) is RMSNorm and not module.offset:
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
    if plain or not grads or not kernels.available():
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    return kernels.clip_grad_norm(grads, max_norm)
