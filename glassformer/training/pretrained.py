"""Training that starts from a pretrained model: `TrainConfig.init` names anything that
`glassformer.load` reads (a known name, a .gguf file, a Hugging Face or a checkpoint folder).

The run takes that model's config, weights and tokenizer. Weights are read in float32 as plain
`nn.Linear` layers, so a quantized GGUF file is dequantized once, here; the loop's bfloat16
autocast (TrainConfig.dtype) applies on top as for any run. The model fields a run asks for
must agree with the pretrained ones, except those that do not touch the weights (ADJUSTABLE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..model.config import ModelConfig

# Fields a fine-tuning run may set differently from the pretrained model: regularization, the
# attention kernel (each computes the same function) and, with rotary positions and no context
# extension, a shorter training window.
ADJUSTABLE = ("dropout", "attention_kernel", "context_length")


def load_pretrained(source: str):
    """(model, tokenizer) of `source` in float32, every layer a plain trainable module."""
    from ..formats.sources import load  # the one place that knows every source kind

    loaded = load(source, dtype=torch.float32, progress=False)
    return loaded.model, loaded.tokenizer


def run_config(pretrained: ModelConfig, asked: dict[str, Any] | ModelConfig | None,
               source: str) -> ModelConfig:
    """The run's model config: the pretrained one, with the ADJUSTABLE fields `asked` sets.
    Any other field `asked` gives must equal the pretrained model's, or the run is refused."""
    if isinstance(asked, ModelConfig):
        asked = asked.to_dict()
    asked, have = dict(asked or {}), pretrained.to_dict()
    unknown = [k for k in asked if k not in have]
    if unknown:
        raise InputError(unknown[0], "not a ModelConfig field")
    conflicts = [f"{k}={v!r} (it has {have[k]!r})" for k, v in asked.items()
                 if k not in ADJUSTABLE and v != have[k]]
    if conflicts:
        raise InputError("init", f"{source} fixes the model, but the run asks for "
                         f"{', '.join(conflicts)}; leave these fields out")
    config = pretrained.replace(**{k: v for k, v in asked.items() if k in ADJUSTABLE})
    if config.context_length != pretrained.context_length:
        if config.position != "rope" or config.rope_scaling != "none":
            raise InputError("context_length", f"{source} has {config.position} positions"
                             f"{'' if config.rope_scaling == 'none' else ' with context extension'}"
                             f"; keep its context_length {pretrained.context_length}")
        if config.context_length > pretrained.context_length:
            raise InputError("context_length", f"{config.context_length} is longer than "
                             f"{source}'s {pretrained.context_length}")
    return config


def base_name(source: str) -> str:
    """How an adapter names its base: a path made absolute, a known name as it is."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source
