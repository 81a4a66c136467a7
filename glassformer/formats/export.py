"""Glassformer -> a Hugging Face model folder that `transformers` loads (the reverse of huggingface.py).

The family is read off the config: GPT-2 (learned positions, LayerNorm, biases, tied head) or
Llama (RoPE, RMSNorm, SwiGLU, no biases), Qwen2 (q/k/v biases only) and Mistral (a sliding
window), Qwen3 and OLMo 2 (query/key norms; huggingface_qk.py), Gemma, Gemma 2 and Gemma 3
(huggingface_gemma.py); RoPE with LayerNorm or a parallel block as GPT-NeoX (huggingface_neox.py),
Llama's block turning part of each head as Phi-3 (huggingface_phi3.py); an encoder-decoder as T5
(huggingface_t5.py), a bidirectional model as a BertForMaskedLM (huggingface_bert.py). A
config that none of them can express is refused with the field that stops it. The folder is
written whole beside its destination and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.encoder_decoder import EncoderDecoder
from ..model.transformer import Transformer
from .huggingface import key_map
from .huggingface_bert import bert_hf_config
from .huggingface_gemma import gemma_hf_config, is_gemma
from .huggingface_gpt2 import GPT2_ACTIVATIONS
from .huggingface_neox import neox_hf_config
from .huggingface_phi3 import phi3_hf_config
from .huggingface_qk import qk_hf_config
from .huggingface_t5 import t5_hf_config
from .tokenizers import HFTokenizer
from .validate import check_model_finite

_BERT_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                  "unk_token": "[UNK]"}
_GPT2_NAMES = {ours: theirs for theirs, ours in GPT2_ACTIVATIONS.items() if theirs != "gelu_pytorch_tanh"}


def _require(config: ModelConfig, family: str, **expected: Any) -> None:
    for field, value in expected.items():
        if getattr(config, field) != value:
            raise InputError(field, f"{getattr(config, field)!r} cannot be exported as {family} "
                             f"(needs {value!r})")


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json for a Glassformer config."""
    if config.n_encoder_layers:
        return t5_hf_config(config)
    if not config.causal:
        return bert_hf_config(config)
    if is_gemma(config):
        return gemma_hf_config(config, _rope_scaling(config))
    _require(config, "a Hugging Face model", final_norm=True, causal=True,
             lm_head_bias=False, scale_scores=True, scale_head_input=False, norm_weight_offset=0.0,
             embed_scale=False, attn_softcap=None, final_softcap=None, attn_scale=None,
             layer_windows=None, rope_local_theta=None)
    if config.qk_norm != "none" or config.norm_placement == "out":
        return qk_hf_config(config, _llama_hf_config(config))
    _require(config, "a Hugging Face model", norm_placement="pre")
    if config.position == "learned":
        _require(config, "GPT-2", norm="layernorm", gated=False, parallel_block=False,
                 attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True,
                 kv_heads=config.n_heads, head_dim=config.d_model // config.n_heads, sliding_window=None)
        if config.activation not in _GPT2_NAMES:
            raise InputError("activation", f"{config.activation!r} cannot be exported as GPT-2")
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": config.vocab_size, "n_positions": config.context_length,
                "n_embd": config.d_model, "n_layer": config.n_layers, "n_head": config.n_heads,
                "n_inner": config.ff_dim, "activation_function": _GPT2_NAMES[config.activation],
                "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": True,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if config.position == "rope" and (config.norm == "layernorm" or config.parallel_block):
        return neox_hf_config(config)
    if config.position == "rope" and (config.rotary_dim is not None or config.rope_scaling == "longrope"):
        return phi3_hf_config(config, _rope_scaling(config))
    _require(config, "Llama", position="rope", norm="rmsnorm", activation="silu", gated=True,
             parallel_block=False)
    if config.attn_out_bias and not config.attn_bias:
        raise InputError("attn_out_bias", "a bias on W_O alone cannot be exported")
    qwen = config.attn_bias and not config.attn_out_bias  # Qwen2: biases on q, k, v only
    kind = "qwen2" if qwen else "mistral" if config.sliding_window else "llama"
    out = {"model_type": kind,
           "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM"}[kind]], **_llama_hf_config(config)}
    if kind == "mistral":
        _require(config, "Mistral", attn_bias=False)
        out["sliding_window"] = config.sliding_window
    elif kind == "llama":
        _require(config, "Llama", sliding_window=None)
    if kind == "qwen2":
        _require(config, "Qwen2", mlp_bias=False)
        out |= {"use_sliding_window": config.sliding_window is not None,
                "sliding_window": config.sliding_window, "max_window_layers": 0}
    return out


