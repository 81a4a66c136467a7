"""`load(source)`: any model Glassformer reads, with its tokenizer, from where it is.

A source is one of
- a known model name (`hub.MODELS`, e.g. smollm2-135m-instruct), pulled on first use;
- a .gguf file (llama.cpp);
- a Hugging Face model folder (config.json with a `model_type`, *.safetensors, tokenizer.json);
- a Glassformer checkpoint folder (config.json with a `model` section) or a training run folder.

`glassformer.load` (language_model.py) wraps the answer in a LanguageModel; training's --init
and the server read it from here, below the layers that run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..accel.quantize import quantize_format, quantize_model
from ..errors import InputError
from ..model.encoder_decoder import EncoderDecoder
from ..model.transformer import Transformer
from . import checkpoint, hub
from .files import read_json_object

# A conversion of this many parameters or more takes seconds: `load` announces it.
ANNOUNCED_PARAMETERS = 10_000_000


@dataclass
class Loaded:
    """A model read from `source`, with its tokenizer."""

    model: Transformer | EncoderDecoder
    tokenizer: Any  # encode / decode / eos_id / bos_id; ChatTokenizer adds the chat template
    source: str = ""

    @property
    def config(self):
        return self.model.config


def load(source: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
         quantize: str | None = None, announce: Callable[[str], None] | None = None) -> Loaded:
    """Read a model from a known name, a .gguf file, a Hugging Face or a Glassformer folder.

    quantize=None keeps plain nn.Linear layers (trainable; the reference path). Otherwise the
    weights are converted once for fast inference (glassformer.quantize): "none" keeps them
    in float32, "bf16" / "int8" / "int4" store them smaller, and "gguf" keeps a GGUF file's
    Q8_0 / Q4_x, K-quant (Q3_K to Q6_K) and Q5_x blocks as they are (no requantization;
    see formats/gguf.py). The converted model decodes one sequence with the fused C++ step
    (`model.fused_step()`). `announce` is told, in a line, of a conversion long enough to wait
    for (ANNOUNCED_PARAMETERS)."""
    from .gguf import load_gguf  # the loaders import numpy, gguf and safetensors

    fmt = None if quantize is None else quantize_format(quantize)
    keep_blocks = quantize == "gguf"

    text = str(source)
    path = Path(source).expanduser()
    if not path.exists() and text in hub.MODELS:
        model, tokenizer = load_gguf(hub.model_path(text, progress=progress), dtype, keep_blocks)
    elif path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise InputError(path, "not a GGUF file; give a .gguf file or a model folder")
        model, tokenizer = load_gguf(path, dtype, keep_blocks)
    elif path.is_dir():
        if keep_blocks:
            raise InputError(None, "quantize='gguf' applies to GGUF files only")
        model, tokenizer = _load_folder(path, dtype)
    elif path.exists():
        raise InputError(path, "not a regular file or folder (a device or a pipe?)")
    else:
        raise FileNotFoundError(
            f"no model at {text!r}: give a checkpoint folder, a .gguf file, a Hugging Face folder "
            f"or a known name ({', '.join(sorted(hub.MODELS))})"
        )
    if fmt is not None:  # layers kept in GGUF blocks stay; the others get fmt's kernels
        if announce is not None and sum(p.numel() for p in model.parameters()) >= ANNOUNCED_PARAMETERS:
            announce(f"converting the weights of {text} ({quantize}) for the fused decode step")
        quantize_model(model, fmt)
    return Loaded(model, tokenizer, text)


def _load_folder(path: Path, dtype: torch.dtype):
    from .chat_tokenizer import ChatTokenizer
    from .huggingface import load_hf

    config_path = path / "config.json"
    meta = read_json_object(config_path) if config_path.exists() else {}
    if "model_type" in meta:
        return load_hf(path, dtype)
    folder = checkpoint.resolve(path)
    model, tokenizer, _ = checkpoint.load_model(folder)
    if (folder / "tokenizer_config.json").is_file():  # written by export or by a loader
        tokenizer = ChatTokenizer.load(folder)
    return model.to(dtype).eval(), tokenizer
