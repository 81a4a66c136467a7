"""Parameter accounting per component, tied weights counted once."""

from __future__ import annotations

from torch import nn

from ..model.transformer import Transformer


def count_parameters(model: Transformer) -> dict[str, int]:
    """{'token_embedding', 'positions', 'blocks.{i}.attention', 'blocks.{i}.feedforward',
    'blocks.{i}.norms', 'final_norm', 'lm_head', 'total'} -> number of parameters; an encoder
    adds 'token_types', 'embed_norm', 'head_transform' and 'pooler' where it has them."""
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
    for i, block in enumerate(model.blocks):
        counts[f"blocks.{i}.attention"] = unique(block.attn)
        counts[f"blocks.{i}.feedforward"] = unique(block.mlp)
        counts[f"blocks.{i}.norms"] = unique(block.norm1, block.norm2)
    counts["final_norm"] = unique(model.final_norm)
    for name in ("head_transform", "pooler"):
        if getattr(model, name) is not None:
            counts[name] = unique(getattr(model, name))
    counts["lm_head"] = unique(model.lm_head)  # 0 (or the bias alone) when tied
    counts["total"] = sum(counts.values())
    return counts
