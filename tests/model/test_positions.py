"""RoPE's scalings (layers/positions.py) against transformers' own functions for the same
Hugging Face config: the inverse frequencies and the attention factor, and LongRoPE's switch."""

from __future__ import annotations

import pytest
import torch

from glassformer.formats.huggingface import config_from_hf
from glassformer.model.layers.positions import (
    rope_frequencies,
    rope_inverse_frequencies,
    switches_to_long,
    uses_long_factors,
)

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SIZES = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, max_position_embeddings=256)
ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    "yarn_stated": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64,
                    "beta_fast": 4.0, "beta_slow": 0.5, "attention_factor": 0.9, "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [1.0 + i for i in range(8)]},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(kind):
    hf = transformers.LlamaConfig(**SIZES, rope_parameters=ROPES[kind] | {"rope_theta": 500.0})
    config = config_from_hf(hf.to_dict())
    rope_type = ROPES[kind]["rope_type"]
    theirs, their_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    ours, our_factor = rope_inverse_frequencies(config)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)
    if rope_type == "longrope":  # transformers' long set: the one for a text past the original
        theirs_long, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=33)
        torch.testing.assert_close(rope_inverse_frequencies(config, long=True)[0], theirs_long,
                                   rtol=0, atol=0)


def test_longrope_picks_a_set_per_row_by_its_reach():
    hf = transformers.LlamaConfig(**SIZES, rope_parameters=ROPES["longrope"] | {"rope_theta": 500.0})
    config = config_from_hf(hf.to_dict())
    short, long = rope_inverse_frequencies(config)[0], rope_inverse_frequencies(config, long=True)[0]
    positions = torch.tensor([[0, 1, 31], [30, 31, 32]])  # (2, 3): the first within 32, the second past
    chosen = rope_frequencies(config, positions, short, long)  # (2, d/2)
    torch.testing.assert_close(chosen, torch.stack([short, long]))
    assert not uses_long_factors(config, 31) and uses_long_factors(config, 32)
    assert switches_to_long(config, 32, 33) and not switches_to_long(config, 33, 34)
    assert not switches_to_long(config, 31, 32)
