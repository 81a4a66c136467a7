"""Corrupt models in every format: each is refused at load with one line naming the file and
the problem, never used to print nonsense."""

from __future__ import annotations

import json
import math
import shutil
import struct
import warnings

import gguf
import numpy as np
import pytest
import torch
from hostile_helpers import checkpoint_folder, hf_folder, write_gguf
from safetensors.torch import load_file, save_file

from glassformer.formats import hub
from glassformer.formats.gguf import load_gguf
from glassformer.formats.gguf_file import GGUFFile
from glassformer.formats.validate import WeightWarning

V = gguf.GGUFValueType
SMOL = "smollm2-135m-instruct"


def _generate(model, *extra):
    return ["generate", "--model", model, "hello", "-n", "2", *extra]


META = {
    "head_count 0": ({"llama.attention.head_count": (0, V.UINT32)}, "head_count = 0"),
    "embedding_length 0": ({"llama.embedding_length": (0, V.UINT32)}, "embedding_length"),
    "block_count 0": ({"llama.block_count": (0, V.UINT32)}, "block_count"),
    "block_count 3": ({"llama.block_count": (3, V.UINT32)}, "missing tensor blk.2"),
    "context_length 0": ({"llama.context_length": (0, V.UINT32)}, "context_length"),
    "feed_forward_length 0": ({"llama.feed_forward_length": (0, V.UINT32)}, "feed_forward_length"),
    "head_count_kv 3": ({"llama.attention.head_count_kv": (3, V.UINT32)}, "n_kv_heads"),
    "head_count_kv missing": ({"llama.attention.head_count_kv": (None, V.UINT32)}, "shape"),
    "rope base nan": ({"llama.rope.freq_base": (math.nan, V.FLOAT32)}, "freq_base"),
    "rope base negative": ({"llama.rope.freq_base": (-1.0, V.FLOAT32)}, "freq_base"),
    "rms eps inf": ({"llama.attention.layer_norm_rms_epsilon": (math.inf, V.FLOAT32)},
                    "layer_norm_rms_epsilon"),
    "rms eps 0": ({"llama.attention.layer_norm_rms_epsilon": (0.0, V.FLOAT32)}, "epsilon"),
    "rms eps missing": ({"llama.attention.layer_norm_rms_epsilon": (None, V.FLOAT32)}, "lacks"),
    "eos beyond vocab": ({"tokenizer.ggml.eos_token_id": (10 ** 6, V.UINT32)}, "eos_token_id"),
    "bos beyond vocab": ({"tokenizer.ggml.bos_token_id": (128, V.UINT32)}, "bos_token_id"),
    "eos a string": ({"tokenizer.ggml.eos_token_id": ("1", V.STRING)}, "eos_token_id"),
    "token types short": ({"tokenizer.ggml.token_type": ([1, 1], V.ARRAY)}, "token_type"),
    "tokenizer t5": ({"tokenizer.ggml.model": ("t5", V.STRING)}, "unsupported GGUF tokenizer 't5'"),
    "sentencepiece without scores": ({"tokenizer.ggml.model": ("llama", V.STRING)}, "scores"),
    "pre-tokenizer unknown": ({"tokenizer.ggml.pre": ("klingon", V.STRING)}, "pre-tokenizer"),
    "no vocabulary": ({"tokenizer.ggml.tokens": (None, V.ARRAY)}, "vocabulary"),
    "short vocabulary": ({"tokenizer.ggml.tokens": (["a", "b"], V.ARRAY),
                          "tokenizer.ggml.token_type": ([1, 1], V.ARRAY),
                          "tokenizer.ggml.bos_token_id": (0, V.UINT32),
                          "tokenizer.ggml.eos_token_id": (1, V.UINT32)}, "merges"),
    "merge outside the vocabulary": ({"tokenizer.ggml.merges": (["q z"], V.ARRAY)}, "merges"),
    "template a number": ({"tokenizer.chat_template": (7, V.UINT32)}, "chat_template"),
    "alignment 3": ({"general.alignment": (3, V.UINT32)}, "alignment"),
}


