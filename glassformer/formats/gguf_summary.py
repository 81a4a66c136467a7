"""What a GGUF file holds, read from its header alone (`glassformer info`, fast on a file of
gigabytes): the configuration and tokenizer it describes, and each tensor's type and size with
what each way of loading does with it.

- The default load dequantizes every tensor to float32.
- keep_blocks (`--quantize gguf`) keeps a matrix in its blocks where the kernels read the
  block type of every tensor of its layer (accel/gguf_blocks.KEPT_TYPES; q, k and v are one
  layer, gate and up another, a tied head reads the token table: gguf.layer_tensors), as
  gguf._keep_blocks decides; the rest become float32, each for a reason said here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from .chat_tokenizer import ChatTokenizer
from .gguf import check_tensors, config_from_metadata, layer_tensors, tensor_map
from .gguf_file import GGUFFile, TensorInfo
from .gguf_rope import ROPE_TENSORS, read_factors
from .gguf_tokenizer import from_gguf_metadata

KEPT, FLOAT32 = "blocks", "float32"  # what keep_blocks does with a tensor
# tokenizer.ggml.model -> what it is (formats/gguf_tokenizer.py)
TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece", "gemma4": "Gemma 4's BPE"}
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


class GGUFSummary(NamedTuple):
    metadata: dict[str, Any]
    config: ModelConfig
    tokenizer: ChatTokenizer
    tokenizer_kind: str  # tokenizer.ggml.model and what it is: "llama (SentencePiece)"
    pre_tokenizer: str | None  # tokenizer.ggml.pre (byte-level BPE only)
    tensors: list[dict[str, Any]]  # name, type, shape, bytes, and keep_blocks' action and why


def summarize_gguf(path: str | Path) -> GGUFSummary:
    """The file's configuration, tokenizer and tensors (ValueError naming what is wrong, as
    load_gguf refuses it)."""
    with GGUFFile(path) as file:
        meta = file.metadata
        try:
            config = config_from_metadata(meta, file.tensors, read_factors(file))
            tokenizer = from_gguf_metadata(meta)
        except ValueError as error:
            raise InputError(path, f"{error}") from None
        arch = meta["general.architecture"]
        check_tensors(file, config, tensor_map(config, arch))  # names, shapes and types
        plan = block_plan(config, file.tensors, arch)
        tensors = [{"name": name, "type": info.qtype.name, "shape": list(info.shape),
                    "bytes": info.n_bytes, "quantize_gguf": KEPT if why is None else FLOAT32,
                    "why": why or _kept_as(name, config)}
                   for name, info in file.tensors.items() for why in [plan[name]]]
        kind = meta["tokenizer.ggml.model"]  # from_gguf_metadata has checked it
        named = f"{kind} ({TOKENIZER_KINDS[kind]})" if kind in TOKENIZER_KINDS else kind
        return GGUFSummary(meta, config, tokenizer, named,
                           meta.get("tokenizer.ggml.pre"), tensors)


def block_plan(config: ModelConfig, tensors: dict[str, TensorInfo], arch: str) -> dict[str, str | None]:
    """Per tensor of the file: None where keep_blocks keeps it in its blocks, else why it
    becomes float32."""
    from ..accel.gguf_blocks import KEPT_TYPES  # the block types the kernels read

    targets = tensor_map(config, arch)
    with torch.device("meta"):  # the layers' names only: nothing allocated
        linear = Transformer(config).linear_layers()
    plan: dict[str, str | None] = {}
    for layer, names in layer_tensors(targets, linear, config.tie_embeddings).items():
        others = sorted({tensors[n].qtype.name for n in names} - set(KEPT_TYPES))
        for name in names:
            kind = tensors[name].qtype.name
            if kind in FLOAT_TYPES:
                plan[name] = f"{kind} is a float type: no blocks to keep"
            elif kind not in KEPT_TYPES:
                plan[name] = f"no kernel reads {kind} blocks (they read {', '.join(KEPT_TYPES)})"
            elif others:
                plan[name] = f"its layer {layer} also holds {' and '.join(others)}, which no kernel reads"
            else:
                plan[name] = None
    for name in tensors:
        if name in ROPE_TENSORS:
            plan[name] = "RoPE's values, read into the configuration"
        elif name not in plan:
            plan[name] = "a vector (norm or bias): float32 on every path"
    return plan


def tensor_groups(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tensors summed per type and what keep_blocks does with them (and why): type,
    tensors (a count), bytes, quantize_gguf, why; in the order each first appears."""
    groups: dict[tuple, dict[str, Any]] = {}
    for tensor in tensors:
        key = (tensor["type"], tensor["quantize_gguf"], tensor["why"])
        group = groups.setdefault(key, {"type": tensor["type"], "tensors": 0, "bytes": 0,
                                        "quantize_gguf": tensor["quantize_gguf"], "why": tensor["why"]})
        group["tensors"] += 1
        group["bytes"] += tensor["bytes"]
    return list(groups.values())


def _kept_as(name: str, config: ModelConfig) -> str:
    if name != "token_embd.weight":
        return "kept in its blocks: the quantized kernels multiply by them"
    shared = " (the tied head reads the same blocks)" if config.tie_embeddings else ""
    return "kept in its blocks: a quantized table whose rows are dequantized on lookup" + shared
