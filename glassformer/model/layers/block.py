"""One transformer block. Where the norms sit is a config choice (`norm_placement`):

    pre  (GPT-2, Llama, T5):  x = x + Attn(Norm1(x));   x = x + FFN(Norm2(x))
    post (GPT-1, Vaswani):    x = Norm1(x + Attn(x));   x = Norm2(x + FFN(x))
    out  (OLMo 2):            x = x + AttnOutNorm(Attn(x));   x = x + MlpOutNorm(FFN(x))
    sandwich (Gemma 2/3):       x = x + AttnOutNorm(Attn(Norm1(x)));
                              x = x + MlpOutNorm(FFN(Norm2(x)))

A parallel block (`parallel_block`, GPT-NeoX's use_parallel_residual) reads both sublayers from
the block's input, pre-norm:   x = x + Attn(Norm1(x)) + FFN(Norm2(x))

A decoder block of an encoder-decoder (`cross=True`) has a third sublayer between the two,
cross-attention to the encoder's output m, placed the same way:
    pre:  x = x + Cross(NormX(x), m)          post: x = NormX(x + Cross(x, m))
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..hooks import Hooks
from ..kv_cache import AttentionCache
from ..sites import CROSS_SITES, LAYER_SITES, names
from .attention import Attention
from .cross_attention import CrossAttention
from .feedforward import FeedForward
from .masking import AttentionMask
from .norm import make_norm
from .positions import RopeAngles

# What a cross-attention sublayer reads: the encoder's keys and values (B, KV, S, d_head) for
# this block, and the mask over the encoder's positions.
CrossInputs = tuple[torch.Tensor, torch.Tensor, AttentionMask]


class Block(nn.Module):
    def __init__(
        self, config: ModelConfig, hooks: Hooks, layer: int, cross: bool = False, prefix: str = ""
    ) -> None:
        super().__init__()
        site = f"{prefix}blocks.{layer}"
        self.post_norm = config.norm_placement == "post"
        self.parallel = config.parallel_block
        inputs, outputs = config.norm_placement != "out", config.norm_placement in ("out", "sandwich")
        self.norm1 = make_norm(config) if inputs else None
        self.attn = Attention(config, hooks, site, layer)
        self.norm_cross = make_norm(config) if cross else None
        self.cross = CrossAttention(config, hooks, site) if cross else None
        self.norm2 = make_norm(config) if inputs else None
        self.mlp = FeedForward(config, hooks, site)
        self.attn_out_norm = make_norm(config) if outputs else None
        self.mlp_out_norm = make_norm(config) if outputs else None
        self.dropout = nn.Dropout(config.dropout)
        self.hooks, self.at = hooks, names(site, LAYER_SITES | CROSS_SITES)  # its own sites
        hooks.register(*self._sites())

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask | None,
        rope: RopeAngles | None = None,
        cache: AttentionCache | None = None,
        cross: CrossInputs | None = None,
    ) -> torch.Tensor:
        hook, at = self.hooks, self.at
        x = hook(at["resid_pre"], x)  # (B, T, d)
        if self.post_norm:
            x = hook(at["norm1"], self.norm1(x + self.dropout(self.attn(x, mask, rope, cache))))
            if self.cross is not None:
                x = hook(at["norm_cross"], self.norm_cross(x + self.dropout(self.cross(x, *cross))))
            x = hook(at["resid_mid"], x)
            x = hook(at["norm2"], self.norm2(x + self.dropout(self.mlp(x))))
            return hook(at["resid_post"], x)
        # pre, out or sandwich: each sublayer through the input and output norms the block has
        block_input = x  # a parallel block's feed-forward reads it too
        attended = self.attn(self._norm("norm1", x), mask, rope, cache)
        x = x + self.dropout(self._norm("attn_out_norm", attended))
        if self.cross is not None:
            x = hook(at["resid_self"], x)
            x = x + self.dropout(self.cross(hook(at["norm_cross"], self.norm_cross(x)), *cross))
        x = hook(at["resid_mid"], x)
        fed = self._norm("norm2", block_input if self.parallel else x)
        x = x + self.dropout(self._norm("mlp_out_norm", self.mlp(fed)))
        return hook(at["resid_post"], x)

    def _sites(self) -> list[str]:
        """Its sites and its sublayers', in the order forward reaches them."""
        at, attn, mlp = self.at, self.attn.sites, self.mlp.sites
        cross = [] if self.cross is None else self.cross.sites

        def norm(name: str) -> list[str]:  # a norm's site, where the block has that norm
            return [at[name]] if getattr(self, name) is not None else []

        if self.post_norm:  # each norm after its residual add
            return [at["resid_pre"], *attn, *norm("norm1"), *cross, *norm("norm_cross"),
                    at["resid_mid"], *mlp, *norm("norm2"), at["resid_post"]]
        crossing = [] if self.cross is None else [at["resid_self"], *norm("norm_cross"), *cross]
        return [at["resid_pre"], *norm("norm1"), *attn, *norm("attn_out_norm"), *crossing,
                at["resid_mid"], *norm("norm2"), *mlp, *norm("mlp_out_norm"), at["resid_post"]]

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The block's norm `name` of x, shown at its site; x itself where the block has none."""
        norm = getattr(self, name)
        return x if norm is None else self.hooks(self.at[name], norm(x))
