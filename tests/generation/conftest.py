import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.formats.chat_tokenizer import ChatTokenizer
from glassformer.formats.tokenizers import HFTokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def chat_model():
    """A tiny random Llama-style model with a trained BPE tokenizer and a ChatML template."""
    base = HFTokenizer.train_bpe(["hello there, how are you today? fine thanks"] * 9, 280)
    base.tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = ChatTokenizer(base.tokenizer, "<|im_end|>", "<|im_start|>", TEMPLATE)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=256, d_model=32,
                         n_layers=2, n_heads=4, n_kv_heads=2, position="rope", norm="rmsnorm",
                         activation="silu", gated=True, attn_bias=False, attn_out_bias=False,
                         mlp_bias=False, init_std=0.3)
    return Transformer(config).eval(), tokenizer
