"""model/sizes.py: the arithmetic lower bound of a configuration's weights against the
parameters a built model holds, and the refusal of a size past the machine's memory."""

from __future__ import annotations

import pytest
import torch

from glassformer import get_preset
from glassformer.errors import InputError
from glassformer.model.encoder_decoder import build_model
from glassformer.model.sizes import check_fits, check_model_fits, device_memory, weight_bytes


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-t5", "tiny-bert"])
def test_weight_bytes_is_at_most_what_a_built_model_holds_and_close_to_it(name):
    config = get_preset(name)
    with torch.device("meta"):
        held = sum(p.numel() for p in build_model(config).parameters())  # tied tables once
    assert 0.75 * 4 * held <= weight_bytes(config) <= 4 * held
    assert weight_bytes(config, 2) * 2 == weight_bytes(config)


def test_a_size_past_the_machine_is_refused_naming_the_largest_field():
    memory = device_memory("cpu")
    assert memory is not None and memory > 2**20
    check_fits(memory // 2, "cpu", "x", "half the memory")
    with pytest.raises(InputError, match="^x: all of it and one more would take"):
        check_fits(memory + 1, "cpu", "x", "all of it and one more")
    with pytest.raises(InputError, match="^n_layers: the weights at 1,000,000,000,000 would take"):
        check_model_fits(get_preset("tiny-llama").replace(n_layers=10**12))
