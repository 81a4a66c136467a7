"""Gemma, Gemma 2 and Gemma 3 (`model_type` gemma, gemma2, gemma3_text): their config and key
map, both ways.

Both are Llama's block with Gemma's pieces: RMSNorm times (1 + w) (norm_weight_offset 1,
the stored w as it is), token embeddings times √d_model (embed_scale), GeGLU with tanh GELU,
an explicit head_dim and a tied head. Gemma 2 adds sandwich norms (input_layernorm ->
norm1, post_attention_layernorm -> attn_out_norm, pre_feedforward_layernorm -> norm2,
post_feedforward_layernorm -> mlp_out_norm), soft-capped scores and logits, scores times
query_pre_attn_scalar^-½, and a sliding window on the layers `layer_types` names
"sliding_attention" (by default the even ones: 0, 2, ...).

Gemma 3 is Gemma 2 with query/key norms per head (q_norm, k_norm: (1 + w) too), the final
soft-cap only where its config sets one (an attention soft-cap, which transformers' Gemma 3
leaves out, is refused), every sixth layer global by default (`sliding_window_pattern`),
and a RoPE base per kind of layer: the global layers turn by rope_theta with the config's
scaling, the sliding ones by their own base (rope_local_theta) unscaled. transformers 5 states
both in `rope_parameters` keyed by layer type; 4.x in rope_theta, rope_local_base_freq and a
rope_scaling for the global layers.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .refusals import require
from .tensor_map import Entry

# Hugging Face activation names -> ours; Gemma's "gelu" is read as transformers reads it
# (GemmaConfig takes a legacy "gelu" for the tanh approximation, Gemma2Config does not)
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_LAYER_KINDS = ("sliding_attention", "full_attention")
# Gemma3TextConfig's defaults: its RoPE bases and every sixth layer global
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_GEMMA3_PATTERN = 6


def gemma_config(hf: dict[str, Any], rope_fields: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Gemma / Gemma 2 / Gemma 3 config.json; `rope_fields`: its RoPE
    fields as huggingface_rope.py reads them (rope_theta and any scaling; Gemma 3's from
    gemma3_rope, with rope_local_theta)."""
    kind = hf["model_type"]
    second, third = kind != "gemma", kind == "gemma3_text"  # Gemma 2's pieces; Gemma 3's
    act = hf.get("hidden_activation" if second else "hidden_act", "gelu_pytorch_tanh")
    activation = _ACTIVATIONS.get(act) or {"gelu": "gelu" if second else "gelu_tanh"}.get(act)
    if activation is None:
        raise InputError("hidden_activation", f"unsupported Gemma activation {act!r}")
    if hf.get("use_bidirectional_attention"):
        raise InputError("use_bidirectional_attention", "bidirectional Gemma is not computed")
    if third and hf.get("attn_logit_softcapping") is not None:  # neither transformers nor llama.cpp has it
        raise InputError("attn_logit_softcapping", "Gemma 3's attention takes no soft-cap")
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = {}
    if second:
        caps = (None, None) if third else (50.0, 30.0)  # the config classes' defaults
        fields = {"norm_placement": "sandwich", "attn_scale": float(hf.get("query_pre_attn_scalar", 256)),
                  "attn_softcap": _cap(hf, "attn_logit_softcapping", caps[0]),
                  "final_softcap": _cap(hf, "final_logit_softcapping", caps[1]),
                  "layer_windows": _layer_windows(hf, n_layers, _GEMMA3_PATTERN if third else 2)}
    if third:
        fields["qk_norm"] = "head"
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"],
        d_model=hf["hidden_size"], n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_head=hf.get("head_dim", 256),
        d_ff=hf["intermediate_size"], position="rope", **rope_fields,
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_weight_offset=1.0,
        embed_scale=True, activation=activation, gated=True, attn_bias=bias, attn_out_bias=bias,
        mlp_bias=False, tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **fields,
    )


