"""The model families Glassformer reads and writes: one registry entry each.

An entry carries everything that differs by family: its Hugging Face `model_type` with the
reader of its config.json and its key map, the config.json export writes (`write`), which
configs it claims on export, its llama.cpp architecture (gguf_arch.Architecture: metadata
read and written, tensor names), and where transformers' model keeps what `compare` reads.
Its pieces are `ModelConfig` values computed in model/layers. The Hugging Face and GGUF
loaders and exporters, `compare`, `glassformer info` and the documentation's table of
supported models (docs/supported_models.py) all read `FAMILIES`; none of them names a family.

FAMILIES runs from the most general to the most specific: export writes a config as the last
family that claims it (`written_as`), so Llama, which claims any decoder, comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .gguf_arch import Architecture, Metadata, block_tensors, llama_like
from .gguf_gemma import gemma_architecture
from .gguf_neox import GPTNEOX, PHI3
from .huggingface_bert import POOLER_KEY, TIED_COPIES, bert_config, bert_hf_config, bert_keys
from .huggingface_gemma import gemma3_rope, gemma_config, gemma_hf_config, gemma_keys, is_gemma
from .huggingface_gpt2 import gpt2_config, gpt2_hf_config, gpt2_keys
from .huggingface_llama import (
    head_dim,
    llama_config,
    llama_hf,
    llama_hf_config,
    llama_keys,
    llama_sizes,
    mistral_hf,
    qwen2_hf,
)
from .huggingface_neox import NEOX_HEAD, neox_config, neox_hf_config, neox_keys
from .huggingface_phi3 import phi3_config, phi3_hf_config, phi3_keys
from .huggingface_qk import family_fields, qk_hf_config, with_defaults
from .huggingface_rope import rope_fields, rope_scaling_entry
from .huggingface_t5 import T5_TIED_COPIES, t5_config, t5_hf_config, t5_keys
from .refusals import plain_decoder, require
from .tensor_map import Entry

ConfigReader = Callable[[dict[str, Any]], ModelConfig]
KeyMap = Callable[[ModelConfig], list[Entry]]
Writer = Callable[[ModelConfig], dict[str, Any]]
Claim = Callable[[ModelConfig], bool]


def tied_head(config: ModelConfig) -> frozenset[str]:
    """The copy of a tied head a file may hold beside the token table (most families)."""
    return frozenset({"lm_head.weight"} if config.tie_embeddings else ())


@dataclass(frozen=True)
class Layout:
    """Where transformers' model of a family keeps what `compare` reads, as submodule paths:
    the base model, its layer list, a layer's attention (its output after W_O), the final
    norm (None: an encoder's masked-LM transform instead, `head_transform`, from the root)."""

    base: str
    layers: str
    attention: str
    final_norm: str | None
    head_transform: str | None = None


LLAMA_LAYOUT = Layout("model", "layers", "self_attn", "norm")  # self_attn before any output norm


@dataclass(frozen=True)
class Family:
    """One family: its names, how its files are read and written, and a tiny config.json of it."""

    name: str  # as its authors call it: "Gemma 2"
    model_type: str  # a Hugging Face config.json's model_type
    gguf: Architecture | None  # llama.cpp's architecture for it; None: not read from GGUF
    layout: str  # how its files lay out what our modules hold (what the key map does)
    read: ConfigReader  # config.json (a dict) -> ModelConfig, refusing what it cannot compute
    keys: KeyMap  # every tensor of its files, with where it goes here
    write: Writer  # ModelConfig -> its config.json, refusing by field what it cannot say
    claims: Claim  # the configs export writes as this family (unless a later family claims them)
    example: dict[str, Any]  # a tiny config.json: the configuration the docs' table checks
    compare: Layout | None = LLAMA_LAYOUT  # None: compare reads it otherwise (T5) or not at all
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


def _qk_write(kind: str) -> Writer:
    def write(config: ModelConfig) -> dict[str, Any]:
        plain_decoder(config, pre=False)
        return qk_hf_config(config, llama_hf_config(config), kind)
    return write


def _gemma_write(kind: str) -> Writer:
    return lambda config: gemma_hf_config(config, rope_scaling_entry(config), kind)


def _neox_write(config: ModelConfig) -> dict[str, Any]:
    plain_decoder(config)
    return neox_hf_config(config)


def _phi3_write(config: ModelConfig) -> dict[str, Any]:
    plain_decoder(config)
    return phi3_hf_config(config, rope_scaling_entry(config))


def _stablelm_config(hf: dict[str, Any]) -> ModelConfig:
    """StableLM: Llama's block and tensors with LayerNorms (and their biases), RoPE on the first
    partial_rotary_factor of each head (a quarter by default), optional q/k/v biases."""
    for flag in ("qk_layernorm", "use_parallel_residual"):
        if hf.get(flag):
            raise InputError(flag, f"StableLM's {flag} is not computed")
    if hf.get("hidden_act", "silu") != "silu":
        raise InputError("hidden_act", f"unsupported StableLM hidden_act {hf['hidden_act']!r} (silu only)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    d_head = head_dim(hf)
    rotary = int(d_head * float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))))
    return ModelConfig(
        **llama_sizes(hf), position="rope", **rope_fields(hf),
        rotary_dim=None if rotary == d_head else rotary, norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5), activation="silu", gated=True,
        attn_bias=bool(hf.get("use_qkv_bias", False)), attn_out_bias=False, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _stablelm_write(c: ModelConfig) -> dict[str, Any]:
    plain_decoder(c)
    require(c, "StableLM", norm_bias=True, parallel_block=False, activation="silu", qk_norm="none",
            attn_out_bias=False, mlp_bias=False, sliding_window=None, head_dim=c.d_model // c.n_heads)
    if c.rope_scaling not in ("none", "linear"):
        raise InputError("rope_scaling", f"{c.rope_scaling!r} cannot be exported as StableLM (none, linear)")
    rope = rope_scaling_entry(c) or {"rope_type": "default"}
    return {"model_type": "stablelm", "architectures": ["StableLmForCausalLM"],
            "vocab_size": c.vocab_size, "max_position_embeddings": c.context_length,
            "hidden_size": c.d_model, "intermediate_size": c.ff_dim, "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads, "num_key_value_heads": c.kv_heads,
            "hidden_act": "silu", "layer_norm_eps": c.norm_eps, "use_qkv_bias": c.attn_bias,
            "qk_layernorm": False, "use_parallel_residual": False,
            "rope_parameters": rope | {"rope_theta": c.rope_theta,
                                       "partial_rotary_factor": c.rotated_dim / c.head_dim},
            "tie_word_embeddings": c.tie_embeddings, "hidden_dropout": 0.0, "attention_dropout": 0.0}


def _stablelm_gguf(m: Metadata, tensors: Mapping[str, Any]) -> dict[str, Any]:
    return {"norm": "layernorm", "norm_eps": m.number("attention.layer_norm_epsilon"),
            "activation": "silu", "gated": True, "attn_bias": "blk.0.attn_q.bias" in tensors,
            "attn_out_bias": False, "mlp_bias": False}


# llama.cpp's stablelm: Llama's names, no row permuted, each norm's bias beside its weight
STABLELM = Architecture("stablelm", _stablelm_gguf,
                        lambda c: {"attention.layer_norm_epsilon": c.norm_eps}, block_tensors,
                        partial_rotary=True)


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


def _rope(config: ModelConfig) -> bool:
    return config.position == "rope"


FAMILIES: tuple[Family, ...] = (
    Family("Llama", "llama", llama_like("llama", permuted=True, rope_freqs=True),
           "q/k/v_proj and gate/up_proj stacked; W_Q, W_K rows permuted back from llama.cpp's "
           "pairs in GGUF", llama_config, llama_keys, llama_hf, lambda c: True,
           {"model_type": "llama", **_LLAMA}),
    Family("Mistral", "mistral", None, "Llama's tensors; llama.cpp writes it as a llama GGUF "
           "without its window, which loads as Llama", llama_config, llama_keys, mistral_hf,
           lambda c: c.sliding_window is not None,
           {"model_type": "mistral", **_LLAMA, "sliding_window": 16}),
    Family("Qwen2", "qwen2", llama_like("qwen2", attn_bias=True), "Llama's tensors with q/k/v "
           "biases", llama_config, llama_keys, qwen2_hf,
           lambda c: c.attn_bias and not c.attn_out_bias, {"model_type": "qwen2", **_LLAMA}),
    Family("Phi-3", "phi3", PHI3, "qkv_proj and gate_up_proj fused as ours (partial rotary and "
           "a window where its config.json sets them)", phi3_config, phi3_keys, _phi3_write,
           lambda c: _rope(c) and (c.rotary_dim is not None or c.rope_scaling == "longrope"),
           {"model_type": "phi3", **_LLAMA}),
    Family("GPT-NeoX / Pythia", "gpt_neox", GPTNEOX, "query_key_value fused per head, "
           "reordered", neox_config, neox_keys, _neox_write,
           lambda c: _rope(c) and (c.norm == "layernorm" or c.parallel_block),
           {"model_type": "gpt_neox", **_SIZES}, Layout("gpt_neox", "layers", "attention",
                                                         "final_layer_norm"), copies=_neox_copies),
    Family("StableLM", "stablelm", STABLELM, "Llama's tensors with LayerNorm biases; q/k/v "
           "biases where use_qkv_bias", _stablelm_config, llama_keys, _stablelm_write,
           lambda c: _rope(c) and c.norm == "layernorm" and c.gated,
           {"model_type": "stablelm", **_LLAMA}),
    Family("GPT-2", "gpt2", None, "Conv1D weights stored (in, out), transposed; c_attn fused",
           gpt2_config, gpt2_keys, gpt2_hf_config, lambda c: c.position == "learned",
           {"model_type": "gpt2", "vocab_size": 64, "n_positions": 64, "n_embd": 32, "n_layer": 2,
            "n_head": 4}, Layout("transformer", "h", "attn", "ln_f"), prefix="transformer."),
    Family("Qwen3", "qwen3", llama_like("qwen3", qk_norm="head"), "Llama's tensors with q_norm / "
           "k_norm", _qk_config, llama_keys, _qk_write("qwen3"), lambda c: c.qk_norm != "none",
           {"model_type": "qwen3", **_LLAMA, "head_dim": 8}),
    Family("OLMo 2", "olmo2", llama_like("olmo2", qk_norm="all", norm_placement="out"),
           "Llama's tensors, output norms in place of input norms", _qk_config, llama_keys,
           _qk_write("olmo2"),  # norms over all heads, or output norms without Qwen3's per head
           lambda c: c.qk_norm == "all" or (c.norm_placement == "out" and c.qk_norm == "none"),
           {"model_type": "olmo2", **_LLAMA}),
    Family("Gemma", "gemma", gemma_architecture("gemma"), "Llama's tensors; GGUF stores norms as "
           "1 + w", _gemma_config, gemma_keys, _gemma_write("gemma"), is_gemma,
           {"model_type": "gemma", **_LLAMA, "head_dim": 8}),
    Family("Gemma 2", "gemma2", gemma_architecture("gemma2"), "Gemma's tensors with four norms "
           "per block", _gemma_config, gemma_keys, _gemma_write("gemma2"),
           lambda c: is_gemma(c) and c.norm_placement == "sandwich",
           {"model_type": "gemma2", **_LLAMA, "head_dim": 8, "sliding_window": 16}),
    Family("Gemma 3", "gemma3_text", gemma_architecture("gemma3"), "Gemma 2's tensors with "
           "q_norm / k_norm; GGUF stores every norm as 1 + w", _gemma3_config, gemma_keys,
           _gemma_write("gemma3_text"), lambda c: is_gemma(c) and c.qk_norm != "none",
           {"model_type": "gemma3_text", **_LLAMA, "head_dim": 8, "sliding_window": 16}),
    Family("BERT", "bert", None, "BertForMaskedLM: query / key / value stacked; the pooler "
           "where the file has one", bert_config, bert_keys, bert_hf_config,
           lambda c: not c.causal, {"model_type": "bert", **_SIZES},
           Layout("bert", "encoder.layer", "attention.output.dense", None,
                  "cls.predictions.transform"), copies=_bert_copies, pooler_key=POOLER_KEY),
    Family("T5", "t5", None, "an encoder-decoder; its relative bias table per stack", t5_config,
           _t5_keys, t5_hf_config, lambda c: c.n_encoder_layers > 0,
           {"model_type": "t5", "vocab_size": 64, "d_model": 32, "d_kv": 8,
            "d_ff": 64, "num_layers": 2, "num_heads": 4}, None, copies=_t5_copies),
)
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}
BY_GGUF = {family.gguf.name: family for family in FAMILIES if family.gguf is not None}


def _lookup(table: dict[str, Family], key: Any, what: str) -> Family:
    """table[key], or an InputError naming `what` and the supported keys."""
    family = table.get(key) if isinstance(key, str) else None
    if family is None:
        raise InputError(None, f"unsupported {what} {key!r} (supported: {', '.join(table)})")
    return family


def family_of(model_type: Any) -> Family:
    """The family of a config.json's model_type, or an InputError naming the supported ones."""
    return _lookup(BY_MODEL_TYPE, model_type, "model_type")


def gguf_family(architecture: Any) -> Family:
    """The family of a GGUF file's general.architecture, or an InputError naming the supported ones."""
    return _lookup(BY_GGUF, architecture, "GGUF architecture")


def written_as(config: ModelConfig, gguf: bool = False) -> Family:
    """The family export writes `config` as: the last in FAMILIES that claims it (for GGUF,
    the last llama.cpp has, by its architecture's claim where that has its own)."""
    if gguf:
        return next(f for f in reversed(FAMILIES)
                    if f.gguf is not None and (f.gguf.claims or f.claims)(config))
    return next(f for f in reversed(FAMILIES) if f.claims(config))
