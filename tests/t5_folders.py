"""Tiny random T5 folders written by transformers, shared by the T5 loader, generation and
export tests: v1.0 (ReLU, tied head with the d_model^-½ rescale) and v1.1 (gated GELU, untied)."""

from __future__ import annotations

import json

import torch
import transformers  # noqa: E402  (tests importing this skip without it first)
from safetensors.torch import load_file, save_file

VOCAB = 64
SIZES = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
             num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
VERSIONS = {"v1.0": dict(feed_forward_proj="relu"),
            "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def save_t5(version: str, folder):
    """A tiny random T5 written as a Hugging Face folder; v1.1 gets its own head, as its
    published checkpoints have. Returns transformers' model read back from the folder."""
    torch.manual_seed(2)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**SIZES, **VERSIONS[version]))
    model.save_pretrained(folder)
    if version == "v1.1":
        tensors = load_file(folder / "model.safetensors")
        tensors["lm_head.weight"] = torch.randn(VOCAB, SIZES["d_model"])
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    reference = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    assert (reference.lm_head.weight is reference.shared.weight) == (version == "v1.0")
    return reference


