"""The decode step in one C++ call: every layer of a converted model with no Python between.

Once `quantize_model` has given a model its decode kernels, a step for one sequence is the
same arithmetic as `model(token, cache=cache)`; only the dispatch differs. Python embeds the
token, C++ (csrc/decode_step.cpp) runs norm, QKV, RoPE, the cache write, attention, W_O,
norm and feed-forward for every layer, and Python applies the final norm and the head's math
(`head`); the C++ layers also compute the query/key norms, the output norms (OLMo 2, Gemma 2's
sandwich), Gemma's (1 + w) norms, soft-capped scores, each layer's own window and each layer's
kind of RoPE angles (Gemma 3's sliding layers turn by their own base).
`CAPABILITIES` lists, field by field of the config, what the C++ layers compute;
a model whose config it refuses keeps the module path. The model owns its step
(`Transformer.fused_step`), built by `FastDecoder.build` and dropped whenever its tensors
change; `why_not` says why a model cannot take it. `rows` is the same
step for one new token of each of several sequences whose keys and values sit in a paged
pool (the serving engine's decode steps); each row's numbers are those `__call__` gives it,
plus, for a row on a LoRA adapter (`fused_adapter`), that adapter's updates of its products.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..model.kv_cache import KVCache
from ..model.layers.positions import RopeAngles
from ..model.transformer import Transformer, read_out
from . import kernels
from .capabilities import CapabilityTable, any_value, only
from .quantized_linear import QuantizedLinear
from .stacked_linear import StackedLinear

_SIZES = "sizes and layouts are the C++ step's own parameters"
_PYTHON = "Python computes it around the C++ layers"

# What csrc/decode_step.cpp computes, field by field; Python embeds the token before the
# layers and applies the final norm and the head after them (__call__).
CAPABILITIES = CapabilityTable("fused decode step", {
    "vocab_size": any_value(_PYTHON), "context_length": any_value(),
    "d_model": any_value(_SIZES), "n_layers": any_value(_SIZES), "n_heads": any_value(_SIZES),
    "n_kv_heads": any_value(_SIZES), "d_head": any_value(_SIZES), "d_ff": any_value(_SIZES),
    "position": only("learned", "sinusoidal", "rope", "alibi", "none",
                     reason="T5's relative bias is not added to the scores"),
    "rope_theta": any_value("the angles come from Python"),
    "rope_scaling": any_value("the angles come from Python"),
    "rope_factor": any_value("the angles come from Python"),
    "rope_original_context": any_value("the angles come from Python"),
    "rope_low_freq_factor": any_value("the angles come from Python"),
    "rope_high_freq_factor": any_value("the angles come from Python"),
    **{name: any_value("the angles come from Python, each step's set by its position") for name in (
        "rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_attention_factor",
        "rope_short_factors", "rope_long_factors")},
    "rotary_dim": any_value("the C++ RoPE turns each head's first rotary_dim dimensions"),
    "norm": any_value("rmsnorm and layernorm rows"),
    "norm_placement": only("pre", "out", "sandwich", reason="the layers norm each sublayer's input "
                           "or output, never the residual stream itself"),
    "qk_norm": any_value("RMSNorm rows over each head's or all heads' queries and keys"),
    "norm_eps": any_value(), "norm_bias": any_value("a bias where the norm has one"),
    "parallel_block": any_value("the feed-forward reads the layer's input"),
    "activation": any_value("relu, gelu, gelu_tanh and silu rows"), "gated": any_value(),
    "attn_bias": any_value("a bias where the product has one"), "attn_out_bias": any_value(),
    "mlp_bias": any_value(), "lm_head_bias": any_value(_PYTHON), "final_norm": any_value(_PYTHON),
    "tie_embeddings": any_value(_PYTHON),
    "causal": only(True, reason="one new token attends to the cache before it"),
    "sliding_window": any_value("the first position attended moves with the window"),
    "layer_windows": any_value("each layer's own window, passed to the C++ layers"),
    "dropout": any_value("inference only: no dropout"),
    "attention_kernel": any_value("every kernel computes the same function"),
    "init_std": any_value(), "n_token_types": any_value(_PYTHON), "embed_norm": any_value(_PYTHON),
    "head": any_value(_PYTHON), "pooler": any_value("not part of decoding"),
    "n_encoder_layers": only(0, reason="no cross-attention to an encoder"),
    "decoder_start_id": any_value("an encoder-decoder's field"),
    "relative_buckets": any_value("read with position='relative' only"),
    "relative_max_distance": any_value("read with position='relative' only"),
    "scale_scores": any_value("scores times 1/sqrt(d_head), or 1"),
    "attn_scale": any_value("scores times attn_scale^-1/2"),
    "attn_softcap": any_value("the C++ scores capped to c tanh(s / c) before ALiBi and softmax"),
    "scale_head_input": any_value(_PYTHON),
    "norm_weight_offset": any_value("the C++ RMSNorm rows (block, query, key) scale by offset + w"),
    "embed_scale": any_value("Python embeds the token with the model's own embedding"),
    "final_softcap": any_value(_PYTHON),
    "rope_local_theta": any_value("the angles of each kind of layer come from Python; each layer "
                                  "turns by its kind's (ModelConfig.local_rope)"),
})


# A block's products as the C++ layers name them: the only ones an adapter's update can go to.
_PRODUCTS = {"attn.qkv": "qkv", "attn.out": "out", "mlp.up": "up", "mlp.down": "down"}

LoRAFactors = tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]  # (A stacked, [(start, scale·B)])


def fused_adapter(n_layers: int, updates: dict[tuple[int, str], LoRAFactors]):
    """A LoRA adapter as `rows` takes it, holding these tensors: `updates` maps (layer, product
    path in a block) -> A (n·r, d_in), the n targets' stacked, and per target its first output
    row and scale · B (rows, r). None where the step cannot add it as the module path does (a
    product the C++ layers do not have, tensors other than float32 on the CPU, no kernels):
    the adapter's rows then keep the module path."""
    tensors = [t for a, ups in updates.values() for t in (a, *(b for _, b in ups))]
    if (any(path not in _PRODUCTS for _, path in updates) or not kernels.available()
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)):
        return None
    layers: list[dict[str, kernels.LoRAUpdate]] = [{} for _ in range(n_layers)]
    for (i, path), (a, ups) in updates.items():
        layers[i][_PRODUCTS[path]] = kernels.LoRAUpdate(
            a.contiguous(), [(start, b.contiguous()) for start, b in ups])
    return kernels.adapter_weights(layers)


