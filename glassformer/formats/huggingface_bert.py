"""BERT (`model_type` bert, `BertForMaskedLM`) <-> Glassformer: the config and the key map.

BERT is a bidirectional encoder with post-norm blocks, learned positions, segment embeddings,
a LayerNorm on the embeddings, and the masked-LM head: dense + activation + LayerNorm, then a
decoder tied to the token embedding plus a bias. query / key / value are stacked into our fused
`qkv`. A pooler (dense + tanh on the first token) is loaded where the file holds one.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .refusals import require
from .tensor_map import Entry

BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                    "relu": "relu", "silu": "silu"}
POOLER_KEY = "bert.pooler.dense.weight"
# Copies of tied tensors some files hold: the decoder's weight (= the token embedding) and
# its bias (= cls.predictions.bias).
TIED_COPIES = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def bert_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig equal to a BERT config.json (as a dict), without its pooler (the loader
    adds it where the file holds one: POOLER_KEY)."""
    act = hf.get("hidden_act", "gelu")
    if act not in BERT_ACTIVATIONS:
        raise InputError(None, f"unsupported BERT hidden_act {act!r}")
    for flag in ("is_decoder", "add_cross_attention"):
        if hf.get(flag):
            raise InputError(None, f"unsupported BERT option {flag}=true (an encoder only is supported)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise InputError(None, f"unsupported BERT position_embedding_type {hf['position_embedding_type']!r}")
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"],
        d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"], position="learned",
        norm="layernorm", norm_placement="post", norm_eps=hf.get("layer_norm_eps", 1e-12),
        activation=BERT_ACTIVATIONS[act], final_norm=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), lm_head_bias=True,
        causal=False, n_token_types=hf.get("type_vocab_size", 2), embed_norm=True, head="mlm",
    )


def bert_keys(c: ModelConfig) -> list[Entry]:
    """Every tensor of a BertForMaskedLM with where it goes in Glassformer."""
    d, e = c.d_model, "bert.embeddings."
    entries = [Entry(e + "word_embeddings.weight", "embed.tokens.weight"),
               Entry(e + "position_embeddings.weight", "embed.positions.weight"),
               Entry(e + "token_type_embeddings.weight", "embed.token_types.weight"),
               Entry(e + "LayerNorm.weight", "embed.norm.weight"),
               Entry(e + "LayerNorm.bias", "embed.norm.bias")]
    for i in range(c.n_layers):
        h, b = f"bert.encoder.layer.{i}.", f"blocks.{i}."
        for name, rows in (("query", (0, d)), ("key", (d, 2 * d)), ("value", (2 * d, 3 * d))):
            entries += [Entry(f"{h}attention.self.{name}.{k}", f"{b}attn.qkv.{k}", rows)
                        for k in ("weight", "bias")]
        for theirs, ours in (("attention.output.dense", "attn.out"),
                             ("attention.output.LayerNorm", "norm1"),
                             ("intermediate.dense", "mlp.up"), ("output.dense", "mlp.down"),
                             ("output.LayerNorm", "norm2")):
            entries += [Entry(f"{h}{theirs}.{k}", f"{b}{ours}.{k}") for k in ("weight", "bias")]
    p = "cls.predictions."
    for theirs, ours in (("transform.dense", "head_transform.dense"),
                         ("transform.LayerNorm", "head_transform.norm")):
        entries += [Entry(f"{p}{theirs}.{k}", f"{ours}.{k}") for k in ("weight", "bias")]
    entries.append(Entry(p + "bias", "lm_head.bias"))
    if not c.tie_embeddings:
        entries.append(Entry(p + "decoder.weight", "lm_head.weight"))
    if c.pooler:
        entries += [Entry(f"bert.pooler.dense.{k}", f"pooler.dense.{k}") for k in ("weight", "bias")]
    return entries


def bert_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The config.json of a BertForMaskedLM equal to `config` (refused field by field)."""
    expected = dict(position="learned", norm="layernorm", norm_placement="post", final_norm=False,
                    causal=False, embed_norm=True, head="mlm", lm_head_bias=True, gated=False,
                    attn_bias=True, attn_out_bias=True, mlp_bias=True, norm_bias=True,
                    kv_heads=config.n_heads, head_dim=config.d_model // config.n_heads,
                    sliding_window=None)
    require(config, "BERT", **expected)
    if config.n_token_types < 1:
        raise InputError("n_token_types", "0 cannot be exported as BERT (needs at least 1)")
    names = {ours: theirs for theirs, ours in BERT_ACTIVATIONS.items()
             if theirs not in ("gelu_pytorch_tanh",)}
    return {"model_type": "bert", "architectures": ["BertForMaskedLM"],
            "vocab_size": config.vocab_size, "max_position_embeddings": config.context_length,
            "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "intermediate_size": config.ff_dim,
            "hidden_act": names[config.activation], "layer_norm_eps": config.norm_eps,
            "type_vocab_size": config.n_token_types,
            "tie_word_embeddings": config.tie_embeddings, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0, "position_embedding_type": "absolute"}