def _llama_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a Llama-like model (refused by field where it is not one)."""
    _require(config, "Llama", position="rope", norm="rmsnorm", activation="silu", gated=True)
    if config.rope_scaling not in ("none", "linear", "llama3", "yarn"):
        raise InputError("rope_scaling", f"{config.rope_scaling!r} cannot be exported as Llama "
                         "(none, linear, llama3, yarn)")
    return {"vocab_size": config.vocab_size, "max_position_embeddings": config.context_length,
            "hidden_size": config.d_model, "intermediate_size": config.ff_dim,
            "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.norm_eps, "hidden_act": "silu", "rope_theta": config.rope_theta,
            "rope_scaling": _rope_scaling(config),
            "tie_word_embeddings": config.tie_embeddings, "attention_bias": config.attn_out_bias,
            "mlp_bias": config.mlp_bias, "attention_dropout": 0.0}


def _rope_scaling(config: ModelConfig) -> dict | None:
    """The Hugging Face rope_scaling entry of a config (huggingface_rope.py `_rope_scaling` reversed)."""
    if config.rope_scaling == "none":
        return None
    entry = {"rope_type": config.rope_scaling, "factor": config.rope_factor}
    if config.rope_scaling in ("llama3", "yarn", "longrope"):
        entry["original_max_position_embeddings"] = config.original_context
    if config.rope_scaling == "llama3":
        entry |= {"low_freq_factor": config.rope_low_freq_factor,
                  "high_freq_factor": config.rope_high_freq_factor}
    if config.rope_scaling == "yarn":
        entry |= {"beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow,
                  "truncate": config.rope_truncate}
    if config.rope_scaling == "longrope":
        entry |= {"short_factor": list(config.rope_short_factors),
                  "long_factor": list(config.rope_long_factors)}
    if config.rope_attention_factor is not None:
        entry["attention_factor"] = config.rope_attention_factor
    return entry


def export_hf(model: Transformer | EncoderDecoder, tokenizer: Any, folder: str | Path) -> Path:
    """Write config.json, model.safetensors and (for tokenizers.json-based tokenizers) the
    tokenizer files into a new folder (a non-finite weight is refused by name); returns it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder")
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    check_model_finite(model, "model")  # never a folder the loaders would refuse
    config = model.config
    hf = hf_config(config)
    ours = model.state_dict()
    tensors = {}
    for e in key_map(config, hf["model_type"]):
        t = ours[e.ours] if e.rows is None else ours[e.ours][e.rows[0]:e.rows[1]]
        if e.order is not None:  # theirs = ours[argsort(order)]
            t = t[torch.tensor(e.order).argsort()]
        tensors[e.hf] = (t.T if e.transpose else t).detach().to("cpu").contiguous()
    if isinstance(tokenizer, HFTokenizer):
        hf |= {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        hf |= {f"{name}_id": vocab[token] for name, token in getattr(tokenizer, "specials", {}).items()
               if token in vocab}  # pad_token_id, unk_token_id
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if isinstance(tokenizer, HFTokenizer):
            _save_tokenizer(tokenizer, tmp)
        if folder.exists():
            folder.rmdir()
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _save_tokenizer(tokenizer: HFTokenizer, folder: Path) -> None:
    tokenizer.save(folder / "tokenizer.json")  # a ChatTokenizer also writes tokenizer_config.json
    side = folder / "tokenizer_config.json"
    config = json.loads(side.read_text()) if side.is_file() else {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token}
    if tokenizer.mask_token is not None:  # an encoder's: the mask and BERT's other specials
        vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        config |= {"mask_token": tokenizer.mask_token}
        config |= {key: token for key, token in _BERT_SPECIALS.items() if token in vocab}
    side.write_text(json.dumps(config, indent=2) + "\n")
