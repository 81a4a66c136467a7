"""A tiny random Llama built in transformers (the oracle) and saved as a Hugging Face folder
with a byte-level BPE tokenizer.json: a pretrained model for fine-tuning tests."""

from __future__ import annotations

import json

import torch

from glassformer.formats.tokenizers import HFTokenizer

VOCAB = 300
TEXT = "the quick brown fox jumps over the lazy dog. pack my box with five dozen jugs. " * 30


def llama_folder(folder):
    """A tiny random Llama saved by transformers, with a byte-level BPE tokenizer.json."""
    import transformers

    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    HFTokenizer.train_bpe([TEXT] * 4, VOCAB).save(folder / "tokenizer.json")
    return model


def chat_llama_folder(folder, template: str):
    """llama_folder with a tokenizer_config.json holding an end-of-text token and `template`."""
    model = llama_folder(folder)
    config = {"eos_token": "<|endoftext|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return model
