"""Masked-token prediction with an encoder (BERT): the most likely tokens at each mask.

The text is encoded with the tokenizer's own special tokens (BERT's [CLS] ... [SEP]), read in
one bidirectional forward pass, and each mask position's logits become probabilities.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import InputError
from ..model.transformer import Transformer


@dataclass(frozen=True)
class Candidate:
    token_id: int
    token: str
    score: float  # the probability at this mask


@dataclass(frozen=True)
class MaskFill:
    position: int  # the mask's index among the encoded tokens
    candidates: list[Candidate]  # best first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fill_mask(model: Transformer, tokenizer: Any, text: str, top_k: int = 5) -> list[MaskFill]:
    """The `top_k` most likely tokens at every mask token of `text`, in order."""
    if model.config.causal:
        raise InputError("fill-mask", "this model is causal (a decoder); masks need a bidirectional "
                         "encoder such as BERT")
    mask_id = getattr(tokenizer, "mask_id", None)
    if mask_id is None:
        raise InputError("fill-mask", "this model's tokenizer has no mask token")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0:
        raise InputError("top_k", f"must be a positive integer, got {top_k!r}")
    ids = tokenizer.encode_sequence(text)
    positions = [i for i, t in enumerate(ids) if t == mask_id]
    if not positions:
        raise InputError("fill-mask", f"the text holds no mask token {tokenizer.mask_token!r}")
    device = model.embed.tokens.weight.device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device))[0, positions].float()  # (M, vocab)
    scores, best = logits.softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)  # (M, k)
    return [MaskFill(p, [Candidate(i, tokenizer.decode([i]), s)
                         for i, s in zip(row_ids.tolist(), row_scores.tolist(), strict=True)])
            for p, row_ids, row_scores in zip(positions, best, scores, strict=True)]
