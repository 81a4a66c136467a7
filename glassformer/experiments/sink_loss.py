"""sink_loss: per-token loss of a long text streamed through a small cache, with and without
attention sinks, beside dense attention.

The text (n ≥ 16·W tokens) enters one token at a time after the first S + W, each token's
next-token loss taken against the cache as it then is:
- sink: SinkPolicy(S, W), the first S tokens kept, and the last W;
- window: SinkPolicy(0, W), the last W only;
- dense: the whole text in one uncached pass (where it fits the model's window).
Losses are averaged over blocks of W tokens; `flat_*` compares the last block with the block
that starts at W (the first with the window full), the goal being within 5%; the text's own
difficulty changes from block to block, so `flat_*_vs_dense` divides each block by dense's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.sink import SinkKVCache, SinkPolicy
from ..model.transformer import Transformer


def streamed_losses(model: Transformer, ids: torch.Tensor, policy: SinkPolicy) -> torch.Tensor:
    """Next-token losses (n - 1,) of ids (n,) streamed through a sink cache."""
    cache = SinkKVCache(model.config, 1, policy)
    losses, start = [], 0
    with torch.inference_mode():
        while start < len(ids) - 1:
            end = min(start + policy.room(cache.seen), len(ids) - 1)
            logits = model(ids[None, start:end], cache)[0]  # (end - start, V)
            losses.append(F.cross_entropy(logits.float(), ids[start + 1 : end + 1], reduction="none"))
            start = end
    return torch.cat(losses)


def dense_losses(model: Transformer, ids: torch.Tensor) -> torch.Tensor | None:
    """Next-token losses (n - 1,) with every token in view, or None past the model's window."""
    if len(ids) > model.config.context_length:
        return None
    with torch.inference_mode():
        logits = model(ids[None, :-1])[0]  # (n - 1, V)
    return F.cross_entropy(logits.float(), ids[1:], reduction="none")


def block_means(losses: torch.Tensor, block: int) -> list[float]:
    return [float(losses[i : i + block].mean()) for i in range(0, len(losses) - block + 1, block)]


def sink_loss(model: Transformer, ids: list[int], window: int, sink_tokens: int = 4) -> dict:
    """The three curves as block means over W tokens, and for each streamed one `flat`: the
    last block's mean over the mean of the block at W (1.0: perfectly flat)."""
    if len(ids) < 16 * window:
        raise ValueError(f"ids: need at least 16 x window = {16 * window} tokens, got {len(ids)}")
    text = torch.tensor(ids, device=model.embed.tokens.weight.device)
    model = model.eval()
    result: dict = {"window": window, "sink_tokens": sink_tokens, "tokens": len(ids), "blocks": {}}
    curves = {"sink": SinkPolicy(sink_tokens, window), "window": SinkPolicy(0, window)}
    dense = dense_losses(model, text)
    reference = None if dense is None else block_means(dense, window)
    result["blocks"]["dense"] = reference
    for name, policy in curves.items():
        blocks = block_means(streamed_losses(model, text, policy), window)
        result["blocks"][name] = blocks
        result[f"flat_{name}"] = blocks[-1] / blocks[1]
        if reference is not None:
            result[f"flat_{name}_vs_dense"] = (blocks[-1] / reference[-1]) / (blocks[1] / reference[1])
    return result
