"""GGUF files (llama.cpp's format) -> ModelConfig + Transformer weights + tokenizer.

Tensors are dequantized to float32 with `gguf.quants.dequantize`, a block of rows at a time,
straight into the model's parameters, so memory never holds a second copy of the model; each
tensor's pages of the file are dropped once it is read. With keep_blocks the blocks the
kernels read are copied as they are (no float32 copy of any of them, the token table included).

Each architecture (`general.architecture`, llama.cpp's names) is one family's entry in the
registry (families.py: gguf_arch.Architecture): the fields its metadata gives beyond the sizes
and RoPE read here, and its tensors' names, with where each goes (gguf_arch.Target: rows of a
fused product, llama's W_Q and W_K rows to un-permute, Gemma's norms stored as 1 + w).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from .chat_tokenizer import ChatTokenizer
from .empty_model import empty_model
from .families import gguf_family, written_as
from .gguf_arch import Metadata, Target
from .gguf_file import GGUFFile
from .gguf_rope import ROPE_TENSORS, read_factors, rope_scaling_fields
from .gguf_tokenizer import from_gguf_metadata
from .validate import check_model, check_tensor

_CHUNK_ELEMENTS = 1 << 20  # dequantize at most this many values at once


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any],
                         factors: dict[str, tuple[float, ...]] | None = None) -> ModelConfig:
    """The architecture described by `{arch}.*` metadata (and, where the metadata is silent,
    by which tensors the file holds); `factors`: the values of its RoPE tensors (LongRoPE's
    factors, Llama 3.1's rope_freqs: gguf_rope.read_factors)."""
    arch = gguf_family(meta.get("general.architecture")).gguf
    m = Metadata(arch.name, meta)
    n_heads = m.count("attention.head_count")
    d_model = m.count("embedding_length")
    d_head = m.count("attention.key_length", d_model // n_heads)
    rotary = m.count("rope.dimension_count", d_head)
    if rotary != d_head and not arch.partial_rotary:
        raise InputError(None, f"unsupported GGUF: RoPE on {rotary} of {d_head} head dimensions")
    if "token_embd.weight" not in tensors:
        raise InputError(None, "GGUF lacks the tensor token_embd.weight")
    n_layers = m.count("block_count")
    theta = m.number("rope.freq_base", 10000.0)
    context = m.count("context_length")
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[0]),
        context_length=context,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=m.count("attention.head_count_kv", n_heads),
        d_head=d_head if d_head * n_heads != d_model else None,
        d_ff=m.count("feed_forward_length"),
        position="rope",
        rope_theta=theta,
        **rope_scaling_fields(arch.name, meta, context, factors or {}, theta, rotary, arch.rope_freqs),
        rotary_dim=rotary if rotary != d_head else None,
        tie_embeddings="output.weight" not in tensors,
        **arch.fields(m, tensors),
    )


def tensor_map(config: ModelConfig, arch: str | None = None) -> dict[str, Target]:
    """GGUF tensor name -> Target, for every tensor an `arch` file (by default the one export
    writes: families.written_as) of `config` must hold."""
    family = written_as(config, gguf=True) if arch is None else gguf_family(arch)
    return family.gguf.tensors(config)


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameters `tensor_map` fills, from the config alone (a model on the meta
    device: nothing allocated)."""
    with torch.device("meta"):
        model = Transformer(config)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K permutation: per head, rows (i, half) -> (half, i)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, keep_blocks: bool = False,
              ) -> tuple[Transformer, ChatTokenizer]:
    """Read a GGUF file: the model (eval mode, on CPU) and its tokenizer.

    By default every tensor is dequantized (exactly what transformers computes);
    keep_blocks=True keeps Q8_0 / Q4_x / Q5_x and Q3_K ... Q6_K matrices in
    their blocks as QuantizedLinear layers (glassformer.accel): the same weights in the file's
    memory, multiplied by the block kernels (which round the activations to int8, like
    llama.cpp);
    a token table in such blocks becomes a QuantizedEmbedding, whose lookups give exactly
    the dequantized rows.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with GGUFFile(path) as file:
        try:
            config = config_from_metadata(file.metadata, file.tensors, read_factors(file))
            tokenizer = from_gguf_metadata(file.metadata)
        except ValueError as error:
            raise InputError(path, f"{error}") from None
        arch = file.metadata["general.architecture"]
        file.metadata.clear()  # the vocabulary as Python strings (~12 MB for 49k tokens), now read
        targets = tensor_map(config, arch)
        check_tensors(file, config, targets)
        if tokenizer.vocab_size != config.vocab_size:
            raise InputError(path, f"{tokenizer.vocab_size} tokens in the vocabulary but "
                             f"{config.vocab_size} rows in token_embd.weight")
        model = empty_model(config, dtype)
        done = _keep_blocks(file, model, targets) if keep_blocks else set()
        params = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, target in targets.items():
                if name in done:
                    continue
                dest = params[target.param]
                if target.rows is not None:
                    dest = dest[target.rows[0]:target.rows[1]]
                _fill(file, name, dest, target.heads)
                dest.sub_(target.shift)
                check_tensor(dest, name, str(path))
                file.release(name)
    check_model(model, str(path), parameters=False)  # block scales kept as they are
    return model.eval(), tokenizer