def _cap(hf: dict[str, Any], name: str, default: float | None) -> float | None:
    value = hf.get(name, default)
    return None if value is None else float(value)


def _layer_windows(hf: dict[str, Any], n_layers: int, pattern: int) -> tuple[int | None, ...]:
    """Each layer's window from layer_types, else from sliding_window_pattern (`pattern` by
    default): layer i is global where i + 1 is a multiple of it (Gemma 2: the even layers
    slide; Gemma 3: every sixth is global)."""
    pattern = pattern if hf.get("sliding_window_pattern") is None else hf["sliding_window_pattern"]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise InputError("sliding_window_pattern", f"must be a positive integer, got {pattern!r}")
    kinds = hf.get("layer_types") or [_LAYER_KINDS[(i + 1) % pattern == 0] for i in range(n_layers)]
    if len(kinds) != n_layers or any(kind not in _LAYER_KINDS for kind in kinds):
        raise InputError("layer_types", f"needs {n_layers} of {', '.join(_LAYER_KINDS)}, got {kinds!r}")
    window = hf.get("sliding_window")
    if window is None and "sliding_attention" in kinds:
        raise InputError("sliding_window", "layer_types names sliding layers but no sliding_window")
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def gemma3_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """A Gemma 3 config.json's RoPE: the global layers' entry (rope_theta and any scaling, as
    a rope_parameters entry) and the sliding layers' base, from either layout."""
    params = hf.get("rope_parameters") or {}
    if any(kind in params for kind in _LAYER_KINDS):  # transformers 5: keyed by layer type
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # transformers 4: the scaling is the global layers'
        full = dict(hf.get("rope_scaling") or params)
        full["rope_theta"] = hf.get("rope_theta", full.get("rope_theta", _GEMMA3_THETA["full_attention"]))
        local = {"rope_theta": hf.get("rope_local_base_freq", _GEMMA3_THETA["sliding_attention"])}
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise InputError("rope_parameters", f"the sliding layers' rope type {local_type!r} is not "
                         "computed (they turn by their own base, unscaled)")
    full = {"rope_theta": _GEMMA3_THETA["full_attention"], **full}
    return full, float(local.get("rope_theta", _GEMMA3_THETA["sliding_attention"]))


