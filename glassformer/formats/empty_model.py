"""Real checkpoints -> Glassformer: GGUF files (gguf.py), Hugging Face folders (huggingface.py),
and back to Hugging Face (export.py). Each loader returns (Transformer, tokenizer)."""

from __future__ import annotations

import torch
from torch.nn import init
from torch.overrides import TorchFunctionMode

from ..model.config import ModelConfig
from ..model.encoder_decoder import EncoderDecoder, build_model
from ..model.transformer import Transformer


class _SkipInit(TorchFunctionMode):
    """Turns the in-place random initialisers into no-ops while a model is built."""

    SKIPPED = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_,
               init.normal_, init.uniform_, init.zeros_, init.ones_, init.kaiming_uniform_,
               init.trunc_normal_, init.xavier_uniform_, init.xavier_normal_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def empty_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                ) -> Transformer | EncoderDecoder:
    """A Transformer (or EncoderDecoder) whose parameters are allocated but not initialised,
    for a loader to fill: the random init it would overwrite costs seconds for a 100M-parameter
    model. Buffers
    (RoPE frequencies, ALiBi slopes) and weight tying are built as usual."""
    with _SkipInit():
        model = build_model(config)
    return model.to(dtype)
