"""SmolLM2-135M-Instruct from its GGUF: Glassformer against transformers reading the same file.

transformers dequantizes the GGUF to float32 and un-permutes W_Q / W_K itself, so it is an
exact fp32 oracle for our loader (llama.cpp's own quantized arithmetic would not be).
"""

from __future__ import annotations

import pytest
import torch

from glassformer.formats.gguf import load_gguf
from glassformer.generation.generate import GenerationConfig, generate

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
PROMPT = "The meaning of life is"


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_gguf(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return model.eval(), tokenizer


def test_config_from_metadata(ours):
    c = ours[0].config
    got = (c.n_layers, c.d_model, c.n_heads, c.kv_heads, c.ff_dim, c.rope_theta, c.vocab_size)
    assert got == (30, 576, 9, 3, 1536, 100000.0, 49152)
    assert c.norm == "rmsnorm" and abs(c.norm_eps - 1e-5) < 1e-9 and c.tie_embeddings
    assert c.context_length == 8192


@pytest.mark.parametrize("text", [
    PROMPT, "Hello, world! 12345 and 3.14159", "  spaces\n\nnew lines\ttabs",
    "émoji 🤗 ünïcödé 中文", "don't I'm we'll", "<|im_start|>user\nhi<|im_end|>\n",
])
def test_tokenizer_matches(ours, reference, text):
    tokenizer = ours[1]
    assert tokenizer.encode(text) == reference[1].encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_matches(ours, reference):
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}]
    expected = reference[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours[1].render_chat(messages) == expected
    assert (ours[1].bos_id, ours[1].eos_id) == (reference[1].bos_token_id, reference[1].eos_token_id)


def test_logits_match(ours, reference):
    ids = torch.tensor([ours[1].encode(PROMPT)])
    with torch.no_grad():
        expected = reference[0](ids).logits
        got = ours[0](ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_32_greedy_tokens_identical(ours, reference):
    prompt = ours[1].encode(PROMPT)
    result = generate(ours[0], prompt, GenerationConfig(max_new_tokens=32, eos_ids=()))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = reference[0].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=32, min_new_tokens=32)
    assert result.generated_ids == expected[0, len(prompt):].tolist()
