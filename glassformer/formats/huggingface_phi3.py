"""Phi-3 (`model_type` phi3) <-> Glassformer: the config and the key map.

A Phi-3 block is Llama's (RMSNorm, SwiGLU, RoPE, no biases, grouped keys and values) with its
products fused as ours are: qkv_proj holds q, k, v rows one after another (our `attn.qkv`),
gate_up_proj the gate rows then the up rows (our `mlp.up`). partial_rotary_factor turns only
the first part of each head (`rotary_dim`); a sliding_window limits every layer's keys.
LongRoPE (rope type longrope, which Phi3Config also reads from the older names su and yarn):
per-pair short and long factors, switched by the length of the text (layers/positions.py),
over the original context of the top-level original_max_position_embeddings (4096 where
config.json has none, as Phi3Config has it).
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .huggingface_llama import head_dim, llama_sizes
from .huggingface_rope import rope_fields
from .refusals import require
from .tensor_map import Entry


def phi3_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig equal to a Phi-3 config.json (as a dict); a field that changes the math
    and is not computed here is refused by name."""
    if hf.get("hidden_act", "silu") != "silu":
        raise InputError("hidden_act", f"unsupported Phi-3 hidden_act {hf['hidden_act']!r} (silu only)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = "longrope" if rope_type in ("su", "yarn") else rope_type
    if rope["rope_type"] not in ("default", "longrope"):
        raise InputError("rope_scaling", f"unsupported Phi-3 rope type {rope_type!r} (default or longrope)")
    rope_hf = hf | {"rope_parameters": rope,
                    "original_max_position_embeddings": hf.get("original_max_position_embeddings") or 4096}
    d_head = head_dim(hf)
    rotary_dim = int(d_head * float(rope.get("partial_rotary_factor",
                                             hf.get("partial_rotary_factor", 1.0))))
    return ModelConfig(
        **llama_sizes(hf), position="rope", **rope_fields(rope_hf),
        rotary_dim=None if rotary_dim == d_head else rotary_dim,
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-5), activation="silu", gated=True,
        attn_bias=False, attn_out_bias=False, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=hf.get("sliding_window"),
    )


def phi3_keys(c: ModelConfig) -> list[Entry]:
    """Every tensor of a Phi3ForCausalLM with where it goes in Glassformer."""
    entries = [Entry("model.embed_tokens.weight", "embed.tokens.weight"),
               Entry("model.norm.weight", "final_norm.weight")]
    for i in range(c.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, ours in (("input_layernorm", "norm1"), ("post_attention_layernorm", "norm2"),
                             ("self_attn.qkv_proj", "attn.qkv"), ("self_attn.o_proj", "attn.out"),
                             ("mlp.gate_up_proj", "mlp.up"), ("mlp.down_proj", "mlp.down")):
            entries.append(Entry(f"{h}{theirs}.weight", f"{b}{ours}.weight"))
    if not c.tie_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.weight"))
    return entries


def phi3_hf_config(c: ModelConfig, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The config.json of a Phi3ForCausalLM equal to `c` (refused field by field), with
    export.py's `rope_scaling` entry (None, or LongRoPE's)."""
    expected = dict(position="rope", norm="rmsnorm", activation="silu", gated=True,
                    attn_bias=False, attn_out_bias=False, mlp_bias=False, parallel_block=False)
    require(c, "Phi-3", **expected)
    if c.rope_scaling not in ("none", "longrope"):
        raise InputError("rope_scaling", f"{c.rope_scaling!r} cannot be exported as Phi-3 "
                         "(none or longrope)")
    rope = {"rope_type": "default"} if rope_scaling is None else rope_scaling
    return {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
            "vocab_size": c.vocab_size, "max_position_embeddings": c.context_length,
            "original_max_position_embeddings": c.original_context,
            "hidden_size": c.d_model, "intermediate_size": c.ff_dim,
            "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
            "rope_parameters": rope | {"rope_theta": c.rope_theta,
                                       "partial_rotary_factor": c.rotated_dim / c.head_dim},
            "sliding_window": c.sliding_window, "tie_word_embeddings": c.tie_embeddings,
            "attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "pad_token_id": None}  # Phi3Config would name 32000, past a small vocabulary
