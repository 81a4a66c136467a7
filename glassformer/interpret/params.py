"""Parameter accounting per component, tied weights counted once."""

from __future__ import annotations

from torch import nn

from ..model.encoder_decoder import EncoderDecoder
from ..model.transformer import Transformer


def count_parameters(model: Transformer | EncoderDecoder) -> dict[str, int]:
    """{'token_embedding', 'positions', 'blocks.{i}.attention', 'blocks.{i}.feedforward',
    'blocks.{i}.norms', 'final_norm', 'lm_head', 'total'} -> number of parameters. An
    encoder-decoder has those of each stack prefixed 'encoder.' and 'decoder.', each stack's
    'relative_bias', and every decoder block's 'cross_attention'. An encoder (BERT) adds
    'token_types', 'embed_norm', 'head_transform' and 'pooler' where it has them."""
    seen: set[int] = set()

    def unique(*modules: nn.Module | None) -> int:
        total = 0
        for module in modules:
            for parameter in module.parameters() if module is not None else ():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    total += parameter.numel()
        return total

    counts = {
        "token_embedding": unique(model.embed.tokens),
        "positions": unique(model.embed.positions),
    }
    for name, module in (("token_types", model.embed.token_types), ("embed_norm", model.embed.norm)):
        if module is not None:
            counts[name] = unique(module)
    stacks = [("", model)]
    if isinstance(model, EncoderDecoder):
        stacks = [("encoder.", model.encoder), ("decoder.", model.decoder)]
    for prefix, stack in stacks:
        if stack.relative_bias is not None:
            counts[prefix + "relative_bias"] = unique(stack.relative_bias)
        for i, block in enumerate(stack.blocks):
            counts[f"{prefix}blocks.{i}.attention"] = unique(block.attn)
            if block.cross is not None:
                counts[f"{prefix}blocks.{i}.cross_attention"] = unique(block.cross)
            counts[f"{prefix}blocks.{i}.feedforward"] = unique(block.mlp)
            counts[f"{prefix}blocks.{i}.norms"] = unique(block.norm1, block.norm_cross, block.norm2,
                                                            block.attn_out_norm, block.mlp_out_norm)
        counts[prefix + "final_norm"] = unique(stack.final_norm)
    for name in ("head_transform", "pooler"):
        if getattr(model, name, None) is not None:
            counts[name] = unique(getattr(model, name))
    counts["lm_head"] = unique(model.lm_head)  # 0 (or the bias alone) when tied
    counts["total"] = sum(counts.values())
    return counts
