"""GGUF loading on tiny files written with the `gguf` package, in every supported tensor type;
transformers reading the same file is the oracle for the forward pass. Plus bad files."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from glassformer import ModelConfig, Transformer
from glassformer.formats.gguf import load_gguf, unpermute_rows
from glassformer.formats.gguf_file import GGUFFile
from glassformer.formats.tokenizers import HFTokenizer

Q = gguf.GGMLQuantizationType
VOCAB = 300
CONFIG = ModelConfig(vocab_size=VOCAB, context_length=64, d_model=256, n_layers=2, n_heads=4,
                     n_kv_heads=2, d_ff=256, position="rope", rope_theta=5000.0, norm="rmsnorm",
                     activation="silu", gated=True, attn_bias=False, attn_out_bias=False,
                     mlp_bias=False, tie_embeddings=False, init_std=0.1)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n" \
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to W_Q and W_K (rows (half, i) -> (i, half) per head)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def hf_weights(model: Transformer) -> dict[str, np.ndarray]:
    """GGUF tensor name -> weight in the original (Hugging Face) row order."""
    c, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    H, KV, ff = c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.ff_dim
    out = {"token_embd.weight": sd["embed.tokens.weight"], "output.weight": sd["lm_head.weight"],
           "output_norm.weight": sd["final_norm.weight"]}
    for i in range(c.n_layers):
        qkv, up = sd[f"blocks.{i}.attn.qkv.weight"], sd[f"blocks.{i}.mlp.up.weight"]
        out |= {f"blk.{i}.attn_q.weight": qkv[:H], f"blk.{i}.attn_k.weight": qkv[H:H + KV],
                f"blk.{i}.attn_v.weight": qkv[H + KV:], f"blk.{i}.ffn_gate.weight": up[:ff],
                f"blk.{i}.ffn_up.weight": up[ff:],
                f"blk.{i}.attn_output.weight": sd[f"blocks.{i}.attn.out.weight"],
                f"blk.{i}.ffn_down.weight": sd[f"blocks.{i}.mlp.down.weight"],
                f"blk.{i}.attn_norm.weight": sd[f"blocks.{i}.norm1.weight"],
                f"blk.{i}.ffn_norm.weight": sd[f"blocks.{i}.norm2.weight"]}
    return out


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    """Stored bytes of a tensor: 1-D norms stay F32; types gguf cannot quantize (K-quants)
    get random blocks whose fp16 fields are all finite (every byte < 0x3C)."""
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), Q.F32
    if qtype not in QUANTIZABLE:
        shape = gguf.quants.quant_shape_to_byte_shape(w.shape, qtype)
        return rng.integers(0, 0x3C, shape, dtype=np.uint8), qtype
    return quantize(w, qtype), qtype


def write_gguf(path, weights, qtype=Q.F32, arch="llama", omit=(), overrides=None, seed=0,
               rope_scaling=None):
    """A GGUF file as llama.cpp's converter writes it; returns {name: (stored, type)}.
    `rope_scaling`: `<arch>.rope.scaling.*` values (the type a string, the rest float32)."""
    c, rng = CONFIG, np.random.default_rng(seed)
    tok = json.loads(HFTokenizer.train_bpe(["the quick brown fox jumps over a lazy dog"] * 9,
                                           VOCAB).tokenizer.to_str())
    vocab = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    vocab += ["<|im_start|>", "<|im_end|>"]
    vocab += [f"<|unused{i}|>" for i in range(VOCAB - len(vocab))]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": c.n_layers, "context_length": c.context_length,
                       "embedding_length": c.d_model, "feed_forward_length": c.ff_dim,
                       "attention.head_count": c.n_heads, "attention.head_count_kv": c.kv_heads,
                       "rope.dimension_count": c.head_dim}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_rope_freq_base(c.rope_theta)
    for key, value in (rope_scaling or {}).items():
        if key == "type":
            writer.add_rope_scaling_type(gguf.RopeScalingType(value))
        elif key == "original_context_length":
            writer.add_rope_scaling_orig_ctx_len(value)
        else:
            writer.add_float32(f"{arch}.rope.scaling.{key}", value)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if v.startswith("<|") else 1 for v in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab.index("<|im_start|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)
    stored = {}
    for name, w in weights.items():
        if name in omit:
            continue
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_cpp_permute(w, c.n_heads if "attn_q" in name else c.kv_heads)
        data, kind = encode(w, (overrides or {}).get(name, qtype), rng)
        writer.add_tensor(name, data, raw_dtype=None if kind == Q.F32 else kind)
        stored[name] = (data, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(0)
    return hf_weights(Transformer(CONFIG))


@pytest.fixture(scope="module")
def f32_file(source, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, source)
    return path


def test_header_matches_gguf_reader(f32_file):
    reader, ours = gguf.GGUFReader(f32_file), GGUFFile(f32_file)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    for t in reader.tensors:
        assert np.array_equal(ours.raw(t.name).ravel(), t.data.ravel()), t.name


def test_config_and_tokenizer(f32_file):
    model, tokenizer = load_gguf(f32_file)
    assert model.config.replace(norm_eps=CONFIG.norm_eps, init_std=CONFIG.init_std) == CONFIG
    text = "the lazy fox"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render_chat(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages)[0] == tokenizer.bos_id


def test_logits_match_transformers(f32_file):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        f32_file.parent, gguf_file=f32_file.name, dtype=torch.float32).eval()
    model, _ = load_gguf(f32_file)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_unpermute_inverts_the_converter():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 2), 2), w)


@pytest.mark.filterwarnings("ignore::glassformer.formats.validate.WeightWarning")  # random K-quant scales
@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda q: q.name)
def test_every_tensor_type(source, tmp_path, qtype):
    path = tmp_path / "q.gguf"
    stored = write_gguf(path, source, qtype)
    model, _ = load_gguf(path)
    got = hf_weights(model)
    c = CONFIG
    for name, (data, kind) in stored.items():
        expected = dequantize(data, kind).reshape(got[name].shape)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            expected = unpermute_rows(expected, c.n_heads if "attn_q" in name else c.kv_heads)
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


def _error(path, match):
    with pytest.raises(ValueError, match=match):
        load_gguf(path)


def test_unsupported_architecture(source, tmp_path):
    write_gguf(tmp_path / "a.gguf", source, arch="falcon")
    _error(tmp_path / "a.gguf", "unsupported GGUF architecture 'falcon'")


def test_unsupported_quantization(source, tmp_path):
    write_gguf(tmp_path / "q.gguf", source, overrides={"blk.0.ffn_up.weight": Q.Q8_1})
    _error(tmp_path / "q.gguf", "unsupported quantization type Q8_1")


def test_missing_tensor(source, tmp_path):
    write_gguf(tmp_path / "m.gguf", source, omit=("blk.1.ffn_down.weight",))
    _error(tmp_path / "m.gguf", "missing tensor blk.1.ffn_down.weight")


def test_wrong_shape(source, tmp_path):
    weights = dict(source) | {"blk.0.attn_v.weight": source["blk.0.attn_v.weight"][:64]}
    write_gguf(tmp_path / "s.gguf", weights)
    _error(tmp_path / "s.gguf", "blk.0.attn_v.weight has shape")


@pytest.mark.parametrize("keep", [0, 3, 100, 5000, -1000])
def test_truncated_file(f32_file, tmp_path, keep):
    data = f32_file.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    _error(path, "not a GGUF file|truncated|corrupt")


def test_corrupt_count_does_not_allocate(f32_file, tmp_path):
    data = bytearray(f32_file.read_bytes())
    data[16:24] = (2**62).to_bytes(8, "little")  # the metadata count
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    _error(path, "corrupt")


def test_not_a_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_blocks_kept_for_the_kernels(source, tmp_path, qtype, tied):
    from glassformer.accel import QuantizedLinear

    path = tmp_path / "k.gguf"
    write_gguf(path, source, qtype, omit=("output.weight",) if tied else ())
    exact, _ = load_gguf(path)
    compact, _ = load_gguf(path, keep_blocks=True)
    layers = [compact.blocks[0].attn.qkv, compact.blocks[1].mlp.up, compact.lm_head]
    assert all(isinstance(layer, QuantizedLinear) for layer in layers)
    for name, layer in compact.named_modules():  # the same weights, held in their blocks
        if isinstance(layer, QuantizedLinear):
            expected = exact.get_submodule(name).weight
            torch.testing.assert_close(layer.dequantized_weight(), expected, atol=0, rtol=0)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the kernels round activations to int8 per block: close only
        torch.testing.assert_close(compact(ids[:, :1]), exact(ids[:, :1]), atol=0.15, rtol=0.05)
        # twelve positions: each attends over rounded rows of the others, so the error adds up
        torch.testing.assert_close(compact(ids), exact(ids), atol=0.3, rtol=0.05)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_blocks_kept_hold_no_float_copy(source, tmp_path, qtype, tied):
    from glassformer.accel.quantized_embedding import QuantizedEmbedding

    path = tmp_path / "k.gguf"
    write_gguf(path, source, qtype, omit=("output.weight",) if tied else ())
    exact, _ = load_gguf(path)
    compact, _ = load_gguf(path, keep_blocks=True)
    assert compact.config.tie_embeddings == tied
    tensors = {id(t): (name, t) for name, t in [*compact.named_parameters(), *compact.named_buffers()]}
    floats = [name for name, t in tensors.values() if t.dtype == torch.float32 and t.dim() > 1]
    assert floats == []  # float32 holds norm gains and RoPE frequencies only
    held = sum(t.numel() * t.element_size() for _, t in tensors.values())
    stored = sum(info.n_bytes for info in GGUFFile(path).tensors.values())
    if qtype == Q.Q4_0:  # its minimum (-8 d) is held beside each block's scale: 2 bytes in 18
        stored += stored // 9
    rope = compact.rope_inv_freq  # the one tensor not read from the file
    assert held <= stored + rope.numel() * rope.element_size()  # each block once, none as float
    table = compact.embed.tokens
    assert isinstance(table, QuantizedEmbedding)
    assert (table.qweight.data_ptr() == compact.lm_head.qweight.data_ptr()) == tied
    ids = torch.tensor([[5, 0, VOCAB - 1], [7, 7, 3]])
    expected = exact.embed.tokens.weight
    torch.testing.assert_close(table(ids), expected[ids], atol=0, rtol=0)  # the rows, exactly
    torch.testing.assert_close(table.dequantized_weight(), expected, atol=0, rtol=0)
    assert table.weight.dtype == expected.dtype and table.weight.device == expected.device


def test_cli_reports_a_bad_file_in_one_line(f32_file, tmp_path, capsys):
    from glassformer.cli import main

    path = tmp_path / "cut.gguf"
    path.write_bytes(f32_file.read_bytes()[:-1000])
    assert main(["export", "--model", str(path), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glassformer: error:") and "truncated" in err and "\n" not in err


YARN = {"type": "yarn", "factor": 4.0, "original_context_length": 16, "yarn_beta_fast": 8.0,
        "yarn_beta_slow": 2.0}


def test_yarn_read_as_llama_cpp_writes_it(source, tmp_path):
    """YaRN under llama.cpp's keys: the factor, the original context and the betas; the
    attention factor stated by yarn_attn_factor (as llama.cpp's converter writes Hugging Face's
    attention_factor) or derived; what llama.cpp adds beyond transformers' YaRN is refused."""
    write_gguf(tmp_path / "yarn.gguf", source, rope_scaling=YARN)
    model, _ = load_gguf(tmp_path / "yarn.gguf")
    c = model.config
    assert (c.rope_scaling, c.rope_factor, c.original_context, c.rope_beta_fast, c.rope_beta_slow,
            c.rope_truncate, c.rope_attention_factor) == ("yarn", 4.0, 16, 8.0, 2.0, True, None)
    expected = Transformer(CONFIG.replace(rope_scaling="yarn", rope_factor=4.0, rope_original_context=16,
                                          rope_beta_fast=8.0, rope_beta_slow=2.0))
    expected.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected(ids))
    write_gguf(tmp_path / "stated.gguf", source, rope_scaling=YARN | {"yarn_attn_factor": 1.25})
    assert load_gguf(tmp_path / "stated.gguf")[0].config.rope_attention_factor == 1.25
    write_gguf(tmp_path / "log.gguf", source, rope_scaling=YARN | {"yarn_log_multiplier": 0.1})
    _error(tmp_path / "log.gguf", "unsupported GGUF llama.rope.scaling.yarn_log_multiplier")


