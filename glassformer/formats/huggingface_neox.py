"""GPT-NeoX / Pythia (`model_type` gpt_neox) <-> Glassformer: the config and the key map.

A NeoX block is pre-norm LayerNorm (with biases) and a GELU feed-forward with biases; with
use_parallel_residual (the default) both sublayers read the block's input (`parallel_block`).
RoPE turns only the first rotary_pct of each head (`rotary_dim`). The fused query_key_value
holds each head's q, k and v rows together, head after head: (H, 3, d_head) rows, which the
key map reorders into our (3, H, d_head). The head, embed_out, is untied unless
tie_word_embeddings says otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError
from ..model.config import ModelConfig
from .refusals import require
from .tensor_map import Entry

# A transformers hidden_act -> ours (not gated)
NEOX_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                    "relu": "relu", "silu": "silu"}
NEOX_HEAD = "embed_out.weight"


def neox_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig equal to a GPT-NeoX config.json (as a dict); a field that changes the math
    and is not computed here is refused by name."""
    act = hf.get("hidden_act", "gelu")
    if act not in NEOX_ACTIVATIONS:
        raise InputError("hidden_act", f"unsupported GPT-NeoX hidden_act {act!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise InputError("rope_scaling", f"unsupported GPT-NeoX rope type {rope_type!r} (default only)")
    d_head = hf["hidden_size"] // hf["num_attention_heads"]
    share = float(rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)))
    rotary_dim = int(d_head * share)  # as transformers rounds it
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"],
        d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"], position="rope",
        rope_theta=float(rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))),
        rotary_dim=None if rotary_dim == d_head else rotary_dim, norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        parallel_block=bool(hf.get("use_parallel_residual", True)),
        activation=NEOX_ACTIVATIONS[act], attn_bias=bias, attn_out_bias=bias, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def fused_qkv_order(c: ModelConfig) -> tuple[int, ...]:
    """For each row of our qkv (3, H, d_head), its row in NeoX's query_key_value (H, 3, d_head)."""
    theirs = torch.arange(3 * c.n_heads * c.head_dim).view(c.n_heads, 3, c.head_dim)
    return tuple(theirs.transpose(0, 1).reshape(-1).tolist())


def neox_keys(c: ModelConfig) -> list[Entry]:
    """Every tensor of a GPTNeoXForCausalLM with where it goes in Glassformer."""
    order = fused_qkv_order(c)
    entries = [Entry("gpt_neox.embed_in.weight", "embed.tokens.weight")]
    for i in range(c.n_layers):
        h, b = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        for theirs, ours in (("input_layernorm", "norm1"), ("post_attention_layernorm", "norm2"),
                             ("mlp.dense_h_to_4h", "mlp.up"), ("mlp.dense_4h_to_h", "mlp.down")):
            entries += [Entry(f"{h}{theirs}.{k}", f"{b}{ours}.{k}") for k in ("weight", "bias")]
        kinds = ("weight", "bias") if c.attn_bias else ("weight",)
        entries += [Entry(f"{h}attention.query_key_value.{k}", f"{b}attn.qkv.{k}", order=order)
                    for k in kinds]
        entries += [Entry(f"{h}attention.dense.{k}", f"{b}attn.out.{k}") for k in kinds]
    entries += [Entry(f"gpt_neox.final_layer_norm.{k}", f"final_norm.{k}") for k in ("weight", "bias")]
    if not c.tie_embeddings:
        entries.append(Entry(NEOX_HEAD, "lm_head.weight"))
    return entries


def neox_hf_config(c: ModelConfig) -> dict[str, Any]:
    """The config.json of a GPTNeoXForCausalLM equal to `c` (refused field by field)."""
    expected = dict(position="rope", norm="layernorm", norm_bias=True, gated=False, mlp_bias=True,
                    attn_out_bias=c.attn_bias, kv_heads=c.n_heads,
                    head_dim=c.d_model // c.n_heads, sliding_window=None, rope_scaling="none")
    require(c, "GPT-NeoX", **expected)
    names = {ours: theirs for theirs, ours in NEOX_ACTIVATIONS.items() if theirs != "gelu_pytorch_tanh"}
    return {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
            "vocab_size": c.vocab_size, "max_position_embeddings": c.context_length,
            "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads, "intermediate_size": c.ff_dim,
            "hidden_act": names[c.activation], "layer_norm_eps": c.norm_eps,
            "use_parallel_residual": c.parallel_block, "attention_bias": c.attn_bias,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.rotated_dim / c.head_dim},
            "tie_word_embeddings": c.tie_embeddings, "attention_dropout": 0.0,
            "hidden_dropout": 0.0}
