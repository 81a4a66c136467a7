"""Llama 3.1's RoPE bands in GGUF as llama.cpp keeps them: the tensor rope_freqs.weight (one
divisor of θ_i per turning pair, no metadata). The divisors against transformers' own bands;
the fields read back from them; a tiny Llama 3.1 in transformers (the oracle), exported by
Glassformer and converted by llama.cpp's convert_hf_to_gguf.py, computing transformers' logits
past the original context; a tensor that is not such bands refused by name."""

from __future__ import annotations

import shutil
import string
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_cpp_source import converter
from llama_folder import TEXT
from tokenizers import Tokenizer, decoders, models, normalizers

from glassformer.cli import main
from glassformer.formats.gguf import config_from_metadata, load_gguf
from glassformer.formats.gguf_export import export_gguf, gguf_metadata
from glassformer.formats.gguf_file import GGUFFile
from glassformer.formats.gguf_rope import (
    DIVISOR_TOLERANCE,
    ROPE_FREQS,
    factor_tensors,
    llama3_divisors,
    llama3_fields,
)
from glassformer.formats.huggingface import load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.model.config import ModelConfig
from glassformer.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
VOCAB = 300
SPACE = "\u2581"  # SentencePiece's written space
# base 100 on 16 dimensions: λ_i = 2π·100^(i/8). With C = 32, low 1 and high 4: pair 0 is kept
# (λ < 8), pairs 1 and 2 lie in the smooth band (8 .. 32), pairs 3 to 7 are slowed 8 times
BANDS = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32}
LENGTH = 100  # tokens: well past the original context
CONFIG = ModelConfig(vocab_size=VOCAB, context_length=256, d_model=64, n_layers=2, n_heads=4,
                     n_kv_heads=2, d_ff=64, position="rope", rope_theta=100.0, norm="rmsnorm",
                     activation="silu", gated=True, tie_embeddings=False, attn_bias=False,
                     attn_out_bias=False, mlp_bias=False, rope_scaling="llama3",
                     rope_factor=8.0, rope_original_context=32)


def transformers_divisors(theta: float, d_head: int, bands: dict) -> np.ndarray:
    """θ_i over transformers' Llama 3.1 θ_i: what llama.cpp divides by (the oracle)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=4 * d_head, num_attention_heads=4, head_dim=d_head,
                                      rope_theta=theta, rope_scaling=bands)
    scaled = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].double()  # (d_head/2,)
    plain = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head)
    return (plain.double() / scaled).numpy()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama 3.1 saved by transformers (bands above), with a byte-level BPE tokenizer."""
    folder = tmp_path_factory.mktemp("llama3")
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=100.0, rope_scaling=BANDS, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    HFTokenizer.train_bpe([TEXT] * 4, VOCAB).save(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def oracle(folder):
    """Ids past the original context and transformers' logits for them."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return ids, model(ids).logits


def _bands(config: ModelConfig) -> tuple:
    return (config.rope_scaling, config.rope_factor, config.original_context,
            config.rope_low_freq_factor, config.rope_high_freq_factor)


@pytest.mark.parametrize("theta, d_head, original", [(100.0, 16, 32), (10000.0, 16, 32),
                                                     (500000.0, 128, 8192)])
def test_divisors_are_transformers_bands(theta, d_head, original):
    bands = BANDS | {"original_max_position_embeddings": original}
    ours = llama3_divisors(theta, d_head, 8.0, original, 1.0, 4.0)
    assert ours.dtype == np.float32 and ours.shape == (d_head // 2,)
    np.testing.assert_allclose(ours, transformers_divisors(theta, d_head, bands), rtol=1e-6)
    assert {1.0, 8.0} <= set(ours.tolist())  # kept and slowed pairs both present


@settings(max_examples=60, deadline=None)
@given(theta=st.floats(50.0, 1e6), d_head=st.sampled_from([8, 16, 32, 64, 128]),
       factor=st.sampled_from([1.5, 2.0, 4.0, 8.0, 32.0]),
       original=st.sampled_from([16, 32, 100, 1024, 8192]))
def test_canonical_bands_read_back(theta, d_head, factor, original):
    """Low 1 and high 4 (every Llama 3.x): read back from the divisors alone, whatever the
    number of pairs in the smooth band; the exact fields wherever a pair is kept, one lies
    in the band and one is slowed by the whole factor (else the file does not say them all:
    the angles agree)."""
    theta = float(np.float32(theta))  # as a GGUF file stores it
    divisors = llama3_divisors(theta, d_head, factor, original, 1.0, 4.0)
    fields = llama3_fields(tuple(map(float, divisors)), theta, d_head)
    if divisors.max() == 1.0:  # every pair kept: no scaling at all
        assert fields == {}
        return
    again = llama3_divisors(theta, d_head, fields["rope_factor"], fields["rope_original_context"],
                            fields["rope_low_freq_factor"], fields["rope_high_freq_factor"])
    np.testing.assert_allclose(again, divisors, rtol=DIVISOR_TOLERANCE)
    smooth = (divisors > 1.0) & (divisors < np.float32(factor))
    if divisors.min() == 1.0 and divisors.max() == np.float32(factor) and smooth.any():
        assert fields == {"rope_scaling": "llama3", "rope_factor": factor, "rope_original_context": original,
                          "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0}


def test_other_bands_read_back_as_their_ratios():
    """low 2, high 16 over C = 8192 on Llama 3's dimensions: the same angles with low 1."""
    divisors = transformers_divisors(500000.0, 128, BANDS | {
        "low_freq_factor": 2.0, "high_freq_factor": 16.0, "original_max_position_embeddings": 8192})
    fields = llama3_fields(tuple(map(float, divisors.astype(np.float32))), 500000.0, 128)
    assert fields == {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_context": 4096,
                      "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 8.0}


def test_export_writes_the_tensor_and_computes_transformers_logits(folder, oracle, tmp_path):
    ids, expected = oracle
    model, tokenizer = load_hf(folder)
    assert _bands(model.config) == ("llama3", 8.0, 32, 1.0, 4.0)
    path = export_gguf(model, tokenizer, tmp_path / "ours.gguf")
    with GGUFFile(path) as file:
        assert not [key for key in file.metadata if ".rope.scaling." in key]  # as the converter
        info = file.tensors[ROPE_FREQS]
        assert (info.shape, info.qtype.name) == ((8,), "F32")
        written = file.raw(ROPE_FREQS)[0]
        np.testing.assert_allclose(written, transformers_divisors(100.0, 16, BANDS), rtol=1e-6)
    again, _ = load_gguf(path)
    assert again.config == model.config.replace(norm_eps=again.config.norm_eps)  # float32 in a file
    plain = Transformer(again.config.replace(rope_scaling="none")).eval()  # the same weights, no bands
    plain.load_state_dict(again.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again(ids), expected, rtol=1e-5, atol=1e-4)
        assert (plain(ids) - expected).abs().max() > 0.1  # so the bands are what is tested


def _byte_fallback_folder(folder, destination):
    """`folder`'s weights with a SentencePiece-style tokenizer.json (a BPE over ▁-marked text
    with byte fallback, VOCAB tokens: specials, the 256 byte tokens, ▁ and letters), which
    llama.cpp's converter reads for llama as it reads Llama 2's, without asking which
    pre-tokenizer a byte-level BPE is."""
    destination.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, destination / name)
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], SPACE,
              *string.ascii_lowercase, *string.ascii_uppercase[:14]]
    assert len(tokens) == VOCAB
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [], byte_fallback=True,
                                     unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.save(str(destination / "tokenizer.json"))
    return destination