@pytest.mark.parametrize("case", list(META))
def test_gguf_metadata_out_of_range(case, tmp_path, refused):
    meta, message = META[case]
    path = write_gguf(tmp_path / "m.gguf", meta=meta)
    line = refused(_generate(path), message, path)
    assert str(path) in line


def _with(name, change):
    def tensors(model_sd):
        return {name: change(model_sd[name].copy())}
    return tensors


def _poke(index, value):
    def change(w):
        w.reshape(-1)[index] = value
        return w
    return change


TENSORS = {
    "nan in a norm gain": ("blk.0.attn_norm.weight", _poke(3, np.nan)),
    "inf in the final norm": ("output_norm.weight", _poke(0, np.inf)),
    "-inf in the embedding": ("token_embd.weight", _poke(100, -np.inf)),
    "nan in the head": ("output.weight", _poke(-1, np.nan)),
    "nan in W_Q": ("blk.1.attn_q.weight", _poke(5, np.nan)),
    "nan in W_down": ("blk.1.ffn_down.weight", _poke(7, np.nan)),
    "all nan gate": ("blk.0.ffn_gate.weight", lambda w: w * np.nan),
}


def _gguf_weights(tmp_path, name, change):
    plain = GGUFFile(write_gguf(tmp_path / "plain.gguf"))
    stored = np.array(plain.raw(name)).reshape(plain.tensors[name].shape)
    plain.close()
    return write_gguf(tmp_path / "bad.gguf", tensors={name: change(stored)})


@pytest.mark.parametrize("case", list(TENSORS))
def test_gguf_non_finite_weights_are_refused_naming_the_tensor(case, tmp_path, refused):
    name, change = TENSORS[case]
    path = _gguf_weights(tmp_path, name, change)
    refused(_generate(path), f"tensor {name} holds", path)


@pytest.mark.parametrize("case", ["nan in a norm gain", "nan in W_down"])
def test_gguf_non_finite_weights_refused_by_export_too(case, tmp_path, refused):
    name, change = TENSORS[case]
    path = _gguf_weights(tmp_path, name, change)
    refused(["export", "--model", path, "-o", tmp_path / "hf"], name, path)
    assert not (tmp_path / "hf").exists()


def test_gguf_integer_tensor_is_not_cast_to_float(tmp_path, refused):
    path = write_gguf(tmp_path / "i.gguf",
                      tensors={"blk.0.ffn_norm.weight": np.ones(32, dtype=np.int32)})
    refused(_generate(path), "unsupported quantization type I32 (tensor blk.0.ffn_norm.weight)", path)


def test_absurd_magnitude_is_a_warning_naming_the_tensor(tmp_path):
    path = _gguf_weights(tmp_path, "blk.0.ffn_down.weight", lambda w: w / abs(w).max() * 1e5)
    with pytest.warns(WeightWarning, match="blk.0.ffn_down.weight reaches 1e\\+05, above 1000"):
        load_gguf(path)


