"""Helpers of the hostile-input suite: tiny models in every format Glassformer reads, and a
snapshot of files' bytes to compare before and after a command."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from glassformer import ModelConfig, Transformer
from glassformer.formats.checkpoint import write_checkpoint
from glassformer.formats.export import export_hf
from glassformer.formats.tokenizers import CharTokenizer, HFTokenizer

CHARS = "".join(chr(c) for c in range(32, 127))
LLAMA = ModelConfig(vocab_size=128, context_length=64, d_model=32, n_layers=2, n_heads=4,
                    n_kv_heads=2, d_ff=64, position="rope", norm="rmsnorm", activation="silu",
                    gated=True, attn_bias=False, attn_out_bias=False, mlp_bias=False,
                    tie_embeddings=False)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def snapshot(*roots: Path) -> dict[Path, object]:
    """Every file's bytes (and every link's target) under `roots`."""
    out: dict[Path, object] = {}
    for root in roots:
        paths = [root] if not root.is_dir() or root.is_symlink() else [root, *root.rglob("*")]
        for path in paths:
            if path.is_symlink():
                out[path] = ("link", os.readlink(path))
            elif path.is_file():
                out[path] = path.read_bytes()
    return out


def write_gguf(path: Path, model: Transformer | None = None, meta: dict | None = None,
               tensors: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A tiny Llama GGUF as llama.cpp lays it out. `meta` overrides metadata values
    (key -> (value, GGUFValueType)) and `tensors` stored arrays, by GGUF name."""
    if model is None:
        torch.manual_seed(0)
        model = Transformer(LLAMA)
    c, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    H, KV = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    weights = {"token_embd.weight": sd["embed.tokens.weight"], "output.weight": sd["lm_head.weight"],
               "output_norm.weight": sd["final_norm.weight"]}
    for i in range(c.n_layers):
        qkv, up = sd[f"blocks.{i}.attn.qkv.weight"], sd[f"blocks.{i}.mlp.up.weight"]
        weights |= {f"blk.{i}.attn_q.weight": qkv[:H], f"blk.{i}.attn_k.weight": qkv[H:H + KV],
                    f"blk.{i}.attn_v.weight": qkv[H + KV:], f"blk.{i}.ffn_gate.weight": up[:c.d_ff],
                    f"blk.{i}.ffn_up.weight": up[c.d_ff:],
                    f"blk.{i}.attn_output.weight": sd[f"blocks.{i}.attn.out.weight"],
                    f"blk.{i}.ffn_down.weight": sd[f"blocks.{i}.mlp.down.weight"],
                    f"blk.{i}.attn_norm.weight": sd[f"blocks.{i}.norm1.weight"],
                    f"blk.{i}.ffn_norm.weight": sd[f"blocks.{i}.norm2.weight"]}
    weights |= tensors or {}
    vocab = [f"<|{i}|>" for i in range(c.vocab_size - 2)] + ["<|im_start|>", "<|im_end|>"]
    for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz "):
        vocab[i] = "Ġ" if ch == " " else ch
    vocab[27] = "ab"
    V = gguf.GGUFValueType
    values = {
        "llama.block_count": (c.n_layers, V.UINT32), "llama.context_length": (c.context_length, V.UINT32),
        "llama.embedding_length": (c.d_model, V.UINT32), "llama.feed_forward_length": (c.d_ff, V.UINT32),
        "llama.attention.head_count": (c.n_heads, V.UINT32),
        "llama.attention.head_count_kv": (c.kv_heads, V.UINT32),
        "llama.rope.dimension_count": (c.head_dim, V.UINT32),
        "llama.rope.freq_base": (c.rope_theta, V.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (c.norm_eps, V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.pre": ("smollm", V.STRING),
        "tokenizer.ggml.tokens": (vocab, V.ARRAY),
        "tokenizer.ggml.token_type": ([3 if v.startswith("<|im") else 1 for v in vocab], V.ARRAY),
        "tokenizer.ggml.merges": (["a b"], V.ARRAY),
        "tokenizer.ggml.bos_token_id": (c.vocab_size - 2, V.UINT32),
        "tokenizer.ggml.eos_token_id": (c.vocab_size - 1, V.UINT32),
        "tokenizer.chat_template": (TEMPLATE, V.STRING),
    } | (meta or {})
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind) in values.items():
        if value is not None:
            writer.add_key_value(key, value, kind, sub_type=V.STRING if key.endswith(
                ("tokens", "merges")) else V.INT32 if kind == V.ARRAY else None)
    for name, w in weights.items():
        if name in drop:
            continue
        if name.endswith(("attn_q.weight", "attn_k.weight")) and name not in (tensors or {}):
            heads = c.n_heads if "attn_q" in name else c.kv_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def checkpoint_folder(folder: Path, config: ModelConfig | None = None) -> Path:
    """A Glassformer checkpoint of a random model with a character tokenizer."""
    torch.manual_seed(0)
    config = config or ModelConfig(vocab_size=96, context_length=32, d_model=16, n_layers=1,
                                   n_heads=2)
    return write_checkpoint(folder, Transformer(config), CharTokenizer(CHARS), {})


def hf_folder(folder: Path) -> Path:
    """A Hugging Face Llama folder (config.json, model.safetensors, tokenizer files)."""
    torch.manual_seed(0)
    tokenizer = HFTokenizer.train_bpe(["the quick brown fox jumps over the lazy dog"] * 9, 300)
    return export_hf(Transformer(LLAMA.replace(vocab_size=300)), tokenizer, folder)
