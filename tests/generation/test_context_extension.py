import math

import pytest
import torch

from glassformer import ModelConfig, Transformer, get_preset
from glassformer.generation.context_extension import extend_context
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.layers.positions import rope_cos_sin, rope_inverse_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402


def _rope(scaling: str = "none", factor: float = 1.0, d_head: int = 16, **changes) -> ModelConfig:
    return ModelConfig(
        vocab_size=50, context_length=int(64 * factor), d_model=4 * d_head, n_layers=1, n_heads=4,
        position="rope", rope_scaling=scaling, rope_factor=factor, rope_original_context=64, **changes,
    )


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_factor_one_is_plain_rope(scaling):
    plain, plain_factor = rope_inverse_frequencies(_rope())
    scaled, attention_factor = rope_inverse_frequencies(_rope(scaling, 1.0))
    torch.testing.assert_close(scaled, plain)
    assert attention_factor == plain_factor == 1.0


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_linear_interpolation_divides_positions_by_the_factor(factor):
    positions = torch.arange(0, 300).reshape(3, 100)  # (B, T)
    plain, _ = rope_inverse_frequencies(_rope())
    scaled, attention_factor = rope_inverse_frequencies(_rope("linear", factor))
    expected = rope_cos_sin(plain, positions.float() / factor)
    for got, want in zip(rope_cos_sin(scaled, positions, attention_factor), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_ntk_aware_scaling_raises_the_base(factor):
    d = 16
    scaled, attention_factor = rope_inverse_frequencies(_rope("ntk", factor, d))
    base = 10000.0 * factor ** (d / (d - 2))  # base' = base · s^(d/(d-2))
    expected = base ** -(torch.arange(0, d, 2).float() / d)
    torch.testing.assert_close(scaled, expected)
    plain, _ = rope_inverse_frequencies(_rope())
    # the highest frequency is kept, the lowest is interpolated exactly like linear scaling
    torch.testing.assert_close(scaled[0], plain[0])
    torch.testing.assert_close(scaled[-1], plain[-1] / factor)
    assert attention_factor == 1.0


@pytest.mark.parametrize(
    "factor, d_head, theta", [(2.0, 16, 10000.0), (4.0, 64, 10000.0), (8.0, 32, 500000.0)]
)
def test_yarn_matches_hugging_face(factor, d_head, theta):
    ours, attention_factor = rope_inverse_frequencies(_rope("yarn", factor, d_head, rope_theta=theta))
    hf_config = transformers.LlamaConfig(
        hidden_size=4 * d_head, num_attention_heads=4, head_dim=d_head,
        max_position_embeddings=int(64 * factor),
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                         "original_max_position_embeddings": 64},
    )
    theirs, their_factor = _compute_yarn_parameters(hf_config)
    torch.testing.assert_close(ours, theirs)
    assert attention_factor == pytest.approx(their_factor) == pytest.approx(0.1 * math.log(factor) + 1)


def _model(name: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset(name).replace(init_std=0.3)).eval()


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_an_extended_rope_model_shares_weights_and_generates_past_the_old_window(scaling):
    model = _model("tiny-llama")  # context 32
    extended = extend_context(model, scaling, 4.0)
    assert extended.config.context_length == 128 and extended.config.original_context == 32
    assert extended.embed.tokens.weight.data_ptr() == model.embed.tokens.weight.data_ptr()
    assert extended.lm_head.weight is extended.embed.tokens.weight
    prompt = list(range(40))  # longer than the original window
    with pytest.raises(ValueError, match="truncate"):
        generate(model, prompt, GenerationConfig(max_new_tokens=4))
    cached = generate(extended, prompt, GenerationConfig(max_new_tokens=30, eos_ids=()))
    uncached = generate(extended, prompt, GenerationConfig(max_new_tokens=30, eos_ids=(), use_cache=False))
    assert cached.n_generated == 30 and cached.generated_ids == uncached.generated_ids


def test_alibi_extrapolates_without_scaling():
    model = _model("tiny-alibi")
    extended = extend_context(model, "none", 2.0)
    ids = torch.tensor([list(range(32))])
    with torch.no_grad():
        torch.testing.assert_close(extended(ids), model(ids))  # same function inside the old window
        assert extended(torch.tensor([list(range(64))])).shape == (1, 64, 96)
    with pytest.raises(ValueError, match="rope_scaling"):
        extend_context(model, "yarn", 2.0)


def test_learned_positions_cannot_be_extended():
    with pytest.raises(ValueError, match="position"):
        extend_context(_model("tiny-gpt2"), "none", 2.0)