def why_not(model: Transformer) -> str | None:
    """The reason `model` cannot use the fused step now, or None when it can."""
    if model.training or torch.is_grad_enabled():
        return "inference only (eval mode, no grad)"
    if model.hooks:
        return "hooks are installed: the module path shows every site"
    return _static_reason(model)


def can_build(model: Transformer) -> bool:
    """Whether `model`'s tensors and the kernels allow the step (why_not adds the run-time
    conditions: eval mode, no grad, no hooks)."""
    return _static_reason(model) is None


def _static_reason(model: Transformer) -> str | None:
    embedding = model.embed.tokens.weight
    reason = CAPABILITIES.why_not(model.config)
    if reason is not None:
        return reason
    if not all(isinstance(layer, (QuantizedLinear, StackedLinear))
               for layer in model.linear_layers().values()):
        return "the model has no decode kernels (see glassformer.quantize)"
    if embedding.device.type != "cpu" or embedding.dtype != torch.float32:
        return "float32 on the CPU only"
    if not kernels.available():
        return "the C++ kernels are not available"
    return None


class FastDecoder:
    """The fused step of one model as it is now: it holds the model's tensors, not copies."""

    @classmethod
    def build(cls, model: Transformer) -> FastDecoder | None:
        """The step for `model`, or None where it does not apply to it."""
        return cls(model) if can_build(model) else None

    def __init__(self, model: Transformer) -> None:
        config = model.config
        # the model's parts, not the model: a step kept alive keeps no model alive
        self.config, self.embed, self.final_norm = config, model.embed, model.final_norm
        self.head_transform, self.lm_head = model.head_transform, model.lm_head
        self.rope = model.rope_sets() if config.position == "rope" else None
        layers = [kernels.LayerWeights(_norm(block.norm1), block.attn.qkv.kernel_weights(),
                                       block.attn.out.kernel_weights(), _norm(block.norm2),
                                       block.mlp.up.kernel_weights(),
                                       block.mlp.down.kernel_weights(), _norm(block.attn.q_norm),
                                       _norm(block.attn.k_norm), _norm(block.attn_out_norm),
                                       _norm(block.mlp_out_norm))
                  for block in model.blocks]
        slopes = getattr(model, "alibi_slopes", None)
        self.step_fn = kernels.decode_step(
            config, layers, None if slopes is None else slopes.float().contiguous())
        self.empty = torch.empty(0)
        self.no_adapters = torch.empty(0, dtype=torch.long)
        self.no_rows = torch.empty(0, dtype=torch.long)  # no row emits its residuals

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Next-token logits (1, V) for `token` (1,) at position cache.length. A cache that
        positions its keys itself (the sink policy) is refused: the module path serves it."""
        if cache.rotates_keys:
            raise InputError("context", "the fused step keeps every key at its text position; the "
                             "sink policy runs the module path")
        pos, context = cache.length, self.config.context_length
        positions = torch.tensor([[pos]])  # (1, 1)
        if pos + 1 > context:
            raise InputError("context", f"{pos + 1} tokens exceed context_length={context}")
        cache.reserve(positions, None)
        cache.allocate(token.device, torch.float32)
        x = self.embed(token[:, None], positions)[:, 0]  # (1, d)
        cos = sin = self.empty
        if self.rope is not None:  # (kinds, 1, rotated) each
            cos, sin = by_kind(self.rope.angles(self.config, positions), 1)
        x = self.step_fn.step(x, pos, cos, sin, cache.keys, cache.values)  # (1, d)
        cache.advance(1)
        return self.head(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (R, V) from the residual streams h (R, d) after the last layer: the final
        norm and the model's head math, without its hook sites (no hooks here)."""
        return read_out(self.config, self.final_norm, self.head_transform, self.lm_head, h)  # (R, V)

    def rows(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             angles: RopeAngles | None, keys: list[torch.Tensor], values: list[torch.Tensor],
             adapter_of: torch.Tensor | None = None, adapters: list = (),
             emit: torch.Tensor | None = None, residuals: torch.Tensor | None = None,
             writes: torch.Tensor | None = None) -> torch.Tensor:
        """The residual streams (B, d) after every layer for the embedded tokens x (B, d) at
        positions (B,); row b's token t sits at pool slot slots[b, t] (B, S), its new one at
        slots[b, positions[b]]; angles: its cos and sin (B, rotated) per kind of layer, in
        Transformer.rope_angles' order (None without RoPE); keys, values per layer (n_slots,
        KV, d_head) float32, written at the new slots. Row b adds
        the updates of adapters[adapter_of[b]] (fused_adapter's), none where it is -1 or
        adapter_of is None (B,). Rows emit (M,) also write their residual streams after the
        embedding and after each layer, the state the step carries, into residuals
        (M, n_layers + 1, d) float32 (None: no row; the plain step), and, where writes
        (M, n_layers, 2, d) float32 is given, each layer's attention and feed-forward outputs
        (its attn.out and mlp.out sites, before any output norm)."""
        cos, sin = (self.empty, self.empty) if angles is None else by_kind(angles, len(x))
        rows = self.no_adapters if adapter_of is None else adapter_of.contiguous()
        emit = self.no_rows if emit is None else emit.contiguous()
        residuals = self.empty if residuals is None else residuals
        writes = self.empty if writes is None else writes
        return self.step_fn.step_paged(x, positions, slots, cos, sin, keys, values, rows, list(adapters),
                                       emit, residuals, writes)


def by_kind(angles: RopeAngles, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `rows` rows per kind of layer (each kind's (rows, …, rotated)) as the C++
    layers read them, (kinds, rows, rotated) each: one kind as it is, two side by side."""
    if len(angles) == 1:
        cos, sin = angles[0]
        return cos.reshape(1, rows, -1).contiguous(), sin.reshape(1, rows, -1).contiguous()
    return (torch.stack([cos.reshape(rows, -1) for cos, _ in angles]),
            torch.stack([sin.reshape(rows, -1) for _, sin in angles]))


def _norm(norm: torch.nn.Module | None) -> kernels.NormWeights | None:
    """A norm's (weight, bias or None) as the C++ layers read them; None where there is none."""
    if norm is None:
        return None
    bias = getattr(norm, "bias", None)
    return norm.weight.detach(), None if bias is None else bias.detach()