def test_large_trained_norm_gains_load_without_a_warning(tmp_path):
    """Gemma 3's post-feed-forward norms reach 1.19e3: a norm's gain has no bound that holds
    across families, so none is warned about."""
    path = _gguf_weights(tmp_path, "blk.0.ffn_norm.weight", lambda w: w * 0 + 1.19e3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_gguf(path)


def test_a_plain_file_loads_without_warnings(gguf_file):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_gguf(gguf_file)


CUTS = [4, 16, 24, 100, 0.05, 0.2, 0.5, 0.8, 0.95, -1]


@pytest.mark.parametrize("cut", CUTS)
def test_truncated_gguf_says_truncated(cut, gguf_file, tmp_path, refused):
    data = gguf_file.read_bytes()
    n = cut if isinstance(cut, int) and cut > 0 else len(data) + cut if cut < 0 else int(len(data) * cut)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    refused(_generate(path), "truncated", path)


HEADER = {
    "bad magic": (0, b"GGML", "not a GGUF file"),
    "version 99": (4, struct.pack("<I", 99), "unsupported GGUF version 99"),
    "tensor count huge": (8, struct.pack("<Q", 1 << 60), "truncated or corrupt"),
    "metadata count huge": (16, struct.pack("<Q", 1 << 62), "truncated or corrupt"),
}


@pytest.mark.parametrize("case", list(HEADER))
def test_gguf_header_damage(case, gguf_file, tmp_path, refused):
    offset, patch, message = HEADER[case]
    data = bytearray(gguf_file.read_bytes())
    data[offset:offset + len(patch)] = patch
    path = tmp_path / "h.gguf"
    path.write_bytes(bytes(data))
    refused(_generate(path), message, path)


@pytest.mark.parametrize("case", ["empty", "random", "text", "dev-zero", "dev-null", "empty-dir",
                                  "missing"])
def test_things_that_are_not_models(case, tmp_path, refused):
    path = {"dev-zero": "/dev/zero", "dev-null": "/dev/null"}.get(case, tmp_path / case)
    if case == "empty":
        path.write_bytes(b"")
    elif case == "random":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif case == "text":
        path.write_text("GGUF is a format", encoding="utf-8")
    elif case == "empty-dir":
        path.mkdir()
    message = {"dev-zero": "not a regular file", "dev-null": "not a regular file",
               "missing": "no model at", "empty-dir": "no glassformer checkpoint"}
    refused(_generate(path), message.get(case, ""), tmp_path)


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "model")


def _config_edit(change):
    def edit(folder):
        path = folder / "config.json"
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return edit


def _write(name, data):
    return lambda folder: (folder / name).write_bytes(data)


def _tensors(change):
    def edit(folder):
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors")
    return edit


def _set(name, value):
    def change(tensors):
        tensors[name] = value(tensors[name])
    return change


HF = {
    "config a list": (_write("config.json", b"[]"), "config.json: expected a JSON object"),
    "config not JSON": (_write("config.json", b"{"), "config.json: not valid JSON"),
    "config not UTF-8": (_write("config.json", b'{"model_type": "\xfe"}'), "not valid UTF-8"),
    "lacks hidden_size": (_config_edit(lambda c: {k: v for k, v in c.items() if k != "hidden_size"}),
                          "lacks 'hidden_size'"),
    "heads zero": (_config_edit(lambda c: c | {"num_attention_heads": 0}), ""),
    "vocab smaller than the tokenizer": (_config_edit(lambda c: c | {"vocab_size": 100}),
                                         "do not belong together"),
    "nan weight": (_tensors(_set("model.norm.weight", lambda t: t * math.nan)), "model.norm.weight"),
    "inf weight": (_tensors(_set("model.layers.0.mlp.down_proj.weight",
                                 lambda t: t.index_fill(0, torch.tensor([0]), math.inf))),
                   "model.layers.0.mlp.down_proj.weight"),
    "integer weight": (_tensors(_set("model.layers.1.input_layernorm.weight",
                                     lambda t: t.to(torch.int32))), "torch.int32"),
    "truncated weights": (lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:5000]), "truncated"),
    "index a list": (_write("model.safetensors.index.json", b"[]"), "expected a JSON object"),
    "index without map": (_write("model.safetensors.index.json", b"{}"), "weight_map"),
    "tokenizer a list": (_write("tokenizer.json", b"[]"), ""),
    "tokenizer garbage": (_write("tokenizer.json", b'{"model": 5}'), "tokenizer"),
    "tokenizer config a list": (_write("tokenizer_config.json", b"[1]"), "tokenizer_config.json"),
    "model_type unknown": (_config_edit(lambda c: c | {"model_type": "xlnet"}), "unsupported model_type"),
}


@pytest.mark.parametrize("case", list(HF))
def test_hugging_face_folder_damage(case, hf_source, tmp_path, refused):
    edit, message = HF[case]
    folder = tmp_path / "hf"
    shutil.copytree(hf_source, folder)
    edit(folder)
    refused(_generate(folder), message, folder)


