"""GGUF export: a tiny Llama written in each format and read back by Glassformer's loader and
by transformers' GGUF loader (the oracle), against the model it came from; the command's
refusals; SmolLM2 through f32 and back (slow)."""

from __future__ import annotations

import json
from copy import deepcopy

import pytest
import torch
from gguf import GGUFReader
from gguf.quants import GGMLQuantizationType, dequantize, quantize
from llama_folder import TEXT, chat_llama_folder

from glassformer.cli import main
from glassformer.formats.gguf import load_gguf
from glassformer.formats.gguf_export import export_gguf
from glassformer.formats.huggingface import load_hf
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.presets import get_preset
from glassformer.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
TYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
# largest logit difference against the float32 model, relative to its largest logit (4-bit
# rounding moves this random model's logits as much as they are large: q4_0 is checked
# against the rounded model alone)
TOLERANCE = {"f32": 1e-6, "f16": 1e-2, "q8_0": 0.1}


def rounded(model: Transformer, dtype: str) -> Transformer:
    """The model with every matrix rounded through the format by gguf's own quantize and
    dequantize: what the file should compute."""
    copy = deepcopy(model)
    qtype = GGMLQuantizationType[TYPES[dtype]]
    with torch.no_grad():
        for p in copy.parameters():
            if p.dim() == 2:
                values = dequantize(quantize(p.numpy(), qtype), qtype)
                p.copy_(torch.from_numpy(values.reshape(p.shape)))
    return copy.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    chat_llama_folder(folder, TEMPLATE)
    model, tokenizer = load_hf(folder)
    ids = torch.tensor([tokenizer.encode(TEXT[:120])])
    with torch.no_grad():
        return folder, model, tokenizer, ids, model(ids)


@pytest.mark.parametrize("dtype", list(TYPES))
def test_round_trip_through_both_loaders(tiny, tmp_path, dtype):
    _, model, tokenizer, ids, reference = tiny
    path = export_gguf(model, tokenizer, tmp_path / "tiny.gguf", dtype)
    matrices = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2}
    assert set(matrices.values()) == {TYPES[dtype]}

    ours, our_tokenizer = load_gguf(path)
    assert ours.config == model.config.replace(norm_eps=ours.config.norm_eps)
    assert our_tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    assert our_tokenizer.chat_template == TEMPLATE and our_tokenizer.eos_id == tokenizer.eos_id
    with torch.no_grad():
        logits, expected = ours(ids), rounded(model, dtype)(ids)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    if dtype in TOLERANCE:
        assert (logits - reference).abs().max() <= TOLERANCE[dtype] * reference.abs().max()

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = theirs(ids).logits
    torch.testing.assert_close(hf, logits, atol=1e-4, rtol=1e-4)  # the same file read alike


def test_command_writes_once_and_refuses_without_force(tiny, tmp_path, capsys):
    folder = tiny[0]
    out = tmp_path / "model.gguf"
    assert main(["export", "--model", str(folder), "--to", "gguf", "--dtype", "q8_0", str(out),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == ["model.gguf"]
    written = out.read_bytes()
    cases = [
        ([str(out)], "exists (pass --force"),
        (["--dtype", "q5_k", str(tmp_path / "new.gguf")], "dtype: unknown 'q5_k'"),
        (["--output", str(out), str(out)], "output: give where to write once"),
    ]
    for args, message in cases:
        code = main(["export", "--model", str(folder), "--to", "gguf", *args])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert out.read_bytes() == written and not (tmp_path / "new.gguf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # no temporary left
    assert main(["export", "--model", str(folder), "--to", "gguf", str(out), "--force"]) == 0
    assert out.read_bytes() != written


def test_a_model_gguf_cannot_describe_is_refused(tiny, tmp_path):
    model = Transformer(get_preset("tiny-gpt2").replace(vocab_size=tiny[1].config.vocab_size))
    with pytest.raises(ValueError, match="position: 'learned' cannot be exported to GGUF "
                       r"\(a llama GGUF file says 'rope'\)"):
        export_gguf(model, tiny[2], tmp_path / "gpt2.gguf")
    with pytest.raises(ValueError, match="dtype: unknown 'int3'"):
        export_gguf(tiny[1], tiny[2], tmp_path / "x.gguf", "int3")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_smollm2_round_trip_through_f32_keeps_greedy_tokens(smollm2_path, tmp_path):
    model, tokenizer = load_gguf(smollm2_path)
    path = export_gguf(model, tokenizer, tmp_path / "smollm2-f32.gguf", "f32")
    again, again_tokenizer = load_gguf(path)
    assert again_tokenizer.chat_template == tokenizer.chat_template
    config = GenerationConfig(max_new_tokens=24)
    prompt = tokenizer.encode("The meaning of life is")
    assert generate(again, prompt, config).generated_ids == \
        generate(model, prompt, config).generated_ids
