"""The one decision of weights and products per device (accel/precision.py), a pure function of
the device's type: tested on the CPU with "cuda" named, and its settings leaving the CPU alone."""

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.accel.precision import choose_precision, use_precision
from glassformer.accel.quantize import quantize_model


@pytest.mark.parametrize(("device", "quantize", "compile", "deterministic", "want"), [
    ("cpu", None, False, False, ("none", torch.float32, False)),  # today's CPU: the fast kernels
    ("cpu", None, True, False, (None, torch.float32, False)),  # --compile: plain modules
    ("cpu", None, False, True, ("none", torch.float32, False)),  # deterministic: the same
    ("mps", None, False, False, ("none", torch.float32, False)),
    ("cuda", None, False, False, (None, torch.bfloat16, True)),  # bf16 weights, TF32
    ("cuda", None, True, False, (None, torch.bfloat16, True)),
    ("cuda", None, False, True, (None, torch.bfloat16, False)),  # no TF32
    ("cuda", "int8", False, False, ("int8", torch.float32, True)),  # the user's choice kept
    ("cuda", "none", False, True, ("none", torch.float32, False)),
    ("cpu", "bf16", False, False, ("bf16", torch.float32, False)),
])
def test_the_choice_per_device(device, quantize, compile, deterministic, want):
    precision = choose_precision(device, quantize, compile, deterministic)
    assert (precision.quantize, precision.dtype, precision.tf32) == want
    assert precision.deterministic == deterministic
    assert precision.describe().startswith(f"{device}: ")


def test_the_description_names_the_weights_and_products():
    assert choose_precision("cuda").describe() == "cuda: bfloat16 weights, TF32 float32 products"
    assert (choose_precision("cuda", deterministic=True).describe()
            == "cuda: bfloat16 weights, full float32 products, deterministic algorithms")
    assert choose_precision("cpu").describe() == "cpu: float32 weights, full float32 products"
    assert choose_precision("cpu", "int4").describe() == "cpu: int4 weights, full float32 products"


def test_settings_for_the_cpu_change_nothing_in_the_process():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32)
    use_precision(choose_precision("cpu", deterministic=True))
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32) == before


def test_placing_casts_plain_weights_and_keeps_a_converted_models_formats():
    config = get_preset("tiny-llama")
    plain = choose_precision("cuda").place(Transformer(config), "cpu")  # "cuda"'s choice, placed here
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    converted = quantize_model(Transformer(config), "bf16")
    placed = choose_precision("cpu", "bf16").place(converted, "cpu")
    assert placed.blocks[0].attn.qkv.weight.dtype == torch.bfloat16  # not cast to float32