CHECKPOINT = {
    "config a list": (_write("config.json", b"[]"), "expected a JSON object"),
    "config lacks model": (_write("config.json", b"{}"), 'has no "model_type"'),
    "model lacks fields": (_write("config.json", b'{"model": {"d_model": 16}}'),
                           "required ModelConfig field"),
    "nan weight": (_tensors(_set("final_norm.weight", lambda t: t * math.nan)), "final_norm.weight"),
    "inf weight": (_tensors(_set("embed.tokens.weight", lambda t: t.fill_(math.inf))),
                   "embed.tokens.weight"),
    "truncated weights": (lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:300]), "model.safetensors"),
    "tokenizer a list": (_write("tokenizer.json", b"[]"), "tokenizer.json: expected a JSON object"),
    "tokenizer not UTF-8": (_write("tokenizer.json", b'{"type": "char", "chars": "\xff"}'),
                            "not valid UTF-8"),
    "char tokenizer without chars": (_write("tokenizer.json", b'{"type": "char"}'), "chars"),
    "tokenizer larger than the model": (
        _write("tokenizer.json", json.dumps({"type": "char", "chars": "".join(
            chr(c) for c in range(32, 400))}).encode()), "do not belong together"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT))
def test_checkpoint_damage(case, tmp_path, refused):
    edit, message = CHECKPOINT[case]
    folder = checkpoint_folder(tmp_path / "ckpt")
    edit(folder)
    refused(_generate(folder), message, folder)


TEMPLATES = {
    "syntax error": ("{% for m in messages %}", "syntax error"),
    "unsafe attribute": ("{{ messages.__class__.__mro__ }}", "unsafe"),
    "unsafe call": ("{{ messages.append(1) }}", "unsafe"),
    "undefined call": ("{{ no_such_function() }}", "undefined"),
    "raises": ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    "loops forever": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                      "{% endfor %}", "took over"),
    "huge output": ("{{ 'x' * 100000000 }}", "characters"),
    "huge loop output": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "characters"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    "division by zero": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "huge power": ("{{ 10 ** 100000000 }}", "exponent"),
}


@pytest.mark.parametrize("case", list(TEMPLATES))
def test_chat_templates_that_fail_are_one_line_within_seconds(case, tmp_path, refused):
    template, message = TEMPLATES[case]
    path = write_gguf(tmp_path / "t.gguf", meta={"tokenizer.chat_template": (template, V.STRING)})
    refused(_generate(path, "--chat"), message, path, seconds=8)


@pytest.fixture
def smol_copy(tmp_path, monkeypatch):
    """A copy of the real SmolLM2 file in a private cache (the shared one is never touched)."""
    source = hub.cached_path(SMOL)
    if source is None:
        pytest.skip("SmolLM2 is not pulled")
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path / "home"))
    target = hub.models_dir() / source.name
    target.parent.mkdir(parents=True)
    shutil.copyfile(source, target)
    return target


@pytest.mark.slow
@pytest.mark.parametrize("where", [0.3, 0.6, 0.95])
def test_a_damaged_known_model_is_refused_by_name(where, smol_copy, refused):
    with open(smol_copy, "r+b") as f:
        f.seek(int(smol_copy.stat().st_size * where))
        f.write(bytes(64))  # 64 bytes that every value check would accept
    line = refused(_generate(SMOL), "damaged", smol_copy.parent.parent)
    assert f"glassformer pull {SMOL}" in line


@pytest.mark.slow
def test_a_known_model_is_hashed_once_per_change(smol_copy):
    import time

    assert hub.cached_path(SMOL) == smol_copy  # hashed, verdict recorded
    start = time.perf_counter()
    for _ in range(10):
        hub.cached_path(SMOL)
    assert time.perf_counter() - start < 0.05  # the verdict is reused: no hashing
    with open(smol_copy, "r+b") as f:  # same size, new contents
        f.seek(1 << 20)
        f.write(b"\x00" * 8)
    with pytest.raises(ValueError, match="damaged"):
        hub.cached_path(SMOL)