def gemma_keys(c: ModelConfig) -> list[Entry]:
    """Every Hugging Face tensor of a Gemma / Gemma 2 / Gemma 3 model with where it goes here."""
    H, KV, ff = c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.ff_dim
    entries = [Entry("model.embed_tokens.weight", "embed.tokens.weight"),
               Entry("model.norm.weight", "final_norm.weight")]
    norms = [("input_layernorm", "norm1"), ("post_attention_layernorm", "norm2")]
    if c.norm_placement == "sandwich":
        norms = [("input_layernorm", "norm1"), ("post_attention_layernorm", "attn_out_norm"),
                 ("pre_feedforward_layernorm", "norm2"), ("post_feedforward_layernorm", "mlp_out_norm")]
    kinds = ("weight", "bias") if c.attn_bias else ("weight",)
    for i in range(c.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        entries += [Entry(f"{h}{theirs}.weight", f"{b}{ours}.weight") for theirs, ours in norms]
        if c.qk_norm == "head":  # Gemma 3
            entries += [Entry(f"{h}self_attn.{n}_norm.weight", f"{b}attn.{n}_norm.weight") for n in "qk"]
        for name, rows in (("q_proj", (0, H)), ("k_proj", (H, H + KV)), ("v_proj", (H + KV, H + 2 * KV))):
            entries += [Entry(f"{h}self_attn.{name}.{k}", f"{b}attn.qkv.{k}", rows) for k in kinds]
        entries += [Entry(f"{h}self_attn.o_proj.{k}", f"{b}attn.out.{k}") for k in kinds]
        entries += [Entry(f"{h}mlp.gate_proj.weight", f"{b}mlp.up.weight", (0, ff)),
                    Entry(f"{h}mlp.up_proj.weight", f"{b}mlp.up.weight", (ff, 2 * ff)),
                    Entry(f"{h}mlp.down_proj.weight", f"{b}mlp.down.weight")]
    if not c.tie_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.weight"))
    return entries


def is_gemma(config: ModelConfig) -> bool:
    """Whether a config is one of Gemma's (its norms and embeddings are Gemma's own)."""
    return config.norm_weight_offset == 1.0 and config.embed_scale


def gemma_hf_config(config: ModelConfig, rope_scaling: dict | None, kind: str) -> dict[str, Any]:
    """The config.json of a `kind` config (gemma, gemma2 or gemma3_text: gemma_config reversed);
    a field it cannot express is refused by name."""
    second, third = kind != "gemma", kind == "gemma3_text"  # Gemma 2's pieces; Gemma 3's
    expected = {"position": "rope", "norm": "rmsnorm", "gated": True, "mlp_bias": False,
                "final_norm": True, "causal": True, "lm_head_bias": False, "scale_scores": True,
                "scale_head_input": False, "sliding_window": None, "attn_out_bias": config.attn_bias,
                "qk_norm": "head" if third else "none", "parallel_block": False, "rotary_dim": None}
    if third:
        expected["norm_placement"] = "sandwich"
    else:
        expected["rope_local_theta"] = None
    if not second:
        expected |= {"norm_placement": "pre", "attn_softcap": None, "final_softcap": None,
                     "attn_scale": None, "layer_windows": None}
    require(config, kind, **expected)
    if config.activation != "gelu_tanh":
        raise InputError("activation", f"{config.activation!r} cannot be exported as Gemma (gelu_tanh)")
    out = {"model_type": kind,
           "architectures": [{"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                              "gemma3_text": "Gemma3ForCausalLM"}[kind]],
           "vocab_size": config.vocab_size, "max_position_embeddings": config.context_length,
           "hidden_size": config.d_model, "intermediate_size": config.ff_dim,
           "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
           "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
           "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
           "rope_scaling": rope_scaling, "tie_word_embeddings": config.tie_embeddings,
           "attention_bias": config.attn_bias, "attention_dropout": 0.0,
           "hidden_activation" if second else "hidden_act": "gelu_pytorch_tanh"}
    if second:
        out |= _sandwich_fields(config)
    if third:  # the 4.x layout, which transformers 5 reads too
        out["rope_local_base_freq"] = _local_base(config)
    return out


def _sandwich_fields(config: ModelConfig) -> dict[str, Any]:
    """Gemma 2 and 3's own config.json fields: the score scale, soft-caps and sliding layers."""
    windows = config.layer_windows or (None,) * config.n_layers
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise InputError("layer_windows", f"Gemma 2 and 3 have one sliding window, got {sorted(sizes)}")
    scalar = config.attn_scale or config.head_dim
    if not float(scalar).is_integer():
        raise InputError("attn_scale", f"Gemma's query_pre_attn_scalar is an integer, got {scalar}")
    return {"query_pre_attn_scalar": int(scalar), "attn_logit_softcapping": config.attn_softcap,
            "final_logit_softcapping": config.final_softcap,
            "sliding_window": next(iter(sizes), None),
            "layer_types": [_LAYER_KINDS[w is None] for w in windows]}


def _local_base(config: ModelConfig) -> float:
    """Gemma 3's rope_local_base_freq: rope_local_theta, or rope_theta where every layer turns
    alike (then no scaling may stretch the global layers alone)."""
    if config.rope_local_theta is not None:
        return config.rope_local_theta
    if config.rope_scaling != "none" and any(w is not None for w in config.layer_windows or ()):
        raise InputError("rope_local_theta", "Gemma 3's sliding layers turn unscaled: without a "
                         "base of their own, the scaling cannot be exported")
    return config.rope_theta
