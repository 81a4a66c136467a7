"""Perplexity of a model on a text: exp(mean next-token cross-entropy) over the whole text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from .data import Documents, iter_documents, list_sources, windows


def corpus_ids(paths: str | Path | Sequence[str | Path], tokenizer,
               documents: Documents = "file") -> np.ndarray:
    """Every document's ids, each followed by end-of-text (as in training): (n_tokens,)."""
    encode = getattr(tokenizer, "encode_array", None) or (
        lambda text: np.asarray(tokenizer.encode(text), dtype=np.int64)
    )
    eot = np.array([] if tokenizer.eos_id is None else [tokenizer.eos_id], dtype=np.int64)
    parts = []
    for doc in iter_documents(list_sources(paths), documents):
        parts += [encode(doc), eot]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: np.ndarray, batch_size: int = 8,
               max_tokens: int | None = None) -> dict:
    """Loss over consecutive, non-overlapping windows of context_length + 1 tokens."""
    T = model.config.context_length
    if not model.config.causal:
        raise InputError("perplexity", "an encoder (bidirectional attention) sees the tokens it would "
                         "predict; next-token perplexity needs a causal model")
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
    window = min(T, len(ids) - 1)
    if window < 1:
        raise InputError(None, f"the text has {len(ids)} tokens: too short to predict any")
    n_windows = (len(ids) - 1) // window
    starts = torch.arange(n_windows) * window  # (n_windows,)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in starts.split(batch_size):
        x, y = windows(ids, chunk, window, device)  # (b, window) each
        logits = model(x)  # (b, window, vocab)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
