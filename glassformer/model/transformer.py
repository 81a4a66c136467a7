"""The transformer: embedding -> N blocks -> final norm -> language-model head. A decoder
(causal) or an encoder (bidirectional: BERT, with segment embeddings, the masked-LM head and
a pooler)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from ..errors import InputError
from .config import ModelConfig
from .hooks import Hooks
from .kv_cache import AttentionCache, KVCache
from .layers.block import Block
from .layers.embedding import Embedding
from .layers.heads import HEAD_TRANSFORMS, Pooler
from .layers.masking import AttentionMask
from .layers.norm import make_norm
from .layers.positions import (
    RelativeBias,
    RopeAngles,
    RopeSets,
    alibi_slopes,
    rope_inverse_frequencies,
)
from .sites import OUTPUT

# A decode step for one sequence: token (1,) fed against the cache -> next-token logits (1, V).
DecodeStep = Callable[[torch.Tensor, KVCache], torch.Tensor]


class Transformer(nn.Module):
    """`model(ids)` -> logits (B, T, vocab). Pass a KVCache to decode incrementally."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.n_encoder_layers:
            raise InputError("n_encoder_layers", "an encoder-decoder is an EncoderDecoder "
                             "(glassformer.model.build_model chooses)")
        self.config = config
        self.hooks = Hooks()
        self.embed = Embedding(config, self.hooks)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, self.hooks, i) for i in range(config.n_layers))
        self.final_norm = make_norm(config) if config.final_norm else None
        transform = HEAD_TRANSFORMS[config.head]
        self.head_transform = transform(config) if transform is not None else None
        self.pooler = Pooler(config) if config.pooler else None
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        present = {"final_norm": self.final_norm, "head_transform": self.head_transform}
        self.hooks.register(*(site for name, site in OUTPUT.items() if present.get(name, True) is not None))
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight  # W_head = E_token
        self.rope_attention_factor = 1.0
        if config.position == "rope":
            inv_freq, self.rope_attention_factor = rope_inverse_frequencies(config)
            self.register_buffer("rope_inv_freq", inv_freq, persistent=False)  # (rotated/2,)
        # the sliding layers' own (Gemma 3) (rotated/2,), None where every layer turns alike
        local = (rope_inverse_frequencies(config, local=True)[0]
                 if config.rope_local_theta is not None else None)
        self.register_buffer("rope_local_inv_freq", local, persistent=False)
        # LongRoPE's set for a text past the original context (rotated/2,), None for the others
        long_inv_freq = (rope_inverse_frequencies(config, long=True)[0]
                         if config.rope_scaling == "longrope" else None)
        self.register_buffer("rope_long_inv_freq", long_inv_freq, persistent=False)
        if config.position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(config.n_heads), persistent=False)
        self.relative_bias = None
        if config.position == "relative":
            self.relative_bias = RelativeBias(config, bidirectional=not config.causal)
        init_weights(self, config.init_std, self.blocks)
        # A fused decode step, installed by a conversion (glassformer.accel.quantize_model):
        # `build(model)` makes it, or None where it cannot serve this model as it now is.
        self._step_builder: Callable[[Transformer], DecodeStep | None] | None = None
        self._step: tuple[DecodeStep | None] | None = None  # built once; None: not yet

    def linear_layers(self) -> dict[str, nn.Module]:
        """Every weight matrix a forward pass multiplies by, by module path: each block's
        attn.qkv, attn.out, mlp.up, mlp.down, then head_transform.dense and pooler.dense
        where the model has them, then lm_head. Conversions replace these."""
        parts = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")
        names = [f"blocks.{i}.{part}" for i in range(len(self.blocks)) for part in parts]
        names += [f"{part}.dense" for part in ("head_transform", "pooler") if getattr(self, part)]
        return {name: self.get_submodule(name) for name in [*names, "lm_head"]}

    def install_fused_step(self, build: Callable[[Transformer], DecodeStep | None]) -> None:
        """Give the model a fused decode step, made by `build(self)` on first use and made
        again after the model's tensors change (`to`, `load_state_dict`)."""
        self._step_builder, self._step = build, None

    @property
    def has_fused_step(self) -> bool:
        """Whether a conversion installed a fused decode step (it may still decline to serve)."""
        return self._step_builder is not None

    def fused_step(self) -> DecodeStep | None:
        """The installed decode step where it applies now (eval mode, no grad, no hooks, and
        what its builder checks), else None: the module path is the reference."""
        if self._step_builder is None or self.training or torch.is_grad_enabled() or self.hooks:
            return None
        if self._step is None:
            self._step = (self._step_builder(self),)
        return self._step[0]

    def with_products(self, wrap: Callable[[nn.Module], nn.Module]) -> Transformer:
        """A view of this model: its modules copied, sharing every parameter, buffer and the
        hook registry, with each of `linear_layers()` replaced by `wrap(layer)` (the serving
        engine runs its products in fixed row tiles through one). No fused step: the view
        runs the module path."""
        shared = {id(t): t for t in (*self.parameters(), *self.buffers())}
        shared.update({id(self.hooks): self.hooks, id(self._step): None, id(self._step_builder): None})
        view = copy.deepcopy(self, shared)
        for name, layer in view.linear_layers().items():
            view.set_submodule(name, wrap(layer))
        return view

    def _apply(self, fn, recurse=True):
        self._step = None  # parameters and buffers may be replaced (.to(), .float(), .cuda())
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._step = None  # new values, or with assign=True new tensors
        super()._load_from_state_dict(*args, **kwargs)

    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """The logits (B, T, vocab); with head=False the final hidden state (B, T, d) instead,
        for a loss that takes the head itself (training/head_loss.py) through a wrapper that
        calls forward only (DistributedDataParallel, torch.compile)."""
        h = self.forward_hidden(ids, cache, positions, pad_mask, token_types, documents)
        return self.head(h) if head else h

    def forward_hidden(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden state h (B, T, d), before the head.

        positions (B, T): absolute positions, by default continuing the cache.
        pad_mask (B, T): True for real tokens, False for padding (left, or right in an encoder).
        token_types (B, T): segment ids, for a model with n_token_types.
        documents (B, T): packed sequences' indices; a token sees only its own document's
        (training: no cache; give each document's positions from 0).
        """
        config = self.config
        B, T = ids.shape
        start = cache.query_start(T) if cache is not None else 0
        contiguous = positions is None
        if positions is None:
            positions = torch.arange(start, start + T, device=ids.device).expand(B, T)  # (B, T)
        if start + T > config.context_length or (
            not contiguous and T and int(positions.max()) >= config.context_length
        ):
            raise InputError("context",
                f"{start + T} tokens exceed context_length={config.context_length}"
            )
        if cache is not None and documents is not None:
            raise InputError("documents", "packed sequences are for training, not with a cache")
        if cache is not None:
            if not config.causal:
                raise InputError("causal", "a bidirectional model cannot decode incrementally")
            cache.reserve(positions, pad_mask)
            k_pos, k_valid = cache.key_positions(T), cache.key_valid(T)
        else:
            k_pos, k_valid = positions, pad_mask
        mask = self.attention_mask(positions, k_pos, k_valid, contiguous, documents)
        x = self.run_blocks(ids, positions, mask, cache, token_types, contiguous)
        if cache is not None:
            cache.advance(T)
        return x

    def run_blocks(self, ids: torch.Tensor, positions: torch.Tensor, mask: AttentionMask,
                   cache: AttentionCache | None = None, token_types: torch.Tensor | None = None,
                   contiguous: bool = False) -> torch.Tensor:
        """The pass itself: embedding -> blocks -> final norm, h (B, T, d) for ids (B, T) at
        `positions` (B, T) under `mask`, with no checks and no cache bookkeeping (forward_hidden
        does both; a compiled decode step, generation/compiled.py, keeps its own on the device).
        `contiguous`: every row's positions alike (RoPE's angles computed once)."""
        rope = None
        if self.config.position == "rope":
            rope = self.rope_angles(positions[:1] if contiguous else positions)  # rows alike: once
        x = self.dropout(self.embed(ids, positions, token_types))  # (B, T, d)
        for block in self.blocks:
            x = block(x, mask, rope, cache)
        return final_hidden(self.final_norm, x, self.hooks)

    def rope_sets(self) -> RopeSets:
        """The θ its layers turn by, as its buffers hold them now (position="rope")."""
        return RopeSets(self.rope_inv_freq, self.rope_attention_factor, self.rope_long_inv_freq,
                        self.rope_local_inv_freq)

    def rope_angles(self, positions: torch.Tensor, long: bool | None = None) -> RopeAngles:
        """RoPE's cos and sin at positions (B, T) for each kind of layer (RopeSets.angles),
        (B, 1, T, rotated) each in the model's dtype."""
        dtype = self.embed.tokens.weight.dtype
        return tuple(tuple(t.to(dtype) for t in pair)
                     for pair in self.rope_sets().angles(self.config, positions, long))

    def attention_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor,
                       k_valid: torch.Tensor | None = None, contiguous: bool = False,
                       documents: torch.Tensor | None = None) -> AttentionMask:
        """What queries at q_pos (B, Tq) may see of keys at k_pos (B, Tk): causality, the
        window, padding (k_valid (B, Tk)), packed documents (B, T), ALiBi or T5's relative
        bias, as this model has them.
        `contiguous`: the keys are 0..Tk-1 and the queries the last Tq of them."""
        config = self.config
        return AttentionMask(
            q_pos=q_pos,
            k_pos=k_pos,
            causal=config.causal,
            window=config.sliding_window,
            k_valid=k_valid,
            alibi_slopes=getattr(self, "alibi_slopes", None),
            contiguous=contiguous,
            position_bias=self.position_bias(q_pos, k_pos, contiguous),
            documents=documents,
        )

    def position_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      contiguous: bool) -> torch.Tensor | None:
        """T5's relative bias (1 or B, H, Tq, Tk) where position="relative", else None."""
        if self.relative_bias is None:
            return None
        rows = slice(0, 1) if contiguous else slice(None)  # every row alike: compute once
        return self.relative_bias(q_pos[rows], k_pos[rows])

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (…, vocab) from final hidden states (…, d), after the final norm."""
        return head_logits(self.config, self.head_transform, self.lm_head, h, self.hooks)

    def read_out(self, resid: torch.Tensor) -> torch.Tensor:
        """Logits (…, vocab) of residual streams (…, d) after the last block (or any block:
        the logit lens): the final norm, then the head, hooked."""
        return read_out(self.config, self.final_norm, self.head_transform, self.lm_head, resid, self.hooks)

    def pool(self, h: torch.Tensor) -> torch.Tensor:
        """The pooled vector (B, d) of each sequence's final hidden states h (B, T, d)."""
        if self.pooler is None:
            raise InputError("pooler", "this model has no pooler (pooler=False)")
        return self.pooler(h)


