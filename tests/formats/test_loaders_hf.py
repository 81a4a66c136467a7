"""Hugging Face folders: tiny random models built with transformers (the oracle), saved, loaded
by Glassformer; equal logits (fp32) and identical greedy tokens. Plus every error path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glassformer.errors import InputError
from glassformer.formats.huggingface import config_from_hf, load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.generate import GenerationConfig, generate

transformers = pytest.importorskip("transformers")
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
LLAMA = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
             rope_theta=5000.0, tie_word_embeddings=False, **COMMON)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, n_positions=64, **COMMON),
    "llama": lambda: transformers.LlamaConfig(**LLAMA),
    "llama_tied": lambda: transformers.LlamaConfig(**(LLAMA | {"tie_word_embeddings": True})),
    "mistral": lambda: transformers.MistralConfig(**LLAMA, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA),
    # Llama 3.1's RoPE bands over an original context of 16: the 17-token tests cross it, and
    # d_head 8 puts one pair in the mixed band, three in the interpolated one
    "llama3": lambda: transformers.LlamaConfig(**LLAMA, rope_scaling=LLAMA3_ROPE),
    # YaRN over an original context of 16: the attention factor derived (0.1 ln 4 + 1), and
    # Qwen3's with everything stated (betas that move the band, no rounding of its edges)
    "llama_yarn": lambda: transformers.LlamaConfig(**LLAMA, rope_scaling=YARN_ROPE),
    "qwen3_yarn": lambda: transformers.Qwen3Config(**LLAMA, head_dim=8, rope_scaling=YARN_ROPE | {
        "beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.25, "truncate": False}),
}
# ModelConfig fields each RoPE scaling above is read into
ROPE_FIELDS = {
    "llama3": dict(rope_scaling="llama3", rope_factor=8.0, original_context=16, rope_high_freq_factor=4.0),
    "llama_yarn": dict(rope_scaling="yarn", rope_factor=4.0, original_context=16, rope_beta_fast=32.0,
                       rope_beta_slow=1.0, rope_truncate=True, rope_attention_factor=None),
    "qwen3_yarn": dict(rope_scaling="yarn", rope_factor=4.0, original_context=16, rope_beta_fast=8.0,
                       rope_beta_slow=2.0, rope_truncate=False, rope_attention_factor=1.25),
}


def _tokenizer() -> HFTokenizer:
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen jugs"]
    return HFTokenizer.train_bpe(text * 20, VOCAB)


def _save(kind: str, folder, **save_kwargs):
    torch.manual_seed(1)
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder, **save_kwargs)
    _tokenizer().save(folder / "tokenizer.json")
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = _save(request.param, folder)
    model, tokenizer = load_hf(folder)
    return request.param, reference, model, tokenizer


def test_logits_equal(pair):
    _, reference, model, _ = pair
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_20_greedy_tokens_identical(pair):
    _, reference, model, _ = pair
    prompt = [5, 17, 42, 99, 7]
    ours = generate(model, prompt, GenerationConfig(max_new_tokens=20, eos_ids=()))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=20, min_new_tokens=20)
    assert ours.generated_ids == theirs[0, len(prompt):].tolist()


def test_config_fields(pair):
    kind, reference, model, tokenizer = pair
    c = model.config
    assert c.kv_heads == (reference.config.n_head if kind == "gpt2" else 2)
    assert c.sliding_window == (5 if kind == "mistral" else None)
    assert c.attn_bias == (kind in ("gpt2", "qwen2"))
    assert (model.lm_head.weight is model.embed.tokens.weight) == c.tie_embeddings
    assert tokenizer.vocab_size == VOCAB


def test_sharded_checkpoint(tmp_path):
    reference = _save("llama", tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = load_hf(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_gpt2_keys_without_prefix(tmp_path):
    reference = _save("gpt2", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({k.removeprefix("transformer."): v.contiguous() for k, v in tensors.items()}, path)
    model, _ = load_hf(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.fixture
def llama_folder(tmp_path):
    _save("llama", tmp_path)
    return tmp_path


def _edit_tensors(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_missing_tensor(llama_folder):
    _edit_tensors(llama_folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_hf(llama_folder)


def test_unexpected_tensor(llama_folder):
    _edit_tensors(llama_folder, lambda t: t.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected tensor extra"):
        load_hf(llama_folder)


def test_wrong_shape(llama_folder):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8]

    _edit_tensors(llama_folder, shrink)
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        load_hf(llama_folder)


def test_truncated_safetensors(llama_folder):
    path = llama_folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_hf(llama_folder)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(llama_folder, name):
    (llama_folder / name).unlink()
    with pytest.raises(FileNotFoundError):
        load_hf(llama_folder)


def test_unsupported_architecture(llama_folder):
    path = llama_folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"model_type": "xlnet"}))
    with pytest.raises(ValueError, match="unsupported model_type 'xlnet'"):
        load_hf(llama_folder)


def test_unsupported_rope_scaling():
    hf = CONFIGS["llama"]().to_dict() | {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match="unsupported rope type 'dynamic'"):
        config_from_hf(hf)


def test_yarn_refuses_the_attention_factor_it_does_not_derive():
    """DeepSeek's mscale / mscale_all_dim derive YaRN's attention factor another way: refused
    by name, unless the factor is stated (transformers then reads neither)."""
    yarn = YARN_ROPE | {"mscale": 1.0, "mscale_all_dim": 0.5}
    hf = CONFIGS["llama"]().to_dict() | {"rope_parameters": yarn}
    with pytest.raises(InputError) as error:
        config_from_hf(hf)
    assert error.value.field == "rope_scaling"
    stated = hf | {"rope_parameters": yarn | {"attention_factor": 1.5}}
    assert config_from_hf(stated).rope_attention_factor == 1.5


@pytest.mark.parametrize("change", [{"num_attention_heads": 0}, {"hidden_size": "48"}, {"rope_theta": "x"},
                                    {"rope_scaling": [1]}])
def test_a_config_value_of_another_type_is_an_input_error(change):
    hf = {"model_type": "llama", "vocab_size": 32, "max_position_embeddings": 64, "hidden_size": 16,
          "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32} | change
    with pytest.raises(InputError, match="config.json"):
        config_from_hf(hf)


def test_load_dispatches_on_the_source(llama_folder, tmp_path):
    from glassformer import LanguageModel, load

    language_model = load(llama_folder)
    assert isinstance(language_model, LanguageModel) and language_model.config.position == "rope"
    assert language_model.logits([1, 2, 3]).shape == (3, VOCAB)
    with pytest.raises(FileNotFoundError, match="known name"):
        load(tmp_path / "nothing-here")
    (tmp_path / "x.bin").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load(tmp_path / "x.bin")


EXPORTABLE = {
    "gpt2": dict(position="learned", norm="layernorm", activation="gelu_tanh"),
    "llama": dict(position="rope", norm="rmsnorm", activation="silu", gated=True, attn_bias=False,
                  attn_out_bias=False, mlp_bias=False, n_kv_heads=2, tie_embeddings=False),
    "mistral": dict(position="rope", norm="rmsnorm", activation="silu", gated=True, attn_bias=False,
                    attn_out_bias=False, mlp_bias=False, n_kv_heads=2, sliding_window=4),
    "qwen2": dict(position="rope", norm="rmsnorm", activation="silu", gated=True, attn_bias=True,
                  attn_out_bias=False, mlp_bias=False, n_kv_heads=2),
}


@pytest.mark.parametrize("family", list(EXPORTABLE))
def test_export_loads_in_transformers(tmp_path, family):
    from glassformer import ModelConfig, Transformer
    from glassformer.cli import main
    from glassformer.formats.export import export_hf

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, context_length=32, d_model=32, n_layers=2, n_heads=4,
                         init_std=0.2, **EXPORTABLE[family])
    model = Transformer(config).eval()
    for p in model.parameters():  # make biases and norm weights non-trivial
        p.data.add_(0.1 * torch.randn_like(p))
    export_hf(model, _tokenizer(), tmp_path / "out")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reference.config.model_type == family
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
    assert main(["export", "--model", str(tmp_path / "out"), "-o", str(tmp_path / "again")]) == 0
    again, _ = load_hf(tmp_path / "again")
    torch.testing.assert_close(again.state_dict(), model.state_dict())


def test_export_refuses_what_hf_cannot_express(tmp_path):
    from glassformer import ModelConfig, Transformer
    from glassformer.formats.export import export_hf

    model = Transformer(ModelConfig(vocab_size=VOCAB, context_length=16, d_model=16, n_layers=1,
                                    n_heads=2, norm_placement="post"))
    with pytest.raises(ValueError, match="norm_placement"):
        export_hf(model, _tokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_config_missing_a_field_is_one_error(llama_folder):
    path = llama_folder / "config.json"
    config = json.loads(path.read_text())
    del config["hidden_size"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json lacks 'hidden_size'"):
        load_hf(llama_folder)


@pytest.mark.parametrize("kind", list(ROPE_FIELDS))
def test_rope_scaling_on_every_path_and_back_to_transformers(tmp_path, kind):
    """Llama 3.1's RoPE scaling and YaRN: the module path, the fused step and the engine equal
    transformers past the original context; the exported folder is read back by transformers
    with the same rope_scaling and logits."""
    from glassformer.accel.quantize import quantize_model
    from glassformer.formats.export import export_hf
    from glassformer.serving import Engine, EngineConfig, RequestParams

    reference = _save(kind, tmp_path / "in")
    model, tokenizer = load_hf(tmp_path / "in")
    assert {field: getattr(model.config, field) for field in ROPE_FIELDS[kind]} == ROPE_FIELDS[kind]
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)
    prompt = ids[0, :30].tolist()
    with torch.no_grad():
        theirs = reference.generate(ids[:, :30], attention_mask=torch.ones_like(ids[:, :30]),
                                    do_sample=False, max_new_tokens=12, min_new_tokens=12)[0, 30:].tolist()
    greedy = GenerationConfig(max_new_tokens=12, eos_ids=())
    fused = quantize_model(load_hf(tmp_path / "in")[0], "none")
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64))
    handle = engine.submit(prompt, RequestParams(max_new_tokens=12, eos_ids=()))
    engine.run_until_done()
    assert generate(model, prompt, greedy).generated_ids == theirs
    assert generate(fused, prompt, greedy).generated_ids == theirs
    assert handle.result.generated_ids == theirs
    export_hf(model, tokenizer, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.rope_parameters["rope_type"] == ROPE_FIELDS[kind]["rope_scaling"]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, atol=1e-5, rtol=1e-5)
