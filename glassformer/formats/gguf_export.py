"""Glassformer -> a GGUF file that llama.cpp-based tools read (the inverse of gguf.py).

The file is written by the `gguf` library's GGUFWriter with llama.cpp's `<arch>.*` metadata
(the architecture of the family the registry writes the config as: families.written_as; its
own keys from its gguf_arch.Architecture), its tensor names (token_embd,
blk.N.attn_q ..., output_norm, output) and the tokenizer as
`tokenizer.ggml.*` (byte-level BPE: tokens, token types, merges, special ids) with the chat
template. For llama, W_Q and W_K rows are permuted into llama.cpp's RoPE layout (adjacent
pairs), the inverse of `gguf.unpermute_rows`; the fused qkv and gate-up matrices are cut back into
llama.cpp's separate tensors. Matrices take the asked type (F32, F16, or Q8_0 / Q4_0 blocks
made by `gguf.quants.quantize`); norms stay F32, as llama.cpp keeps them. RoPE scaling goes
as gguf_rope.py writes it (Llama 3.1's bands as the tensor rope_freqs.weight).

What the file describes is checked before anything is written: the loader's own reading of
the metadata (`config_from_metadata`) must give back the model's config, so a field GGUF
cannot say is refused by name (Llama 3.1's band fields: the same divisors, since the file
holds only those). The file is written beside its destination and renamed into
place.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from gguf import GGUFWriter, LlamaFileType, RopeScalingType, TokenType
from gguf.quants import GGMLQuantizationType, quantize

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from .families import written_as
from .gguf import config_from_metadata, tensor_map
from .gguf_rope import LLAMA3_FIELDS, attention_factor, factor_tensors, rope_scaling_metadata
from .gguf_tokenizer import pre_name
from .validate import check_model_finite

# --dtype -> (the matrices' GGML type, general.file_type)
DTYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
_BLOCK = {"q8_0": 32, "q4_0": 32}  # values per block: a row must hold whole blocks
_FREE = ("dropout", "attention_kernel", "init_std")  # fields no weight or output depends on
_DERIVED = {"n_kv_heads": "kv_heads", "d_head": "head_dim", "d_ff": "ff_dim"}


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K layout: per head, rows (half, i) -> (i, half)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_metadata(config: ModelConfig) -> dict:
    """The `<arch>.*` values (the architecture: families.written_as), checked to read back as
    `config`."""
    architecture = written_as(config, gguf=True).gguf
    arch = architecture.name
    meta = {"general.architecture": arch} | {f"{arch}.{key}": value for key, value in {
        "context_length": config.context_length,
        "embedding_length": config.d_model,
        "block_count": config.n_layers,
        "feed_forward_length": config.ff_dim,
        "attention.head_count": config.n_heads,
        "attention.head_count_kv": config.kv_heads,
        "attention.key_length": config.head_dim,
        "attention.value_length": config.head_dim,
        "rope.dimension_count": config.rotated_dim,
        "rope.freq_base": _f32(config.rope_theta),
    }.items()}
    meta |= {f"{arch}.{key}": _f32(v) if isinstance(v, float) else v
             for key, v in architecture.metadata(config).items()}
    meta |= {key: _f32(v) if isinstance(v, float) else v
             for key, v in rope_scaling_metadata(arch, config).items()}
    # the tensors the file will hold, as far as the reading looks (names, the table's shape)
    tensors = {name: SimpleNamespace(shape=(config.vocab_size, config.d_model))
               for name in tensor_map(config, arch)}
    factors = {name: tuple(map(float, w)) for name, w in factor_tensors(config).items()}
    try:
        read = config_from_metadata(meta, tensors, factors)
    except ValueError as error:
        raise InputError(None, f"GGUF export: {error}") from None
    for field in config.to_dict():
        if field in LLAMA3_FIELDS and read.rope_scaling == "llama3":
            continue  # read from the config's own rope_freqs, checked to give its divisors back
        derived = _DERIVED.get(field, field)  # None there means "the usual", stated here
        ours, theirs = getattr(config, derived), getattr(read, derived)
        if field == "rope_attention_factor":  # a file states LongRoPE's even where derived
            ours, theirs = attention_factor(config), attention_factor(read)
        if isinstance(ours, float):  # GGUF stores float32
            ours, theirs = _f32(ours), _f32(theirs)
        if field in ("rope_short_factors", "rope_long_factors") and ours is not None:  # float32 tensors
            ours, theirs = tuple(map(_f32, ours)), tuple(map(_f32, theirs))
        if field not in _FREE and theirs != ours:
            raise InputError(field, f"{getattr(config, field)!r} cannot be exported to GGUF "
                             f"(a {arch} GGUF file says {getattr(read, field)!r})")
    return meta


def _f32(x: float) -> float:
    return float(np.float32(x))


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict:
    """`tokenizer.ggml.*` for a byte-level BPE tokenizer (and its chat template); rows of the
    model beyond the tokenizer's vocabulary are named as unused tokens."""
    data = json.loads(tokenizer.tokenizer.to_str()) if hasattr(tokenizer, "tokenizer") else {}
    model = data.get("model") or {}
    if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise InputError("tokenizer", "GGUF export writes byte-level BPE tokenizers only")
    pre = pre_name(data.get("pre_tokenizer")) or _pre_tokenizer(data.get("pre_tokenizer") or {})
    tokens = [""] * vocab_size
    types = [int(TokenType.UNUSED)] * vocab_size
    for token, i in model["vocab"].items():
        tokens[i], types[i] = token, int(TokenType.NORMAL)
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED)
    for i in range(vocab_size):
        if types[i] == TokenType.UNUSED:
            tokens[i] = f"<unused{i}>"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_bos_token": bool(getattr(tokenizer, "add_bos", False))}
    for key, i in (("eos", tokenizer.eos_id), ("bos", tokenizer.bos_id)):
        if i is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = i
    if getattr(tokenizer, "chat_template", None):
        meta["tokenizer.chat_template"] = tokenizer.chat_template
    return meta


