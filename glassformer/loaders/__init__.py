"""Real checkpoints -> Glassformer: GGUF files (gguf.py), Hugging Face folders (huggingface.py),
and back to Hugging Face (export.py). Each loader returns (Transformer, tokenizer)."""

from __future__ import annotations

import re

import torch

from ..config import ModelConfig
from ..model import Transformer


def empty_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> Transformer:
    """A Transformer with uninitialised parameters (skipping the random init a loader would
    overwrite). Tied weights are re-tied; the non-persistent buffers (RoPE frequencies, ALiBi
    slopes), functions of the config alone, are copied from a one-layer twin."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu").to(dtype)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.tokens.weight
    twin = dict(Transformer(config.replace(n_layers=1, vocab_size=1, d_ff=1)).named_buffers())
    for name, buffer in model.named_buffers():
        buffer.copy_(twin[re.sub(r"^blocks\.\d+\.", "blocks.0.", name)])
    return model
