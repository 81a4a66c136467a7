"""The encoder-decoder (Vaswani et al. 2017; T5, Raffel et al. 2020): the same blocks in two
stacks sharing one token table.

    source ids (B, S) ─embed─▶ encoder: N_enc × block (bidirectional) ─norm─▶ m (B, S, d)
    target ids (B, T) ─embed─▶ decoder: N × block (causal self-attention, cross-attention to m,
                               feed-forward) ─norm─▶ h (B, T, d) ─head─▶ logits (B, T, vocab)

With position="relative" each stack holds one T5 bias table shared by its layers (bidirectional
in the encoder, causal in the decoder). Generation runs the encoder once and decodes through
`decoder_view(m)`, which looks like a decoder-only Transformer to the decode core; the
cross-attention keys and values are projected once and kept in the KVCache.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from .config import ModelConfig
from .hooks import Hooks
from .kv_cache import KVCache
from .layers.block import Block
from .layers.embedding import Embedding
from .layers.masking import AttentionMask
from .layers.norm import make_norm
from .layers.positions import RelativeBias
from .sites import OUTPUT, STACK_SITES, names
from .transformer import Transformer, init_weights


class Stack(nn.Module):
    """The blocks of one side, its relative bias table and final norm; hook sites `{name}.…`."""

    def __init__(self, config: ModelConfig, hooks: Hooks, name: str, decoder: bool) -> None:
        super().__init__()
        n_layers = config.n_layers if decoder else config.n_encoder_layers
        self.causal = decoder
        self.at = names(name, STACK_SITES)  # its site names, registered in forward order
        if config.position == "relative":
            hooks.register(self.at["relative_bias"])
        self.blocks = nn.ModuleList(
            Block(config, hooks, i, cross=decoder, prefix=name + ".") for i in range(n_layers)
        )
        self.relative_bias = None
        if config.position == "relative":
            self.relative_bias = RelativeBias(config, bidirectional=not decoder)
        self.final_norm = make_norm(config) if config.final_norm else None
        if self.final_norm is not None:
            hooks.register(self.at["final_norm"])
        self.hooks = hooks

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        pad_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cross: tuple[list[tuple[torch.Tensor, torch.Tensor]], AttentionMask] | None = None,
        contiguous: bool = True,
    ) -> torch.Tensor:
        """x (B, T, d) at positions (B, T) -> (B, T, d); `cross`: each block's encoder keys
        and values, and their mask."""
        T = x.shape[1]
        if cache is not None:
            cache.reserve(positions, pad_mask)
            k_pos, k_valid = cache.key_positions(T), cache.key_valid(T)
        else:
            k_pos, k_valid = positions, pad_mask
        bias = None
        if self.relative_bias is not None:
            rows = slice(0, 1) if contiguous else slice(None)  # every row alike: compute once
            bias = self.hooks(self.at["relative_bias"], self.relative_bias(positions[rows], k_pos[rows]))
        mask = AttentionMask(q_pos=positions, k_pos=k_pos, causal=self.causal, k_valid=k_valid,
                             contiguous=contiguous, position_bias=bias)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None, cache, None if cross is None else (*cross[0][i], cross[1]))
        if cache is not None:
            cache.advance(T)
        if self.final_norm is not None:
            x = self.hooks(self.at["final_norm"], self.final_norm(x))
        return x


class EncoderDecoder(nn.Module):
    """`model(source_ids, target_ids)` -> logits (B, T, vocab) for every target position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not config.n_encoder_layers:
            raise InputError("n_encoder_layers", "0 means a decoder-only Transformer")
        self.config = config
        self.hooks = Hooks()
        self.embed = Embedding(config, self.hooks)  # one token table for both stacks
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = Stack(config, self.hooks, "encoder", decoder=False)
        self.decoder = Stack(config, self.hooks, "decoder", decoder=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        self.hooks.register(OUTPUT["logits"])
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight  # W_head = E_token
        init_weights(self, config.init_std, [*self.encoder.blocks, *self.decoder.blocks])

    def linear_layers(self) -> dict[str, nn.Module]:
        """Every weight matrix a forward pass multiplies by, by module path (encoder blocks,
        decoder blocks with their cross-attention, lm_head). Conversions replace these."""
        names = [name for name, module in self.named_modules() if isinstance(module, nn.Linear)]
        return {name: self.get_submodule(name) for name in names}

    def install_fused_step(self, build) -> None:
        """Conversions install a fused decode step here; an encoder-decoder has none: its
        decoder always decodes through the modules."""

    def encode(self, ids: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output m (B, S, d) for source ids (B, S); pad_mask (B, S) False for
        padding."""
        B, S = ids.shape
        if S > self.config.context_length:
            raise InputError("context", f"{S} source tokens exceed context_length="
                             f"{self.config.context_length}")
        positions = torch.arange(S, device=ids.device).expand(B, S)  # (B, S)
        x = self.dropout(self.embed(ids, positions))  # (B, S, d)
        return self.encoder(x, positions, pad_mask)

    def cross_kv(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every decoder block's keys and values of the encoder output, (B, KV, S, d_head) each."""
        return [block.cross.project(memory) for block in self.decoder.blocks]

    def forward_hidden(
        self,
        ids: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's final hidden state h (B, T, d) for target ids (B, T) against the
        encoder output `memory` (B, S, d); positions and pad_mask as in Transformer."""
        B, T = ids.shape
        start = cache.length if cache is not None else 0
        contiguous = positions is None
        if positions is None:
            positions = torch.arange(start, start + T, device=ids.device).expand(B, T)  # (B, T)
        if start + T > self.config.context_length:
            raise InputError("context",
                f"{start + T} tokens exceed context_length={self.config.context_length}"
            )
        if cache is None:
            kv = self.cross_kv(memory)
        else:
            if not cache.cross:  # the first step: project the encoder output once
                cache.cross = self.cross_kv(memory)
            kv = cache.cross
        S = kv[0][0].shape[2]  # encoder positions
        cross_mask = AttentionMask(
            q_pos=positions, k_pos=torch.arange(S, device=ids.device).expand(B, S),
            causal=False, k_valid=memory_mask,
        )
        x = self.dropout(self.embed(ids, positions))  # (B, T, d)
        return self.decoder(x, positions, pad_mask, cache, (kv, cross_mask), contiguous)

    def forward(
        self,
        ids: torch.Tensor,
        target_ids: torch.Tensor,
        pad_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) of target ids (B, T) given source ids (B, S)."""
        return self.head(self.forward_hidden(target_ids, self.encode(ids, pad_mask), pad_mask))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (…, vocab) from decoder hidden states (…, d)."""
        if self.config.scale_head_input:
            h = h * self.config.d_model**-0.5
        return self.hooks(OUTPUT["logits"], self.lm_head(h))

    def decoder_view(self, memory: torch.Tensor) -> DecoderView:
        """The decoder bound to one encoder output (1 or B, S, d), for the decode core."""
        return DecoderView(self, memory)


class DecoderView(nn.Module):
    """The decoder of an EncoderDecoder with its encoder output fixed, shaped like a decoder-only
    Transformer (`forward_hidden(ids, cache, positions, pad_mask)`, `head`, `config`, `embed`),
    so that greedy, sampled and beam decoding run on the same core. An output of batch 1 serves
    any number of rows (beams)."""

    def __init__(self, model: EncoderDecoder, memory: torch.Tensor) -> None:
        super().__init__()
        self.model, self.memory = model, memory
        self.config, self.embed, self.hooks = model.config, model.embed, model.hooks

    def forward_hidden(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        memory = self.memory
        if memory.shape[0] != ids.shape[0]:
            memory = memory.expand(ids.shape[0], -1, -1)  # (B, S, d): one source, several rows
        return self.model.forward_hidden(ids, memory, None, cache, positions, pad_mask)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.head(self.forward_hidden(ids, cache))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.head(h)

    has_fused_step = False  # no fused decode step for encoder-decoders: the module path decodes

    def fused_step(self) -> None:
        return None


def build_model(config: ModelConfig) -> Transformer | EncoderDecoder:
    """The model a config describes: an EncoderDecoder when it has encoder layers, else a
    decoder-only Transformer."""
    return EncoderDecoder(config) if config.n_encoder_layers else Transformer(config)
