"""sink_loss: per-token loss of a long text streamed through a small cache, with and without
attention sinks, beside dense attention.

The text (n ≥ 16·W tokens) enters one token at a time after the first S + W, each token's
next-token loss taken against the cache as it then is:
- sink: SinkPolicy(S, W), the first S tokens kept, and the last W;
- window: SinkPolicy(0, W), the last W only;
- dense: the whole text in one uncached pass (where it fits the model's window).
- recompute: StreamingLLM's oracle, each sampled token's loss with the W tokens before it run
  from scratch at positions 0..W-1 (every `stride`-th token, as it costs W forwards a token).
Losses are averaged over blocks of W tokens. The text's own difficulty changes from block to
block, so flatness is judged against recompute on the same tokens, which sees the same W
tokens of context at every point: `flat_*` is a curve's loss over recompute's on the sampled
tokens of the last quarter of the text, over the same ratio in the block at W (the first with
the window full). The goal is `flat_sink` within 5% of 1. `over_recompute_*` is a curve's loss
over recompute's in the last quarter: what the cache loses against W tokens of full context
(window-only loses from the first eviction on, so it shows there, not in its flatness).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import InputError
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


def recomputed_losses(model: Transformer, ids: torch.Tensor, window: int, targets: list[int],
                      batch: int = 16) -> torch.Tensor:
    """Loss (len(targets),) of each token ids[t] predicted from ids[t-W:t] alone, from scratch."""
    contexts = torch.stack([ids[t - window : t] for t in targets])  # (T, W)
    losses = []
    with torch.inference_mode():
        for i in range(0, len(targets), batch):
            logits = model(contexts[i : i + batch])[:, -1]  # (b, V)
            losses.append(F.cross_entropy(logits.float(), ids[targets[i : i + batch]], reduction="none"))
    return torch.cat(losses)


def block_means(losses: torch.Tensor, block: int) -> list[float]:
    return [float(losses[i : i + block].mean()) for i in range(0, len(losses) - block + 1, block)]


def sink_loss(model: Transformer, ids: list[int], window: int, sink_tokens: int = 4,
              stride: int = 4) -> dict:
    """The curves as block means over W tokens, and for each streamed one `flat` (1.0:
    perfectly flat; see the module's docstring)."""
    if len(ids) < 16 * window:
        raise InputError("ids", f"need at least 16 x window = {16 * window} tokens, got {len(ids)}")
    text = torch.tensor(ids, device=model.embed.tokens.weight.device)
    model = model.eval()
    result: dict = {"window": window, "sink_tokens": sink_tokens, "tokens": len(ids), "blocks": {}}
    curves = {"sink": SinkPolicy(sink_tokens, window), "window": SinkPolicy(0, window)}
    dense = dense_losses(model, text)
    reference = None if dense is None else block_means(dense, window)
    result["blocks"]["dense"] = reference
    n = len(ids) - 1  # predicted tokens: loss i is token i + 1's
    first = list(range(window, 2 * window, stride))  # losses of the block at W
    last = list(range(n - n // 4, n, stride))  # of the last quarter
    recompute = recomputed_losses(model, text, window, [i + 1 for i in first + last])
    base_first, base_last = recompute[: len(first)].mean(), recompute[len(first) :].mean()
    result["recompute"] = {"first": float(base_first), "last_quarter": float(base_last)}
    for name, policy in curves.items():
        losses = streamed_losses(model, text, policy)
        result["blocks"][name] = block_means(losses, window)
        ratio_first = losses[first].mean() / base_first
        ratio_last = losses[last].mean() / base_last
        result[f"flat_{name}"] = float(ratio_last / ratio_first)
        result[f"over_recompute_{name}"] = float(ratio_last)
    return result