def _keep_blocks(file: GGUFFile, model: Transformer, targets: dict[str, Target]) -> set[str]:
    """Swap each linear layer whose GGUF tensors are all in block types the kernels read
    (gguf_blocks.KEPT_TYPES) for a QuantizedLinear built from those blocks (a StackedLinear of
    one per run of a type where its tensors differ: a Q4_K_M file's q, k in Q4_K and v in
    Q6_K), and the token table, when in such blocks, for a QuantizedEmbedding (sharing a tied
    head's blocks): no float32 copy of either. Returns the tensor names so consumed; their
    pages of the file are dropped as each is copied. Blocks hold whole rows, so fusing
    (q; k; v) and un-permuting rows work on the bytes."""
    from ..accel.gguf_blocks import KEPT_TYPES
    from ..accel.quantized_embedding import QuantizedEmbedding
    from ..accel.stacked_linear import StackedLinear

    layers = layer_tensors(targets, model.linear_layers(), model.config.tie_embeddings)
    done: set[str] = set()

    def rows(n: str) -> tuple[int, int]:
        return targets[n].rows or (0, 0)

    for layer, names in layers.items():
        if not all(file.tensors[n].qtype.name in KEPT_TYPES for n in names):
            continue
        runs: list[list[str]] = []  # consecutive tensors (by rows) of one block type
        for n in sorted(names, key=rows):
            if runs and file.tensors[runs[-1][0]].qtype == file.tensors[n].qtype:
                runs[-1].append(n)
            else:
                runs.append([n])
        biases = sorted((n for n, t in targets.items() if t.param == layer + ".bias"), key=rows)
        parts = []
        for run in runs:
            span = (rows(run[0])[0], rows(run[-1])[1])
            mine = [n for n in biases if len(runs) == 1 or span[0] <= rows(n)[0] < span[1]]
            parts.append(_kept_part(file, targets, run, mine))
            done.update(run, mine)
        table = parts[0] if len(parts) == 1 else StackedLinear(parts)
        if layer != "embed.tokens":
            model.set_submodule(layer, table)
        if "token_embd.weight" in names:
            model.embed.tokens = QuantizedEmbedding(table)
    return done


def layer_tensors(targets: dict[str, Target], linear, tied: bool) -> dict[str, list[str]]:
    """The GGUF tensors of each linear layer of `linear` (names), and of the token table: the
    tied head's (lm_head) or, untied, its own (embed.tokens, built like a head)."""
    layers: dict[str, list[str]] = {}
    for name, target in targets.items():
        layer = target.param.removesuffix(".weight")
        if layer in linear:
            layers.setdefault(layer, []).append(name)
    layers["lm_head" if tied else "embed.tokens"] = ["token_embd.weight"]
    return layers


def _kept_part(file: GGUFFile, targets: dict[str, Target], names: list[str], biases: list[str]):
    """The QuantizedLinear of tensors `names` (one block type, rows in order) and their
    `biases`, the pages of each dropped once copied."""
    from ..accel import QuantizedLinear

    rows = []
    for n in names:
        raw = file.raw(n)
        heads = targets[n].heads
        rows.append(unpermute_rows(raw, heads) if heads else raw)
    raw = np.concatenate(rows) if len(rows) > 1 else rows[0]
    shape = (sum(file.tensors[n].shape[0] for n in names), file.tensors[names[0]].shape[1])
    bias = torch.from_numpy(np.concatenate(  # q, k, v biases (qwen2, gptneox), as the file has them
        [dequantize(file.raw(n), file.tensors[n].qtype).reshape(-1) for n in biases])) if biases else None
    table = QuantizedLinear.from_gguf(raw, file.tensors[names[0]].qtype, shape, bias)
    for n in [*names, *biases]:
        file.release(n)
    return table


def check_tensors(file: GGUFFile, config: ModelConfig, targets: dict[str, Target]) -> None:
    """Names, shapes and types, all checked before any memory is allocated for the model."""
    missing = sorted(set(targets) - set(file.tensors))
    if missing:
        raise InputError(file.path, f"missing tensor {missing[0]} "
                         f"({len(missing)} missing in all)")
    unknown = sorted(set(file.tensors) - set(targets) - set(ROPE_TENSORS))  # RoPE's: in the config
    if unknown:
        raise InputError(file.path, f"unexpected tensor {unknown[0]} for a "
                         f"{config.n_layers}-layer {written_as(config, gguf=True).gguf.name} model")
    shapes = param_shapes(config)
    for name, target in targets.items():
        info = file.tensors[name]
        rows, cols = shapes[target.param][0], shapes[target.param][1:]
        if target.rows is not None:
            rows = target.rows[1] - target.rows[0]
        if info.shape != (rows, *cols):
            raise InputError(file.path, f"tensor {name} has shape {info.shape}, "
                             f"expected {(rows, *cols)}")
    first = {}  # each type and the first tensor of it
    for name in targets:
        first.setdefault(file.tensors[name].qtype, name)
    for qtype, name in first.items():  # one block of zeros each: no page of the file is read
        try:  # integer types (I8 ... I64) have no dequantization: never cast to float
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except NotImplementedError:
            raise InputError(file.path, f"unsupported quantization type {qtype.name} "
                             f"(tensor {name})") from None


def _fill(file: GGUFFile, name: str, dest: torch.Tensor, heads: int | None) -> None:
    """Dequantize tensor `name` into `dest`, a block of rows at a time."""
    info = file.tensors[name]
    if heads is not None:  # the permutation mixes rows within a head: take it whole
        values = unpermute_rows(dequantize(file.raw(name), info.qtype), heads)
        dest.copy_(torch.from_numpy(np.ascontiguousarray(values)))
        return
    n_rows = dest.shape[0] if dest.dim() > 1 else 1
    step = max(1, _CHUNK_ELEMENTS // max(1, dest.numel() // n_rows))
    flat = dest.view(n_rows, -1)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        values = dequantize(file.raw(name, rows), info.qtype)
        flat[rows].copy_(torch.from_numpy(values if values.flags.writeable else values.copy()))
