import pytest

from glassformer import PRESETS, ModelConfig, get_preset

BASE = dict(vocab_size=50, context_length=16, d_model=32, n_layers=2, n_heads=4)


def test_defaults_resolve_through_properties():
    config = ModelConfig(**BASE)
    assert (config.kv_heads, config.head_dim, config.ff_dim, config.n_rep) == (4, 8, 128, 1)
    assert config.n_kv_heads is None and config.d_head is None  # fields are never rewritten
    gqa = ModelConfig(**BASE, n_kv_heads=2, d_head=16, d_ff=40)
    assert (gqa.kv_heads, gqa.head_dim, gqa.ff_dim, gqa.n_rep) == (2, 16, 40, 2)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(d_model=30), "d_model"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(position="absolute"), "position"),
        (dict(n_layers=-1), "n_layers"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(d_ff=-4), "d_ff"),
        (dict(norm="batchnorm"), "norm"),
        (dict(activation="tanh"), "activation"),
        (dict(attention_kernel="fast"), "attention_kernel"),
        (dict(dropout=1.5), "dropout"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(position="rope", d_head=7), "d_head"),
        (dict(rope_scaling="yarn"), "rope_scaling"),
        (dict(position="rope", rope_scaling="longrope", rope_original_context=8), "rope_short_factors"),
        (dict(position="rope", rope_scaling="longrope", rope_original_context=8,
              rope_short_factors=(1.0,) * 4, rope_long_factors=(1.0,) * 3), "rope_long_factors"),
        (dict(position="rope", rope_scaling="longrope", rope_short_factors=(1.0,) * 4,
              rope_long_factors=(2.0,) * 4), "rope_original_context"),
        (dict(position="rope", rope_scaling="linear", rope_attention_factor=1.2), "rope_attention_factor"),
        (dict(position="rope", rope_scaling="yarn", rope_beta_slow=0.0), "rope_beta_slow"),
        (dict(n_heads=True), "n_heads"),
        (dict(attn_softcap=0.0), "attn_softcap"),
        (dict(final_softcap=-1.0), "final_softcap"),
        (dict(attn_scale=16.0, scale_scores=False), "attn_scale"),
        (dict(norm_weight_offset=1.0), "norm_weight_offset"),  # layernorm
        (dict(layer_windows=(4,)), "layer_windows"),  # one per layer
        (dict(layer_windows=(4, 0)), "layer_windows"),
        (dict(layer_windows=(4, None), sliding_window=4), "layer_windows"),
        (dict(norm_placement="sandwich", n_encoder_layers=2), "norm_placement"),
        (dict(position="rope", rope_local_theta=0.0), "rope_local_theta"),
        (dict(position="learned", rope_local_theta=10000.0), "rope_local_theta"),
    ],
)
def test_invalid_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ModelConfig(**{**BASE, **changes})


def test_config_is_frozen_and_round_trips():
    config = get_preset("tiny-llama")
    with pytest.raises(AttributeError):
        config.d_model = 64
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="not a ModelConfig field"):
        ModelConfig.from_dict({**config.to_dict(), "colour": "blue"})


def test_presets_are_looked_up_by_exact_name():
    assert get_preset("gpt2") is PRESETS["gpt2"]
    with pytest.raises(ValueError, match="unknown preset 'GPT2'"):
        get_preset("GPT2")


def test_seed_architectures():
    gpt1 = get_preset("gpt1")
    assert (gpt1.n_layers, gpt1.d_model, gpt1.n_heads, gpt1.context_length) == (12, 768, 12, 512)
    assert (gpt1.position, gpt1.norm_placement, gpt1.activation) == ("learned", "post", "gelu")
    assert gpt1.tie_embeddings and not gpt1.final_norm
    gpt2 = get_preset("gpt2")
    assert (gpt2.norm_placement, gpt2.activation, gpt2.context_length) == ("pre", "gelu_tanh", 1024)
    vaswani = get_preset("transformer-decoder")
    assert (vaswani.position, vaswani.norm_placement, vaswani.activation) == (
        "sinusoidal", "post", "relu",
    )
    llama = get_preset("llama")
    assert (llama.position, llama.norm, llama.activation, llama.gated) == (
        "rope", "rmsnorm", "silu", True,
    )
    assert 1 < llama.kv_heads < llama.n_heads
    assert not (llama.attn_bias or llama.attn_out_bias or llama.mlp_bias)
    assert get_preset("alibi").position == "alibi"


def test_layer_windows_round_trip_through_json():
    import json

    config = ModelConfig(**BASE, layer_windows=(4, None))
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert (config.window_of(0), config.window_of(1)) == (4, None)