def test_yarn_written_as_llama_cpp_reads_it(tmp_path):
    """export --to gguf writes YaRN under llama.cpp's keys and reads it back; transformers'
    GGUF reader takes no rope scaling for llama, so the oracle is the model the file came
    from (itself equal to transformers: test_loaders_hf)."""
    from glassformer.formats.gguf_export import export_gguf

    torch.manual_seed(2)
    config = CONFIG.replace(d_model=64, d_ff=64, rope_scaling="yarn", rope_factor=4.0,
                            rope_original_context=16, rope_beta_fast=16.0, rope_attention_factor=1.5)
    model = Transformer(config).eval()
    tokenizer = HFTokenizer.train_bpe(["the quick brown fox jumps over a lazy dog"] * 9, VOCAB)
    path = export_gguf(model, tokenizer, tmp_path / "yarn.gguf")
    fields = gguf.GGUFReader(path).fields
    written = {key.removeprefix("llama.rope.scaling."): fields[key].contents()
               for key in fields if key.startswith("llama.rope.scaling.")}
    assert written == {"type": "yarn", "factor": 4.0, "original_context_length": 16,
                       "yarn_beta_fast": 16.0, "yarn_beta_slow": 1.0, "yarn_attn_factor": 1.5}
    again, _ = load_gguf(path)
    assert again.config == config.replace(norm_eps=again.config.norm_eps, init_std=again.config.init_std)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids))
    with pytest.raises(ValueError, match="rope_truncate"):
        export_gguf(Transformer(config.replace(rope_truncate=False)), tokenizer, tmp_path / "t.gguf")
