"""The model families Glassformer loads: one registry entry each.

A family is a Hugging Face `model_type` (and, where llama.cpp has one, its GGUF architecture)
read into `ModelConfig` values by its config reader, its tensors placed by its key map. The
Hugging Face loader (huggingface.py), `glassformer info` and the documentation's table of
supported models (docs/supported_models.py) all read `FAMILIES`; adding a family is one entry
here (its reader and key map beside the others in formats/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .huggingface_bert import POOLER_KEY, TIED_COPIES, bert_config, bert_keys
from .huggingface_gemma import gemma3_rope, gemma_config, gemma_keys
from .huggingface_gpt2 import gpt2_config, gpt2_keys
from .huggingface_llama import llama_config, llama_keys
from .huggingface_neox import NEOX_HEAD, neox_config, neox_keys
from .huggingface_phi3 import phi3_config, phi3_keys
from .huggingface_qk import family_fields, with_defaults
from .huggingface_rope import rope_fields
from .huggingface_t5 import T5_TIED_COPIES, t5_config, t5_keys
from .tensor_map import Entry

ConfigReader = Callable[[dict[str, Any]], ModelConfig]
KeyMap = Callable[[ModelConfig], list[Entry]]


def tied_head(config: ModelConfig) -> frozenset[str]:
    """The copy of a tied head a file may hold beside the token table (most families)."""
    return frozenset({"lm_head.weight"} if config.tie_embeddings else ())


@dataclass(frozen=True)
class Family:
    """One family: its names, its reader and key map, and a tiny config.json of it."""

    name: str  # as its authors call it: "Gemma 2"
    model_type: str  # a Hugging Face config.json's model_type
    gguf: str | None  # llama.cpp's general.architecture for it; None: not read from GGUF
    layout: str  # how its files lay out what our modules hold (what the key map does)
    read: ConfigReader  # config.json (a dict) -> ModelConfig, refusing what it cannot compute
    keys: KeyMap  # every tensor of its files, with where it goes here
    example: dict[str, Any]  # a tiny config.json: the configuration the docs' table checks
    copies: Callable[[ModelConfig], frozenset[str]] = tied_head  # copies a file may also hold
    prefix: str = ""  # a prefix of its tensor names that some files leave out
    pooler_key: str | None = None  # the tensor that says the file holds a pooler


def _qk_config(hf: dict[str, Any]) -> ModelConfig:
    hf = with_defaults(hf)
    return llama_config(hf).replace(**family_fields(hf))


def _gemma_config(hf: dict[str, Any]) -> ModelConfig:
    return gemma_config(hf, rope_fields(hf))


def _gemma3_config(hf: dict[str, Any]) -> ModelConfig:
    """Gemma 3: the full layers' RoPE as rope_fields reads it, the sliding layers' own base."""
    full, local_theta = gemma3_rope(hf)
    return gemma_config(hf, {**rope_fields(hf | {"rope_parameters": full}), "rope_local_theta": local_theta})


def _t5_keys(config: ModelConfig) -> list[Entry]:
    return [Entry(hf, ours, rows) for hf, ours, rows in t5_keys(config)]


def _t5_copies(config: ModelConfig) -> frozenset[str]:
    return tied_head(config) | set(T5_TIED_COPIES)


def _bert_copies(config: ModelConfig) -> frozenset[str]:
    return frozenset(({TIED_COPIES[0]} if config.tie_embeddings else set()) | {TIED_COPIES[1]})


def _neox_copies(config: ModelConfig) -> frozenset[str]:
    return frozenset({NEOX_HEAD} if config.tie_embeddings else ())


_SIZES = {"vocab_size": 64, "max_position_embeddings": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_LLAMA = _SIZES | {"num_key_value_heads": 2}

FAMILIES: tuple[Family, ...] = (
    Family("GPT-2", "gpt2", None, "Conv1D weights stored (in, out), transposed; c_attn fused",
           gpt2_config, gpt2_keys,
           {"model_type": "gpt2", "vocab_size": 64, "n_positions": 64, "n_embd": 32, "n_layer": 2,
            "n_head": 4}, prefix="transformer."),
    Family("Llama", "llama", "llama", "q/k/v_proj and gate/up_proj stacked; W_Q, W_K rows "
           "permuted back from llama.cpp's pairs in GGUF", llama_config, llama_keys,
           {"model_type": "llama", **_LLAMA}),
    Family("Mistral", "mistral", None, "Llama's tensors; llama.cpp writes it as a llama GGUF "
           "without its window, which loads as Llama", llama_config, llama_keys,
           {"model_type": "mistral", **_LLAMA, "sliding_window": 16}),
    Family("Qwen2", "qwen2", "qwen2", "Llama's tensors with q/k/v biases", llama_config,
           llama_keys, {"model_type": "qwen2", **_LLAMA}),
    Family("Qwen3", "qwen3", "qwen3", "Llama's tensors with q_norm / k_norm", _qk_config,
           llama_keys, {"model_type": "qwen3", **_LLAMA, "head_dim": 8}),
    Family("OLMo 2", "olmo2", "olmo2", "Llama's tensors, output norms in place of input norms",
           _qk_config, llama_keys, {"model_type": "olmo2", **_LLAMA}),
    Family("Gemma", "gemma", "gemma", "Llama's tensors; GGUF stores norms as 1 + w",
           _gemma_config, gemma_keys, {"model_type": "gemma", **_LLAMA, "head_dim": 8}),
    Family("Gemma 2", "gemma2", "gemma2", "Gemma's tensors with four norms per block",
           _gemma_config, gemma_keys,
           {"model_type": "gemma2", **_LLAMA, "head_dim": 8, "sliding_window": 16}),
    Family("Gemma 3", "gemma3_text", "gemma3", "Gemma 2's tensors with q_norm / k_norm; GGUF "
           "stores every norm as 1 + w", _gemma3_config, gemma_keys,
           {"model_type": "gemma3_text", **_LLAMA, "head_dim": 8, "sliding_window": 16}),
    Family("GPT-NeoX / Pythia", "gpt_neox", "gptneox", "query_key_value fused per head, "
           "reordered", neox_config, neox_keys, {"model_type": "gpt_neox", **_SIZES},
           copies=_neox_copies),
    Family("Phi-3", "phi3", "phi3", "qkv_proj and gate_up_proj fused as ours (partial rotary and "
           "a window where its config.json sets them)", phi3_config,
           phi3_keys, {"model_type": "phi3", **_LLAMA}),
    Family("T5", "t5", None, "an encoder-decoder; its relative bias table per stack", t5_config,
           _t5_keys, {"model_type": "t5", "vocab_size": 64, "d_model": 32, "d_kv": 8,
                      "d_ff": 64, "num_layers": 2, "num_heads": 4}, copies=_t5_copies),
    Family("BERT", "bert", None, "BertForMaskedLM: query / key / value stacked; the pooler "
           "where the file has one", bert_config, bert_keys,
           {"model_type": "bert", **_SIZES}, copies=_bert_copies, pooler_key=POOLER_KEY),
)
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}
BY_GGUF = {family.gguf: family for family in FAMILIES if family.gguf is not None}


def family_of(model_type: Any) -> Family:
    """The family of a config.json's model_type, or an InputError naming the supported ones."""
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise InputError(None, f"unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(BY_MODEL_TYPE)})")
    return family
