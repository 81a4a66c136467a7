"""Inference weights: every linear layer of a model swapped for a fast QuantizedLinear.

`none` keeps float32 weights but multiplies them with the decode kernels of
`glassformer.kernels`; `bf16`, `int8` (per-block scales) and `int4` (per-block scale and
minimum) store the weights smaller, so a decode step, which reads every weight once, reads
fewer bytes. Embeddings stay in float32: a step reads only one of their rows.
"""

from __future__ import annotations

from torch import nn

from ..model.transformer import Transformer
from .quantized_linear import QuantizedLinear

QUANTIZE_MODES = ("none", "bf16", "int8", "int4")
_KERNEL_MODE = {"none": "fp32", "bf16": "bf16", "int8": "int8", "int4": "int4"}


def linear_layers(model: Transformer) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every weight matrix a forward pass multiplies by."""
    places: list[tuple[nn.Module, str]] = []
    for block in model.blocks:
        places += [(block.attn, "qkv"), (block.attn, "out"), (block.mlp, "up"), (block.mlp, "down")]
    return places + [(model, "lm_head")]


def quantize_model(model: Transformer, mode: str) -> Transformer:
    """Convert `model`'s nn.Linear layers in place for inference (no training afterwards) and
    return it; layers converted before (e.g. kept in GGUF blocks) stay as they are."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize: unknown mode {mode!r}; choose one of {QUANTIZE_MODES}")
    model.eval().requires_grad_(False)
    for parent, name in linear_layers(model):
        layer = getattr(parent, name)
        if isinstance(layer, nn.Linear):
            setattr(parent, name, QuantizedLinear.from_linear(layer, _KERNEL_MODE[mode]))
    return model