def _pre_tokenizer(pre: dict) -> str:
    """The name llama.cpp gives the pre-tokenizer: GPT-2's byte-level split, alone or after
    single digits (SmolLM2's)."""
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(s.get("type"), s.get("individual_digits")) for s in steps]
    byte_level = steps[-1].get("type") == "ByteLevel" and not steps[-1].get("add_prefix_space")
    if byte_level and kinds[:-1] == []:
        return "gpt-2"
    if byte_level and kinds[:-1] == [("Digits", True)]:
        return "smollm"
    raise InputError("tokenizer", f"its pre-tokenizer ({', '.join(str(k) for k, _ in kinds)}) "
                     "has no GGUF name")


def export_gguf(model: Transformer, tokenizer, path: str | Path, dtype: str = "f32",
                force: bool = False) -> Path:
    """Write `model` and `tokenizer` as one GGUF file at `path`; an existing file is replaced
    only with `force`, a non-finite weight is refused by name. Returns the path."""
    if dtype not in DTYPES:
        raise InputError("dtype", f"unknown {dtype!r}; choose one of {', '.join(DTYPES)}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; GGUF export writes one file")
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (pass --force to replace it)")
    check_model_finite(model, "model")  # never a file the loaders would refuse
    config = model.config
    meta = gguf_metadata(config) | tokenizer_metadata(tokenizer, config.vocab_size)
    qtype, file_type = DTYPES[dtype]
    arrays = _tensors(model, config)
    for name, w in arrays.items():  # before anything is written
        block = _BLOCK.get(dtype)
        if w.ndim == 2 and block and w.shape[1] % block:
            raise InputError("dtype", f"{dtype} needs rows of whole {block}-value blocks; {name} "
                             f"has rows of {w.shape[1]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    os.close(fd)
    try:
        writer = GGUFWriter(tmp, meta["general.architecture"])
        writer.add_file_type(int(file_type))
        for key, value in meta.items():
            _add(writer, key, value)
        for name, w in arrays.items():
            if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
                writer.add_tensor(name, w)
            elif qtype == GGMLQuantizationType.F16:
                writer.add_tensor(name, w.astype(np.float16))
            else:
                writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def _tensors(model: Transformer, config: ModelConfig) -> dict[str, np.ndarray]:
    """Every GGUF tensor as float32 numpy, in llama.cpp's names and layout."""
    params = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    out = {}
    for name, target in tensor_map(config).items():
        w = params[target.param]
        if target.rows is not None:
            w = w[target.rows[0]:target.rows[1]]
        w = np.ascontiguousarray((w + target.shift if target.shift else w).numpy())
        out[name] = permute_rows(w, target.heads) if target.heads else w
    return out | factor_tensors(config)


def _add(writer: GGUFWriter, key: str, value) -> None:
    """One metadata value, through the writer's typed adder for its key."""
    if key == "tokenizer.ggml.merges":
        if value:  # a vocabulary of bytes alone has none
            writer.add_token_merges(value)
    elif key == "tokenizer.ggml.tokens":
        writer.add_token_list(value)
    elif key == "tokenizer.ggml.token_type":
        writer.add_token_types(value)
    elif key.endswith(".rope.scaling.type"):
        writer.add_rope_scaling_type(RopeScalingType(value))
    elif key == "general.architecture":
        return  # GGUFWriter writes it from its arch
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)
