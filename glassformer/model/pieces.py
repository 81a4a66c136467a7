"""A configuration's pieces, each named with its values: what its blocks compute, as `glassformer
info` and the documentation's table of supported models show them.

The pieces are the switchable parts of `ModelConfig` that tell families apart (the position
scheme, the norm and where it sits, the feed-forward, the attention's heads, scale, cap and
windows, the embedding and the head); values every decoder shares are left unsaid.
"""

from __future__ import annotations

from .config import ModelConfig

# (the piece's name, its values in this configuration; "" where the name says it all)
Piece = tuple[str, str]

_POSITIONS = {"learned": "learned positions", "sinusoidal": "sinusoidal positions",
              "alibi": "ALiBi", "relative": "T5 relative bias", "none": "no positions"}
_PLACEMENTS = {"post": ("post-norm", "a norm after each residual add"),
               "out": ("output norms", "after each sublayer, none before"),
               "sandwich": ("sandwich norms", "before and after each sublayer")}
_GATED = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "GeGLU (tanh)", "relu": "ReGLU"}
_ACTIVATIONS = {"silu": "SiLU", "gelu": "GELU", "gelu_tanh": "GELU (tanh)", "relu": "ReLU"}


def _position(c: ModelConfig) -> list[Piece]:
    if c.position != "rope":
        return [(_POSITIONS[c.position], "")]
    scaling = "" if c.rope_scaling == "none" else f", {c.rope_scaling} scaling ×{c.rope_factor:g}"
    found = [("RoPE", f"θ {c.rope_theta:g}{scaling}")]
    if c.rotary_dim is not None:
        found.append(("partial rotary", f"{c.rotary_dim} of {c.head_dim} dimensions"))
    return found


def _attention(c: ModelConfig) -> list[Piece]:
    heads = f"{c.n_heads} heads, {c.kv_heads} key/value heads"
    kind = "MHA" if c.kv_heads == c.n_heads else "MQA" if c.kv_heads == 1 else "GQA"
    found = [(kind, heads if kind != "MHA" else f"{c.n_heads} heads")]
    if c.qk_norm != "none":
        found.append(("QK-norm", "per head" if c.qk_norm == "head" else "over all heads"))
    if c.attn_scale is not None:
        found.append(("score scale", f"{c.attn_scale:g}^-½"))
    if c.attn_softcap is not None:
        found.append(("attention soft-cap", f"{c.attn_softcap:g}"))
    local = [w for w in c.layer_windows or () if w is not None]
    if local:
        found.append(("local and global layers", f"{len(local)} of {c.n_layers} local, window "
                      + ", ".join(map(str, sorted(set(local))))))
    elif c.layer_windows is None and c.sliding_window is not None:
        found.append(("sliding window", f"{c.sliding_window}"))
    return found


def pieces(c: ModelConfig) -> list[Piece]:
    """The configuration's pieces, in the order a token meets them."""
    found: list[Piece] = []
    if c.n_encoder_layers or not c.causal:
        found.append(("encoder-decoder", "") if c.n_encoder_layers else ("bidirectional encoder", ""))
    if c.embed_scale:
        found.append(("embedding scale", "× √d_model"))
    found += _position(c)
    norm = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[c.norm]
    found.append((norm, f"× ({c.norm_weight_offset:g} + w)" if c.norm_weight_offset else ""))
    if c.norm_placement in _PLACEMENTS:
        found.append(_PLACEMENTS[c.norm_placement])
    found += _attention(c)
    if c.parallel_block:
        found.append(("parallel residual", "attention and feed-forward both read the block's input"))
    found.append((_GATED[c.activation], "") if c.gated else (f"{_ACTIVATIONS[c.activation]} MLP", ""))
    if c.tie_embeddings:
        found.append(("tied head", ""))
    if c.final_softcap is not None:
        found.append(("final soft-cap", f"{c.final_softcap:g}"))
    return found