@pytest.mark.slow
@pytest.mark.parametrize("tensor", ["blk.7.attn_norm.weight", "output_norm.weight"])
def test_real_model_with_a_nan_norm_gain(tensor, smol_copy, tmp_path, refused):
    with GGUFFile(smol_copy) as file:
        offset = file.tensors[tensor].offset
    path = tmp_path / "nan.gguf"
    shutil.copyfile(smol_copy, path)
    with open(path, "r+b") as f:
        f.seek(offset + 4 * 5)
        f.write(struct.pack("<f", math.nan))
    refused(_generate(path), f"tensor {tensor} holds 1 non-finite", path)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [1000, 1_500_000, 50_000_000])
def test_real_model_truncated(keep, smol_copy, tmp_path, refused):
    path = tmp_path / "cut.gguf"
    with open(smol_copy, "rb") as src:
        path.write_bytes(src.read(keep))
    refused(_generate(path), "truncated", path)


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [[], ["--quantize", "gguf"]])
def test_real_model_with_a_nan_block_scale(quantize, smol_copy, tmp_path, refused):
    tensor = "blk.3.ffn_down.weight"
    with GGUFFile(smol_copy) as file:
        info = file.tensors[tensor]
    assert info.qtype.name in ("Q4_0", "Q4_1", "Q8_0")  # every block starts with its fp16 scale
    path = tmp_path / "nan.gguf"
    shutil.copyfile(smol_copy, path)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        f.write(np.float16(np.nan).tobytes())
    refused(_generate(path, *quantize), "non-finite", path)


def _adapter(tmp_path, base, change):
    """A rank-2 PEFT adapter on q and down of every layer of `base` (LLAMA), `change`d."""
    from glassformer.formats.peft import write_adapter

    torch.manual_seed(1)
    d_in = {"q": 32, "down": 64}  # d_model, d_ff; both write d_model = 32 rows
    tensors = {(i, t): (torch.randn(2, d_in[t]) * 0.1, torch.randn(32, 2) * 0.1)
               for i in range(2) for t in d_in}
    change(tensors)
    folder = tmp_path / "adapter"
    folder.mkdir()
    write_adapter(folder, tensors, 2, 4.0, 0.0, ("q", "down"), str(base))
    return folder


def _nan_q(tensors):
    tensors[(0, "q")] = (torch.full((2, 32), math.nan), tensors[(0, "q")][1])


def _huge(tensors):  # finite factors whose product overflows float32
    tensors[(1, "down")] = (torch.full((2, 64), 1e30), torch.full((32, 2), 1e30))


@pytest.mark.parametrize("command", ["generate", "export-gguf", "export-hf"])
def test_a_non_finite_lora_adapter_is_refused_naming_the_tensor(command, tmp_path, refused):
    model = hf_folder(tmp_path / "hf")
    adapter = _adapter(tmp_path, model, _nan_q)
    argv = (_generate(model, "--lora", adapter) if command == "generate" else
            ["export", "--model", model, "--merge-lora", adapter, "--to", command[7:],
             tmp_path / "out"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy cast warning on the way
        refused(argv, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["gguf", "hf"])
def test_a_merge_that_overflows_is_refused_naming_the_weight(to, tmp_path, refused):
    model = hf_folder(tmp_path / "hf")
    adapter = _adapter(tmp_path, model, _huge)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WeightWarning)  # 1e30 is far beyond a trained factor
        refused(["export", "--model", model, "--merge-lora", adapter, "--to", to, tmp_path / "out"],
                "blocks.1.mlp.down.weight", tmp_path)
    assert not (tmp_path / "out").exists()


def test_export_refuses_to_write_a_non_finite_weight(tmp_path):
    from glassformer.formats.export import export_hf
    from glassformer.formats.gguf_export import export_gguf

    torch.manual_seed(0)
    model, tokenizer = load_gguf(write_gguf(tmp_path / "m.gguf"))
    with torch.no_grad():
        model.blocks[0].norm1.weight[3] = math.inf
    for write, out in ((export_gguf, tmp_path / "x.gguf"), (export_hf, tmp_path / "x")):
        with pytest.raises(ValueError, match="blocks.0.norm1.weight holds 1 non-finite"):
            write(model, tokenizer, out)
        assert not out.exists()