def test_llama_cpp_converter_file(folder, oracle, tmp_path):
    """convert_hf_to_gguf.py's rope_freqs: read as the folder's bands, equal to the divisors
    export writes, and the file computes transformers' logits past the original context."""
    command = converter()
    source = _byte_fallback_folder(folder, tmp_path / "source")
    path = tmp_path / "converted.gguf"
    done = subprocess.run([*command, str(source), "--outtype", "f32", "--outfile", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    model, _ = load_gguf(path)
    assert _bands(model.config) == ("llama3", 8.0, 32, 1.0, 4.0)
    with GGUFFile(path) as file:
        theirs = np.array(file.raw(ROPE_FREQS)[0])
    np.testing.assert_allclose(factor_tensors(model.config)[ROPE_FREQS], theirs, rtol=DIVISOR_TOLERANCE)
    ids, expected = oracle
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-4)


def _read(divisors, arch_config: ModelConfig = CONFIG, **meta):
    """config_from_metadata of a llama file of CONFIG's shape holding `divisors` as rope_freqs."""
    metadata = gguf_metadata(arch_config.replace(rope_scaling="none", rope_factor=1.0,
                                                 rope_original_context=None)) | meta
    tensors = {"token_embd.weight": type("Info", (), {"shape": (VOCAB, 64)})}
    return config_from_metadata(metadata, tensors, {ROPE_FREQS: tuple(map(float, divisors))})


def test_what_is_not_llama3_bands_is_refused_by_name():
    divisors = factor_tensors(CONFIG)[ROPE_FREQS]
    assert _bands(_read(divisors)) == _bands(CONFIG)
    assert _read(np.ones(8)).rope_scaling == "none"  # no pair slowed
    for wrong, says in [(divisors[:6], "expected 8 divisors"),
                        (divisors * 0.5, "of at least 1, got 8 from 0.5 to 4"),
                        (divisors[::-1], "is not Llama 3.1's bands"),
                        (np.array([1, 1.2, 1.3, 1.6, 8, 8, 8, 8]), "is not Llama 3.1's bands"),
                        (divisors * np.float32(1.001), "is not Llama 3.1's bands")]:
        with pytest.raises(ValueError, match=f"GGUF tensor {ROPE_FREQS}.*{says}"):
            _read(wrong)
    with pytest.raises(ValueError, match=f"{ROPE_FREQS} with another RoPE scaling"):
        _read(divisors, **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    with pytest.raises(ValueError, match=f"unexpected GGUF tensor {ROPE_FREQS} in a qwen2 file"):
        _read(divisors, CONFIG.replace(attn_bias=True))


def test_export_refuses_bands_a_qwen2_file_cannot_hold(folder, tmp_path):
    model, tokenizer = load_hf(folder)
    qwen = type(model)(model.config.replace(attn_bias=True)).eval()
    with pytest.raises(ValueError, match=f"GGUF export: unexpected GGUF tensor {ROPE_FREQS}"):
        export_gguf(qwen, tokenizer, tmp_path / "qwen.gguf")


def test_command_names_a_bad_tensor_in_one_line(folder, tmp_path, capsys):
    model, tokenizer = load_hf(folder)
    path = export_gguf(model, tokenizer, tmp_path / "ours.gguf")
    with GGUFFile(path) as file:
        offset = file.tensors[ROPE_FREQS].offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 32] = np.linspace(1.0, 3.0, 8, dtype=np.float32).tobytes()  # no bands
    path.write_bytes(bytes(data))
    assert main(["generate", "--model", str(path), "-n", "1", "a"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glassformer: error:") and ROPE_FREQS in err and "\n" not in err
