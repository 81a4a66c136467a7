"""Inference weights: every linear layer of a model swapped for a fast QuantizedLinear.

`fp32` (spelled "none" on the command line) keeps float32 weights but multiplies them with
the decode kernels; `bf16`, `int8` (per-block scales) and `int4` (per-block scale and
minimum) store the weights smaller, so a decode step, which reads every weight once, reads
fewer bytes. Embeddings stay in float32: a step reads only one of their rows. The converted
model also gets the fused decode step (fast_decode.py), which it owns and rebuilds itself,
where that step's table (fast_decode.CAPABILITIES) takes the config. `CAPABILITIES` is the
quantized products' own table: they multiply whatever matrices a config gives a model.
"""

from __future__ import annotations

from torch import nn
from tqdm import tqdm

from ..errors import InputError
from ..model.transformer import Transformer
from .capabilities import CapabilityTable, any_value
from .fast_decode import FastDecoder
from .quantized_linear import QuantizedLinear
from .weight_formats import GGUF_FORMATS, WeightFormat

# What `load(quantize=...)` and `--quantize` take: a WeightFormat ("none" for fp32), or "gguf":
# a GGUF file's blocks kept as they are (Q8_0 / Q4_x as int8 / int4, the K-quants and Q5_x in
# their own layout), float32 for the rest.
QUANTIZE_CHOICES = ("none", *(f for f in WeightFormat if f != WeightFormat.FP32 and f not in GGUF_FORMATS),
                    "gguf")


_PRODUCTS = "every linear layer is a product x Wᵀ + b, whatever its size or place"
_AROUND = "computed around the products by the model's own modules"

CAPABILITIES = CapabilityTable("quantized linear kernels", {
    **{name: any_value(_PRODUCTS) for name in (
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff",
        "attn_bias", "attn_out_bias", "mlp_bias", "lm_head_bias", "gated", "head", "pooler",
        "n_encoder_layers")},
    "tie_embeddings": any_value("a tied head is quantized, the embedding stays float32"),
    **{name: any_value(_AROUND) for name in (
        "context_length", "position", "rope_theta", "rope_scaling", "rope_factor",
        "rope_original_context", "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
        "rope_beta_slow", "rope_truncate", "rope_attention_factor", "rope_short_factors",
        "rope_long_factors", "rotary_dim",
        "norm", "norm_placement", "qk_norm", "parallel_block", "norm_eps", "norm_bias",
        "activation", "final_norm", "causal", "sliding_window", "dropout", "attention_kernel",
        "init_std", "n_token_types", "embed_norm", "decoder_start_id", "relative_buckets",
        "relative_max_distance", "scale_scores", "scale_head_input", "norm_weight_offset",
        "embed_scale", "attn_softcap", "final_softcap", "attn_scale", "layer_windows",
        "rope_local_theta")},
})


def quantize_format(choice: WeightFormat | str) -> WeightFormat:
    """The format a `quantize` choice gives the layers it converts."""
    if choice == "gguf":
        return WeightFormat.FP32  # the layers not kept in GGUF blocks
    if choice not in (*QUANTIZE_CHOICES, *(f for f in WeightFormat if f not in GGUF_FORMATS)):
        raise InputError("quantize", f"choose one of {', '.join(QUANTIZE_CHOICES)}, got {choice!r}")
    return WeightFormat.parse(choice)


def quantize_model(model: Transformer, mode: WeightFormat | str) -> Transformer:
    """Convert `model`'s nn.Linear layers in place for inference (no training afterwards) and
    return it; layers converted before (e.g. kept in GGUF blocks) stay as they are. A bar on
    stderr counts the layers where stderr is a terminal."""
    mode = WeightFormat.parse(mode, field="quantize")
    reason = CAPABILITIES.why_not(model.config)
    if reason is not None:
        raise InputError("quantize", f"{reason}")
    model.eval().requires_grad_(False)
    layers = model.linear_layers()
    names = tqdm(list(layers), desc=f"converting layers to {mode.value}", unit="layer",
                 disable=None, leave=False)  # disable=None: no bar where stderr is not a terminal
    for name in names:  # popped: each float weight is freed once converted
        layer = layers.pop(name)
        if isinstance(layer, nn.Linear):
            model.set_submodule(name, QuantizedLinear.from_linear(layer, mode))
    model.install_fused_step(FastDecoder.build)  # drops any step built on the old layers
    return model
