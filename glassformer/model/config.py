"""ModelConfig: every architectural choice of a transformer (decoder-only, or encoder-decoder
when n_encoder_layers > 0), validated once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

from ..errors import InputError

Position = Literal["learned", "sinusoidal", "rope", "alibi", "relative", "none"]
Norm = Literal["layernorm", "rmsnorm"]
# sandwich (Gemma 2/3): x + Norm'(Attn(Norm(x))); out (OLMo 2): x + Norm(Attn(x)), no input norm
NormPlacement = Literal["pre", "post", "sandwich", "out"]
QkNorm = Literal["none", "head", "all"]  # RMSNorm of Q and K over each head, or over all heads
Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
AttentionKernel = Literal["reference", "sdpa", "flash"]
RopeScaling = Literal["none", "linear", "ntk", "yarn", "llama3", "longrope"]
Head = Literal["lm", "mlm"]  # mlm: BERT's dense + activation + norm before the decoder


Config = TypeVar("Config", bound="ConfigFields")


class ConfigFields:
    """JSON round trip and re-validated copies for the frozen config dataclasses."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[Config], values: dict[str, Any]) -> Config:
        if not isinstance(values, dict):
            raise InputError(cls.__name__, f"expected an object of fields, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(unknown[0], f"not a {cls.__name__} field")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise InputError(missing[0], f"a required {cls.__name__} field is missing")
        # JSON holds a tuple field as a list
        values = {name: tuple(v) if isinstance(v, list) and "tuple" in str(_field_types(cls)[name])
                  else v for name, v in values.items()}
        return cls(**values)

    def replace(self: Config, **changes: Any) -> Config:
        """A new, re-validated config with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelConfig(ConfigFields):
    """The architecture. Optional sizes (`n_kv_heads`, `d_head`, `d_ff`) default through the
    properties `kv_heads`, `head_dim` and `ff_dim`; fields are never rewritten."""

    vocab_size: int
    context_length: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: = n_heads (MHA); 1: MQA; between: GQA
    d_head: int | None = None  # None: d_model // n_heads
    d_ff: int | None = None  # None: 4 * d_model
    position: Position = "learned"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = "none"  # context extension for RoPE (see layers/positions.py)
    rope_factor: float = 1.0  # new context / original context
    rope_original_context: int | None = None  # None: context_length / rope_factor
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths past original / this are interpolated
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original / this are kept
    rope_beta_fast: float = 32.0  # yarn: pairs turning more often than this over the original are kept
    rope_beta_slow: float = 1.0  # yarn: pairs turning less often than this are interpolated
    rope_truncate: bool = True  # yarn: the band's edges rounded out to whole dimensions
    rope_attention_factor: float | None = None  # yarn, longrope: cos and sin times this; None: derived
    rope_short_factors: tuple[float, ...] | None = None  # longrope: θ_i divided by these (a short text)
    rope_long_factors: tuple[float, ...] | None = None  # longrope: ... by these past the original context
    rotary_dim: int | None = None  # partial rotary: only each head's first rotary_dim turn; None: all
    norm: Norm = "layernorm"
    norm_placement: NormPlacement = "pre"
    qk_norm: QkNorm = "none"  # RMSNorm on Q and K after the projection, before RoPE
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm's additive bias (RMSNorm has none)
    parallel_block: bool = False  # x + Attn(Norm1(x)) + FFN(Norm2(x)) (GPT-NeoX, layers/block.py)
    activation: Activation = "gelu"
    gated: bool = False  # SwiGLU = silu + gated, GeGLU = gelu + gated
    attn_bias: bool = True  # biases on the Q, K, V projections
    attn_out_bias: bool = True  # bias on the output projection W_O
    mlp_bias: bool = True
    lm_head_bias: bool = False
    final_norm: bool = True
    tie_embeddings: bool = True
    causal: bool = True  # False: bidirectional (encoder) mask
    sliding_window: int | None = None  # attend to at most this many most recent positions
    dropout: float = 0.0
    attention_kernel: AttentionKernel = "sdpa"
    init_std: float = 0.02
    # Encoder parts (BERT): segment embeddings, a norm on the embeddings, the head, the pooler.
    n_token_types: int = 0  # token-type (segment) embeddings; 0: none
    embed_norm: bool = False  # a norm on the summed embeddings, before the first block
    head: Head = "lm"
    pooler: bool = False  # dense + tanh on the first token's final hidden state
    # Encoder-decoder (T5, Vaswani et al.): n_layers is then the decoder's depth.
    n_encoder_layers: int = 0  # 0: decoder-only; > 0: an encoder, and cross-attention per block
    decoder_start_id: int = 0  # the token a decoder starts from (T5: its pad id)
    relative_buckets: int = 32  # position="relative" (T5): buckets of key-minus-query distance
    relative_max_distance: int = 128  # distances beyond this share the last bucket
    scale_scores: bool = True  # False: Q Kᵀ is not divided by √d_head (T5 folds it into the init)
    scale_head_input: bool = False  # True: h · d_model^-½ before the head (T5 v1.0's tied head)
    # Gemma: RMSNorm times (offset + w), embeddings times √d_model, soft-capped scores and
    # logits (c · tanh(x / c)), scores times attn_scale^-½, windows that differ by layer, and
    # (Gemma 3) a RoPE base of the sliding layers' own.
    norm_weight_offset: float = 0.0  # every RMSNorm's, the query/key norms' included
    embed_scale: bool = False  # token embeddings times √d_model, rounded in the model's dtype
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_scale: float | None = None  # None: scores times d_head^-½
    layer_windows: tuple[int | None, ...] | None = None  # per layer (None: global); None: sliding_window
    # the RoPE base of the sliding-window layers, which then take no rope scaling; None: every
    # layer turns by rope_theta and the scaling
    rope_local_theta: float | None = None

    def __post_init__(self) -> None:
        check_finite(self)
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            _positive(name, getattr(self, name))
        for name in ("relative_buckets", "relative_max_distance"):
            _positive(name, getattr(self, name))
        if self.n_encoder_layers < 0:
            raise InputError("n_encoder_layers", f"must be 0 or more, got {self.n_encoder_layers}")
        if not 0 <= self.decoder_start_id < self.vocab_size:
            raise InputError("decoder_start_id", f"{self.decoder_start_id} is not a token id below "
                             f"vocab_size={self.vocab_size}")
        if self.n_encoder_layers and self.norm_placement == "out":
            raise InputError("norm_placement", "an encoder-decoder's blocks are 'pre' or 'post'")
        if self.n_encoder_layers and self.qk_norm != "none":
            raise InputError("qk_norm", "an encoder-decoder's attention has no query/key norms")
        if self.n_encoder_layers and not self.causal:
            raise InputError("causal", "an encoder-decoder's decoder is causal (its encoder is not)")
        if self.position == "relative" and self.relative_buckets < 4:
            raise InputError("relative_buckets", f"needs at least 4, got {self.relative_buckets}")
        for name in ("n_kv_heads", "d_head", "d_ff", "sliding_window", "rope_original_context",
                     "rotary_dim"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name, kind in (
            ("position", Position),
            ("norm", Norm),
            ("norm_placement", NormPlacement),
            ("qk_norm", QkNorm),
            ("activation", Activation),
            ("attention_kernel", AttentionKernel),
            ("rope_scaling", RopeScaling),
            ("head", Head),
        ):
            if getattr(self, name) not in get_args(kind):
                raise InputError(name,
                    f"unknown value {getattr(self, name)!r}; choose one of {get_args(kind)}"
                )
        if self.d_head is None and self.d_model % self.n_heads:
            raise InputError("d_model",
                f"{self.d_model} is not divisible by n_heads={self.n_heads} "
                "(or set d_head explicitly)"
            )
        if self.n_heads % self.kv_heads:
            raise InputError("n_kv_heads",
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise InputError("d_head", f"RoPE needs an even head size, got {self.head_dim}")
        if self.rotary_dim is not None and (self.position != "rope" or self.rotary_dim % 2
                                            or self.rotary_dim > self.head_dim):
            raise InputError("rotary_dim", f"needs position='rope' and an even size up to d_head="
                             f"{self.head_dim}, got {self.rotary_dim}")
        if self.rope_scaling == "ntk" and self.position == "rope" and self.rotated_dim < 4:
            raise InputError("rope_scaling", "NTK scaling stretches the base by s^(d/(d-2)): it needs "
                             f"at least 4 rotated dimensions, got {self.rotated_dim}")
        if self.parallel_block and (self.norm_placement != "pre" or self.n_encoder_layers):
            raise InputError("parallel_block", "a parallel block is pre-norm and decoder-only")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise InputError("d_model", f"sinusoidal positions need an even d_model, got {self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise InputError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0:
            raise InputError("norm_eps", f"must be positive, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise InputError("rope_theta", f"must be positive, got {self.rope_theta}")
        if self.rope_factor < 1.0:
            raise InputError("rope_factor", f"must be >= 1, got {self.rope_factor}")
        if self.rope_scaling != "none" and self.position != "rope":
            raise InputError("rope_scaling", "context extension applies to position='rope' only")
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise InputError("rope_low_freq_factor",
                             "needs 0 < rope_low_freq_factor < rope_high_freq_factor, "
                             f"got {self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
        self._check_rope_extension()
        if self.init_std <= 0:
            raise InputError("init_std", f"must be positive, got {self.init_std}")
        self._check_gemma_fields()
        if isinstance(self.n_token_types, bool) or self.n_token_types < 0:
            raise InputError("n_token_types", f"must be >= 0, got {self.n_token_types!r}")

    def _check_rope_extension(self) -> None:
        for name in ("rope_beta_fast", "rope_beta_slow"):
            if getattr(self, name) <= 0:
                raise InputError(name, f"must be positive, got {getattr(self, name)}")
        if self.rope_attention_factor is not None:
            if self.rope_scaling not in ("yarn", "longrope"):
                raise InputError("rope_attention_factor", "applies to rope_scaling 'yarn' or 'longrope'")
            if self.rope_attention_factor <= 0:
                raise InputError("rope_attention_factor",
                                 f"must be positive, got {self.rope_attention_factor}")
        for name in ("rope_short_factors", "rope_long_factors"):
            factors = getattr(self, name)
            if (factors is None) != (self.rope_scaling != "longrope"):
                raise InputError(name, "longrope needs its short and long factors; "
                                 "other scalings take none")
            if factors is None:
                continue
            if (not isinstance(factors, tuple) or len(factors) != self.rotated_dim // 2
                    or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                               and math.isfinite(f) and f > 0 for f in factors)):
                raise InputError(name, f"needs a tuple of rotated_dim / 2 = {self.rotated_dim // 2} "
                                 f"positive numbers, got {factors!r}")
        if self.rope_scaling == "longrope" and (self.rope_original_context or 0) < 2:
            raise InputError("rope_original_context", "longrope switches factors past the "
                             f"original context: give it (2 or more), got {self.rope_original_context}")

    def _check_gemma_fields(self) -> None:
        for name in ("attn_softcap", "final_softcap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise InputError(name, f"must be a positive number or None, got {value!r}")
        if self.attn_scale is not None and not self.scale_scores:
            raise InputError("attn_scale", "sets the scores' scale, which scale_scores=False removes")
        if self.norm_placement == "sandwich" and self.n_encoder_layers:
            raise InputError("norm_placement", "sandwich norms are for decoder-only models")
        if self.norm_weight_offset and self.norm != "rmsnorm":
            raise InputError("norm_weight_offset", "applies to norm='rmsnorm' only")
        if self.rope_local_theta is not None and not (
                self.position == "rope" and self.rope_local_theta > 0):
            raise InputError("rope_local_theta", f"needs position='rope' and a positive base, got "
                             f"{self.rope_local_theta!r} with position={self.position!r}")
        windows = self.layer_windows
        if windows is None:
            return
        if not isinstance(windows, tuple) or len(windows) != self.n_layers:
            raise InputError("layer_windows", f"needs a tuple of n_layers={self.n_layers} windows "
                             f"(an int, or None for a global layer), got {windows!r}")
        for window in windows:
            if window is not None:
                _positive("layer_windows", window)
        if self.sliding_window is not None:
            raise InputError("layer_windows", "give either sliding_window (every layer) or "
                             "layer_windows (each layer's), not both")
        if self.n_encoder_layers:
            raise InputError("layer_windows", "per-layer windows are for decoder-only models")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of one layer (None: it attends to every earlier position)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    def local_rope(self, layer: int) -> bool:
        """Whether a layer turns by rope_local_theta (a sliding layer, where it is set)."""
        return self.rope_local_theta is not None and self.window_of(layer) is not None

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.d_head is None else self.d_head

    @property
    def ff_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head."""
        return self.n_heads // self.kv_heads

    @property
    def rotated_dim(self) -> int:
        """How many of each head's dimensions RoPE turns (the first ones)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def original_context(self) -> int:
        """The context the RoPE model was trained on (before any extension)."""
        if self.rope_original_context is not None:
            return self.rope_original_context
        return int(self.context_length / self.rope_factor)



def _field_types(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_finite(config: Any) -> None:
    """Every int, float, bool or str field of a config dataclass holds that type (a JSON file
    may hold anything), and every float is finite (NaN passes `< 0` checks)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        kind = str(field.type).removesuffix(" | None")
        if value is None and str(field.type).endswith("| None"):
            continue
        if kind in _KINDS and (not isinstance(value, _KINDS[kind])
                               or (kind != "bool" and isinstance(value, bool))):
            raise InputError(field.name, f"expected {kind}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(field.name, f"must be a finite number, got {value}")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(name, f"must be a positive integer, got {value!r}")
