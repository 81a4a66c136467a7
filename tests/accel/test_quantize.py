import pytest
import torch

from glassformer import KVCache, Transformer, get_preset
from glassformer.accel import QuantizedLinear, WeightFormat, quantize_int4, quantize_int8
from glassformer.accel.quantize import QUANTIZE_CHOICES, quantize_format, quantize_model

# How far each mode's logits may drift from float32 on a tiny random model.
TOLERANCE = {"none": 1e-5, "bf16": 3e-2, "int8": 3e-2, "int4": 2e-1}


def _pair(mode):
    config = get_preset("tiny-llama").replace(d_model=64, d_ff=96, vocab_size=128)
    reference = Transformer(config).eval()
    converted = Transformer(config)
    converted.load_state_dict(reference.state_dict())
    return reference, quantize_model(converted, mode)


@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
def test_every_matrix_is_converted_and_logits_stay_close(mode):
    reference, model = _pair(mode)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert all(isinstance(b.attn.qkv, QuantizedLinear) for b in model.blocks)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        expected = reference(ids)
        prefill = model(ids)  # many rows: the matrix-matrix path
        cache = KVCache(model.config, batch_size=1)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache) for t in range(12)], 1)
    scale = expected.abs().max().item()
    for logits in (prefill, steps):
        assert (logits - expected).abs().max().item() <= TOLERANCE[mode] * scale


def test_fp32_kernels_keep_greedy_tokens():
    reference, model = _pair("none")
    ids = torch.randint(0, 128, (1, 4))
    with torch.no_grad():
        for _ in range(10):
            a, b = reference(ids)[:, -1].argmax(-1), model(ids)[:, -1].argmax(-1)
            assert a.item() == b.item()
            ids = torch.cat([ids, a[:, None]], dim=1)


def test_unknown_mode_and_converted_layers_stay():
    _, model = _pair("int8")
    with pytest.raises(ValueError, match="quantize: unknown weight format 'int3'"):
        quantize_model(model, "int3")
    quantize_model(model, WeightFormat.INT4)
    assert {b.attn.qkv.mode for b in model.blocks} == {WeightFormat.INT8}


def test_one_weight_format_from_the_command_line_to_the_kernels(kernels):
    assert QUANTIZE_CHOICES == ("none", "bf16", "int8", "int4", "gguf")  # what users type
    assert [quantize_format(c) for c in QUANTIZE_CHOICES] == [
        WeightFormat.FP32, WeightFormat.BF16, WeightFormat.INT8, WeightFormat.INT4,
        WeightFormat.FP32]  # gguf: float32 for the layers not kept in GGUF blocks
    assert [f.value for f in WeightFormat] == list(kernels.WeightFormat.__members__)  # by name
    with pytest.raises(ValueError, match="^quantize: choose one of none, bf16, int8, int4, gguf"):
        quantize_format("q4")
    layer = QuantizedLinear.from_weight(torch.randn(4, 32), "int4")
    assert layer.mode is WeightFormat.INT4


def test_load_and_the_cli_convert_once(tmp_path, capsys):
    import json

    from glassformer import load
    from glassformer.cli import main
    from glassformer.formats.checkpoint import write_checkpoint
    from glassformer.formats.tokenizers import CharTokenizer

    config = get_preset("tiny-llama")
    tokenizer = CharTokenizer.train("".join(chr(c) for c in range(32, 127)))
    model = Transformer(config.replace(vocab_size=tokenizer.vocab_size))
    folder = write_checkpoint(tmp_path / "ckpt", model, tokenizer, {})
    assert isinstance(load(folder).model.lm_head, torch.nn.Linear)  # default: reference layers
    for mode in ("int8", "int4"):
        converted = load(folder, quantize=mode).model
        assert {b.mlp.down.mode for b in converted.blocks} == {mode}
    with pytest.raises(ValueError, match="quantize='gguf' applies to GGUF files only"):
        load(folder, quantize="gguf")
    with pytest.raises(ValueError, match="^quantize: choose one of"):
        load(folder, quantize="int3")
    assert main(["generate", "--model", str(folder), "Hi", "-n", "3", "--quantize", "int8",
                 "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_generated"] == 3


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_tall_matrix_is_quantized_by_rows_as_a_whole(mode):
    weight = torch.randn(9000, 64, generator=torch.Generator().manual_seed(0))  # three row blocks
    whole = {"int8": quantize_int8, "int4": quantize_int4}[mode](weight)
    layer = QuantizedLinear.from_weight(weight, mode)
    for got, expected in zip(layer.blocks(), whole, strict=True):
        assert torch.equal(got, expected)


def test_quantize_model_frees_each_float_layer_once_converted():
    import weakref

    config = get_preset("tiny-llama").replace(d_model=64, d_ff=96, vocab_size=128, n_layers=3)
    model = Transformer(config)
    weights = [weakref.ref(block.mlp.up.weight) for block in model.blocks]
    freed = []
    original = QuantizedLinear.from_linear.__func__

    def convert(cls, layer, mode, backend="auto"):
        freed.append([w() is None for w in weights])
        return original(cls, layer, mode, backend)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QuantizedLinear, "from_linear", classmethod(convert))
        quantize_model(model, "int8")
    up = [name for name in model.linear_layers() if name.endswith("mlp.up")]
    order = list(model.linear_layers())
    at_last = freed[order.index(up[-1])]  # when the last block's up is converted
    assert at_last[:-1] == [True, True] and all(w() is None for w in weights)
