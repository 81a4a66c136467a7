"""Hugging Face parity on each device: a tiny random Llama built with transformers (the oracle),
saved, loaded by Glassformer and moved to the device; logits in float32 and in bfloat16, the
same greedy tokens, and cached decoding equal to recomputing the prefix. The CPU cases run
everywhere; the CUDA cases are marked cuda (skipped without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from glassformer.formats.huggingface import load_hf_model
from glassformer.generation.generate import GenerationConfig, generate

transformers = pytest.importorskip("transformers")
VOCAB = 300
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the transformers model in float32 on the CPU, the folder it was saved to)."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    config._attn_implementation = "eager"
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(folder)
    return reference, folder


def _ids(device: str) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0)).to(device)  # (2, 17)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_logits_equal_transformers(pair, device):
    reference, folder = pair
    ours, theirs = load_hf_model(folder).to(device), copy.deepcopy(reference).to(device)
    ids = _ids(device)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_logits_as_close_to_float32_as_transformers_own(pair, device):
    """Both models in bfloat16 against transformers in float32: ours no further from it than
    twice transformers' own bfloat16 error, and the same greedy tokens as its bfloat16 model."""
    reference, folder = pair
    ours = load_hf_model(folder, torch.bfloat16).to(device)
    theirs = copy.deepcopy(reference).to(device=device, dtype=torch.bfloat16)
    oracle = copy.deepcopy(reference).to(device)
    ids = _ids(device)
    with torch.no_grad():
        exact = oracle(ids).logits
        own_error = (theirs(ids).logits.float() - exact).abs().max()
        our_error = (ours(ids).float() - exact).abs().max()
    assert our_error <= 2 * own_error + 1e-3, (our_error, own_error)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_equal_transformers_and_cached_equals_uncached(pair, device):
    reference, folder = pair
    ours, theirs = load_hf_model(folder).to(device), copy.deepcopy(reference).to(device)
    prompt = [5, 17, 42, 99, 7]
    cached = generate(ours, prompt, GenerationConfig(max_new_tokens=20, eos_ids=())).generated_ids
    uncached = generate(ours, prompt, GenerationConfig(max_new_tokens=20, eos_ids=(), use_cache=False))
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        want = theirs.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=20, min_new_tokens=20)
    assert cached == uncached.generated_ids == want[0, len(prompt):].tolist()
