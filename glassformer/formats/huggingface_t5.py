"""Hugging Face T5 folders (`T5ForConditionalGeneration`) <-> Glassformer's EncoderDecoder.

T5 v1.0 has a ReLU feed-forward and a tied head whose input is scaled by d_model^-½; v1.1 a
gated-GELU (tanh) feed-forward and an untied head without the scaling. Attention has separate
q, k, v, o matrices without biases and no 1/√d_head; the first layer of each stack holds the
stack's relative bias table. Our fused matrices take q|k|v (self-attention), k|v
(cross-attention) and wi_0|wi_1 (gated feed-forward) as row blocks.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .refusals import require

# feed_forward_proj -> (activation, gated); transformers maps "gated-gelu" to the tanh GELU.
FEED_FORWARD = {"relu": ("relu", False), "gelu": ("gelu", False), "gated-gelu": ("gelu_tanh", True),
                "gated-relu": ("relu", True), "gated-silu": ("silu", True)}
# Copies of T5's shared token table that some files also store under each stack's name.
T5_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# A T5 key with its row block in our fused parameter (None: the whole parameter).
T5Key = tuple[str, str, tuple[int, int] | None]


def t5_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig equal to a T5 config.json (as a dict); KeyError names a missing field."""
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD:
        raise InputError(None,
                         f"unsupported T5 feed_forward_proj {proj!r} (supported: {', '.join(FEED_FORWARD)})")
    activation, gated = FEED_FORWARD[proj]
    n_heads, d_kv = hf["num_heads"], hf["d_kv"]
    tied = hf.get("tie_word_embeddings", True) is not False
    start = hf.get("decoder_start_token_id")
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf.get("n_positions", 512),
        d_model=hf["d_model"], n_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        n_encoder_layers=hf["num_layers"], n_heads=n_heads,
        d_head=d_kv if d_kv * n_heads != hf["d_model"] else None, d_ff=hf["d_ff"],
        position="relative", relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6), activation=activation,
        gated=gated, attn_bias=False, attn_out_bias=False, mlp_bias=False,
        tie_embeddings=tied, scale_head_input=tied, scale_scores=False,
        decoder_start_id=hf.get("pad_token_id", 0) if start is None else start,
    )


def t5_keys(c: ModelConfig) -> list[T5Key]:
    """Every T5 tensor with where it goes in an EncoderDecoder."""
    H, KV, ff = c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.ff_dim
    keys: list[T5Key] = [("shared.weight", "embed.tokens.weight", None)]
    for side, n_layers in (("encoder", c.n_encoder_layers), ("decoder", c.n_layers)):
        keys += [(f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                  f"{side}.relative_bias.table.weight", None),
                 (f"{side}.final_layer_norm.weight", f"{side}.final_norm.weight", None)]
        for i in range(n_layers):
            h, b = f"{side}.block.{i}.layer.", f"{side}.blocks.{i}."
            keys += [(f"{h}0.SelfAttention.q.weight", b + "attn.qkv.weight", (0, H)),
                     (f"{h}0.SelfAttention.k.weight", b + "attn.qkv.weight", (H, H + KV)),
                     (f"{h}0.SelfAttention.v.weight", b + "attn.qkv.weight", (H + KV, H + 2 * KV)),
                     (f"{h}0.SelfAttention.o.weight", b + "attn.out.weight", None),
                     (f"{h}0.layer_norm.weight", b + "norm1.weight", None)]
            ff_layer = 1
            if side == "decoder":
                ff_layer = 2
                keys += [(f"{h}1.EncDecAttention.q.weight", b + "cross.q.weight", None),
                         (f"{h}1.EncDecAttention.k.weight", b + "cross.kv.weight", (0, KV)),
                         (f"{h}1.EncDecAttention.v.weight", b + "cross.kv.weight", (KV, 2 * KV)),
                         (f"{h}1.EncDecAttention.o.weight", b + "cross.out.weight", None),
                         (f"{h}1.layer_norm.weight", b + "norm_cross.weight", None)]
            f = f"{h}{ff_layer}."
            if c.gated:
                keys += [(f + "DenseReluDense.wi_0.weight", b + "mlp.up.weight", (0, ff)),
                         (f + "DenseReluDense.wi_1.weight", b + "mlp.up.weight", (ff, 2 * ff))]
            else:
                keys.append((f + "DenseReluDense.wi.weight", b + "mlp.up.weight", None))
            keys += [(f + "DenseReluDense.wo.weight", b + "mlp.down.weight", None),
                     (f + "layer_norm.weight", b + "norm2.weight", None)]
    if not c.tie_embeddings:
        keys.append(("lm_head.weight", "lm_head.weight", None))
    return keys


def t5_hf_config(c: ModelConfig) -> dict[str, Any]:
    """The T5 config.json for an encoder-decoder config T5 can express; ValueError names the
    field that stops it."""
    expected = dict(position="relative", norm="rmsnorm", norm_placement="pre", final_norm=True,
                    attn_bias=False, attn_out_bias=False, mlp_bias=False, lm_head_bias=False,
                    scale_scores=False, scale_head_input=c.tie_embeddings, kv_heads=c.n_heads)
    require(c, "T5", **expected)
    names = {spec: proj for proj, spec in FEED_FORWARD.items()}
    if (c.activation, c.gated) not in names:
        raise InputError("activation", f"{c.activation!r} (gated={c.gated}) cannot be exported as T5")
    return {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
            "is_encoder_decoder": True, "vocab_size": c.vocab_size, "n_positions": c.context_length,
            "d_model": c.d_model, "d_kv": c.head_dim, "d_ff": c.ff_dim,
            "num_layers": c.n_encoder_layers, "num_decoder_layers": c.n_layers,
            "num_heads": c.n_heads, "relative_attention_num_buckets": c.relative_buckets,
            "relative_attention_max_distance": c.relative_max_distance,
            "layer_norm_epsilon": c.norm_eps, "feed_forward_proj": names[(c.activation, c.gated)],
            "tie_word_embeddings": c.tie_embeddings, "dropout_rate": 0.0,
            "decoder_start_token_id": c.decoder_start_id, "pad_token_id": c.decoder_start_id}
