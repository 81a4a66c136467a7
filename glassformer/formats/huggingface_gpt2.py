"""GPT-2 (`model_type` gpt2) <-> Glassformer: the config and the key map, both ways.

Learned positions, LayerNorm, GELU (tanh), a fused c_attn and a tied head. Its Conv1D layers
store weights as (in, out), so they are transposed.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .refusals import plain_decoder, require
from .tensor_map import Entry

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                    "relu": "relu"}


def gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig equal to a GPT-2 config.json (as a dict)."""
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise InputError(None, f"unsupported GPT-2 activation_function {act!r}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag):
            raise InputError(None, f"unsupported GPT-2 option {flag}=true")
    if hf.get("scale_attn_weights") is False:
        raise InputError(None, "unsupported GPT-2 option scale_attn_weights=false")
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["n_positions"], d_model=hf["n_embd"],
        n_layers=hf["n_layer"], n_heads=hf["n_head"], d_ff=hf.get("n_inner"),
        position="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=GPT2_ACTIVATIONS[act], tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def gpt2_keys(c: ModelConfig) -> list[Entry]:
    """Every tensor of a GPT2LMHeadModel with where it goes in Glassformer."""
    p = "transformer."
    entries = [Entry(p + "wte.weight", "embed.tokens.weight"),
               Entry(p + "wpe.weight", "embed.positions.weight")]
    for i in range(c.n_layers):
        h, b = f"{p}h.{i}.", f"blocks.{i}."
        for ours, theirs, conv in (("norm1", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
                                   ("attn.out", "attn.c_proj", True), ("norm2", "ln_2", False),
                                   ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True)):
            entries.append(Entry(f"{h}{theirs}.weight", f"{b}{ours}.weight", transpose=conv))
            entries.append(Entry(f"{h}{theirs}.bias", f"{b}{ours}.bias"))
    entries += [Entry(p + "ln_f.weight", "final_norm.weight"), Entry(p + "ln_f.bias", "final_norm.bias")]
    if not c.tie_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.weight"))
    return entries


def gpt2_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The config.json of a GPT2LMHeadModel equal to `config` (refused field by field)."""
    plain_decoder(config)
    require(config, "GPT-2", norm="layernorm", gated=False, parallel_block=False,
            attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True,
            kv_heads=config.n_heads, head_dim=config.d_model // config.n_heads, sliding_window=None)
    names = {ours: theirs for theirs, ours in GPT2_ACTIVATIONS.items() if theirs != "gelu_pytorch_tanh"}
    if config.activation not in names:
        raise InputError("activation", f"{config.activation!r} cannot be exported as GPT-2")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": config.vocab_size, "n_positions": config.context_length,
            "n_embd": config.d_model, "n_layer": config.n_layers, "n_head": config.n_heads,
            "n_inner": config.ff_dim, "activation_function": names[config.activation],
            "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