def _unhooked(site: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def final_hidden(final_norm: nn.Module | None, resid: torch.Tensor,
                 hooks: Callable[[str, torch.Tensor], torch.Tensor] = _unhooked) -> torch.Tensor:
    """The final hidden states (…, d) of residual streams (…, d): the final norm where the
    model has one (its site `final_norm`), else the streams themselves."""
    return resid if final_norm is None else hooks(OUTPUT["final_norm"], final_norm(resid))


def read_out(config: ModelConfig, final_norm: nn.Module | None, head_transform: nn.Module | None,
             lm_head: nn.Module, resid: torch.Tensor,
             hooks: Callable[[str, torch.Tensor], torch.Tensor] = _unhooked) -> torch.Tensor:
    """The one read-out, logits (…, vocab) of residual streams (…, d): the final norm, then
    the head's math. The model's own (`Transformer.read_out`), the fused decode step's and the
    serving engine's logits and lens all come from it."""
    return head_logits(config, head_transform, lm_head, final_hidden(final_norm, resid, hooks), hooks)


def head_logits(config: ModelConfig, head_transform: nn.Module | None, lm_head: nn.Module,
                h: torch.Tensor, hooks: Callable[[str, torch.Tensor], torch.Tensor] = _unhooked,
                ) -> torch.Tensor:
    """The head's math, logits (…, vocab) from hidden states (…, d): h · d_model^-½ where the
    config says so (T5 v1.0's tied head), the head transform (head="mlm"), the product;
    `hooks` sees the head_transform and logits sites; the logits soft-capped to
    c · tanh(logits / c) where final_softcap is c (Gemma 2). A fused decode step calls it
    unhooked."""
    if config.scale_head_input:
        h = h * config.d_model**-0.5
    if head_transform is not None:
        h = hooks(OUTPUT["head_transform"], head_transform(h))  # (…, d)
    logits = lm_head(h)  # (…, vocab)
    if config.final_softcap is not None:
        logits = config.final_softcap * torch.tanh(logits / config.final_softcap)
    return hooks(OUTPUT["logits"], logits)


def init_weights(model: nn.Module, std: float, blocks: list[nn.Module]) -> None:
    """Normal(0, std) weights and zero biases for every linear and embedding layer; the layers
    that write into the residual stream of `blocks` get std / √(2·len(blocks)), as outputs
    added to it grow with depth."""

    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    model.apply(init)
    residual_std = std / math.sqrt(2 * len(blocks))
    for block in blocks:
        for layer in (block.attn.out, block.mlp.down, getattr(block.cross, "out", None)):
            if layer is not None:
                nn.init.normal_(layer.weight, std=residual_std)
