"""StableLM, a family written as one registry entry: tiny random models built with transformers'
own StableLmConfig (the oracle), read from a Hugging Face folder and from the GGUF file our
exporter writes (transformers' GGUF reader reads that file too), with equal logits and greedy
tokens on every path; exported back to transformers; compared layer by layer; what
Glassformer does not compute is refused by name."""

from __future__ import annotations

import pytest
import torch
from fused_paths import check_fused_step

from glassformer.errors import InputError
from glassformer.formats.export import export_hf
from glassformer.formats.gguf import load_gguf
from glassformer.formats.gguf_export import export_gguf
from glassformer.formats.huggingface import config_from_hf, load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.interpret.compare import compare
from glassformer.serving import Engine, EngineConfig, RequestParams

transformers = pytest.importorskip("transformers")
VOCAB = 300
SIZES = dict(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, max_position_embeddings=64, num_hidden_layers=2, hidden_size=64,
             intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    # StableLmConfig's defaults: a quarter of each 16-wide head turning, RoPE base 10000, no
    # q/k/v biases, an untied head (what transformers' GGUF reader assumes of a stablelm file)
    "stablelm": lambda: transformers.StableLmConfig(**SIZES),
    # q/k/v biases, half of each head turning at base 5000, a tied head
    "stablelm_bias": lambda: transformers.StableLmConfig(
        **SIZES, use_qkv_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}),
}
EXPECTED = {
    "stablelm": dict(norm="layernorm", norm_bias=True, gated=True, activation="silu",
                     rotary_dim=4, rope_theta=10000.0, attn_bias=False, attn_out_bias=False,
                     n_kv_heads=2, tie_embeddings=False),
    "stablelm_bias": dict(rotary_dim=8, rope_theta=5000.0, attn_bias=True, attn_out_bias=False,
                          tie_embeddings=True),
}
PROMPT = [5, 17, 42, 99, 7, 3, 250]


def _tokenizer() -> HFTokenizer:
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen jugs"]
    return HFTokenizer.train_bpe(text * 20, VOCAB)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(1)
    config = CONFIGS[request.param]()
    config._attn_implementation = "eager"
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(folder)
    _tokenizer().save(folder / "tokenizer.json")
    model, tokenizer = load_hf(folder)
    return request.param, folder, reference, model, tokenizer


def _ids(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, 17), generator=torch.Generator().manual_seed(seed))


def test_config_fields(pair):
    kind, _, _, model, _ = pair
    for field, value in EXPECTED[kind].items():
        assert getattr(model.config, field) == value, field


def test_logits_and_greedy_tokens_equal_on_every_path(pair):
    _, folder, reference, model, _ = pair
    ids = _ids(0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)
        prompt = torch.tensor([PROMPT])
        theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=16, min_new_tokens=16)[0, len(PROMPT):].tolist()
    assert generate(model, PROMPT, GenerationConfig(max_new_tokens=16, eos_ids=())).generated_ids == theirs
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=32))
    handle = engine.submit(PROMPT, RequestParams(max_new_tokens=16, eos_ids=()))
    engine.run_until_done()
    assert handle.result.generated_ids == theirs


@pytest.mark.usefixtures("kernels")
def test_the_fused_step_computes_the_family_in_every_format(pair):
    check_fused_step(lambda: load_hf(pair[1])[0], PROMPT, 16)


def test_export_reads_back_in_transformers(pair, tmp_path):
    _, _, reference, model, tokenizer = pair
    export_hf(model, tokenizer, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.model_type == "stablelm"
    ids = _ids(3, rows=1)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
    ours, _ = load_hf(tmp_path / "out")
    torch.testing.assert_close(ours.state_dict(), model.state_dict())


def test_gguf_round_trip_equals_transformers(pair, tmp_path):
    """Exported as llama.cpp's stablelm and read back by Glassformer and by transformers' GGUF
    reader (which takes a quarter of each head and base 10000 for every stablelm file, so it is
    the oracle for the first configuration only)."""
    from gguf import GGUFReader

    kind, _, reference, model, tokenizer = pair
    path = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "stablelm"
    names = {t.name for t in reader.tensors}
    assert {"blk.1.attn_norm.bias", "blk.1.ffn_norm.bias", "output_norm.bias"} <= names
    assert ("blk.1.attn_q.bias" in names) == (kind == "stablelm_bias")
    ours, _ = load_gguf(path)
    assert ours.config == model.config.replace(norm_eps=ours.config.norm_eps)  # eps in float32
    ids = _ids(4)
    with torch.no_grad():
        oracle = reference(ids).logits
        torch.testing.assert_close(ours(ids), oracle, atol=1e-4, rtol=1e-4)
    if kind == "stablelm":
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        assert theirs.config.model_type == "stablelm"
        with torch.no_grad():
            torch.testing.assert_close(theirs(ids).logits, oracle, atol=1e-4, rtol=1e-4)


def test_compare_agrees_with_transformers_layer_by_layer(pair):
    _, _, reference, model, _ = pair
    result = compare(model, reference, torch.tensor([PROMPT]))
    assert "blocks.1.attn.out" in [s.site for s in result.sites]
    assert result.first_failure is None, result.first_failure


@pytest.mark.parametrize(("change", "field"), [
    ({"qk_layernorm": True}, "qk_layernorm"),
    ({"use_parallel_residual": True}, "use_parallel_residual"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, None),
])
def test_what_is_not_computed_is_refused_by_name(change, field):
    with pytest.raises(InputError) as error:
        config_from_hf(CONFIGS["stablelm"]().to_dict() | change)
    assert error.value.field == field
    assert "\n" not in str(error.value)
