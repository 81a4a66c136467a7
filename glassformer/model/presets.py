"""Named architectures, looked up by exact name. Each is one ModelConfig."""

from __future__ import annotations

from ..errors import InputError
from .config import ModelConfig

_GPT1 = ModelConfig(
    vocab_size=40478, context_length=512, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
    position="learned", norm="layernorm", norm_placement="post", activation="gelu",
    final_norm=False, tie_embeddings=True, dropout=0.1,
)
_GPT2 = ModelConfig(
    vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
    position="learned", norm="layernorm", norm_placement="pre", activation="gelu_tanh",
    final_norm=True, tie_embeddings=True, dropout=0.1,
)
# Vaswani et al. (2017), base model, decoder stack only.
_TRANSFORMER_DECODER = ModelConfig(
    vocab_size=37000, context_length=512, d_model=512, n_layers=6, n_heads=8, d_ff=2048,
    position="sinusoidal", norm="layernorm", norm_placement="post", activation="relu",
    final_norm=False, tie_embeddings=True, dropout=0.1,
)
# Llama family: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases (SmolLM2-135M shape).
_LLAMA = ModelConfig(
    vocab_size=49152, context_length=2048, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
    d_ff=1536, position="rope", rope_theta=10000.0, norm="rmsnorm", norm_placement="pre",
    activation="silu", gated=True, attn_bias=False, attn_out_bias=False, mlp_bias=False,
    final_norm=True, tie_embeddings=True,
)
# BLOOM / MPT style: no position embeddings, a linear distance bias in every head.
_ALIBI = ModelConfig(
    vocab_size=50257, context_length=2048, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
    position="alibi", norm="layernorm", norm_placement="pre", activation="gelu",
    final_norm=True, tie_embeddings=True,
)
# BERT-base (Devlin et al., 2019): a bidirectional encoder, post-norm, segment embeddings,
# a norm on the embeddings, the masked-LM head (tied decoder + bias) and a pooler.
_BERT = ModelConfig(
    vocab_size=30522, context_length=512, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
    position="learned", norm="layernorm", norm_placement="post", norm_eps=1e-12,
    activation="gelu", final_norm=False, tie_embeddings=True, lm_head_bias=True, causal=False,
    n_token_types=2, embed_norm=True, head="mlm", pooler=True, dropout=0.1,
)

# T5 v1.0 (Raffel et al., 2020): relative bias, RMS norm, ReLU, no biases, tied head scaled
# by d_model^-½; Q Kᵀ unscaled. n_layers is the decoder's depth.
_T5 = ModelConfig(
    vocab_size=32128, context_length=512, d_model=512, n_layers=6, n_heads=8, d_head=64,
    d_ff=2048, position="relative", norm="rmsnorm", norm_eps=1e-6, activation="relu",
    attn_bias=False, attn_out_bias=False, mlp_bias=False, final_norm=True, tie_embeddings=True,
    dropout=0.1, n_encoder_layers=6, scale_scores=False, scale_head_input=True,
)
# Vaswani et al. (2017), base model: both stacks, post-norm, sinusoidal positions.
_TRANSFORMER_BASE = _TRANSFORMER_DECODER.replace(n_encoder_layers=6)

_TINY = dict(vocab_size=96, context_length=32, d_model=32, n_layers=2, n_heads=4, d_ff=64)

PRESETS: dict[str, ModelConfig] = {
    "gpt1": _GPT1,
    "gpt2": _GPT2,
    "transformer-decoder": _TRANSFORMER_DECODER,
    "llama": _LLAMA,
    "smollm2-135m": _LLAMA.replace(rope_theta=100000.0, context_length=8192),
    "alibi": _ALIBI,
    "tiny-gpt1": _GPT1.replace(**_TINY, dropout=0.0),
    "tiny-gpt2": _GPT2.replace(**_TINY, dropout=0.0),
    "tiny-transformer-decoder": _TRANSFORMER_DECODER.replace(**_TINY, dropout=0.0),
    "tiny-llama": _LLAMA.replace(**_TINY, n_kv_heads=2),
    "tiny-mqa": _LLAMA.replace(**_TINY, n_kv_heads=1),
    "tiny-alibi": _ALIBI.replace(**_TINY),
    "tiny-mistral": _LLAMA.replace(**_TINY, n_kv_heads=2, sliding_window=8),
    "tiny-bidirectional": _GPT2.replace(**_TINY, dropout=0.0, causal=False),
    "bert": _BERT,
    "tiny-bert": _BERT.replace(**_TINY, dropout=0.0),
    "t5-small": _T5,
    "transformer-base": _TRANSFORMER_BASE,
    "tiny-t5": _T5.replace(**_TINY, d_head=8, n_encoder_layers=2, dropout=0.0,
                           relative_buckets=16, relative_max_distance=32),
    "tiny-transformer": _TRANSFORMER_BASE.replace(**_TINY, n_encoder_layers=2, dropout=0.0),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called exactly `name`; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(None, f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
