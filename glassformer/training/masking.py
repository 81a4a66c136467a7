"""BERT's masking (Devlin et al., 2019): which positions a masked-LM step predicts, and what
the model reads there.

    chosen   = each position with probability 0.15
    of those:  80% read the mask token, 10% a random token, 10% the token itself
    targets  = the original token at chosen positions, IGNORE elsewhere (no loss there)

The random draws (`draw_choices`) are uniform numbers per position, made from an explicit CPU
torch.Generator before the vocabulary is known, so a run is reproducible, resumes exactly, and
any number of processes draws the same.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..formats.tokenizers import MASK, CharTokenizer, HFTokenizer

IGNORE = -100  # a target that counts for nothing (cross_entropy's ignore_index)
CHOOSE, REPLACE_MASK, REPLACE_RANDOM = 0.15, 0.8, 0.1


def draw_choices(n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(n, length, 3) uniform numbers per position: chosen?, how replaced, which random token."""
    return torch.rand(n, length, 3, generator=generator)


def apply_masks(ids: torch.Tensor, choices: torch.Tensor, mask_id: int, vocab_size: int,
                rate: float = CHOOSE) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both shaped like ids (B, T), from draw_choices' numbers (B, T, 3)."""
    choices = choices.to(ids.device)
    chosen, kind = choices[..., 0] < rate, choices[..., 1]  # (B, T) each
    random_ids = (choices[..., 2] * vocab_size).long().clamp(max=vocab_size - 1)  # (B, T)
    inputs = torch.where(chosen & (kind < REPLACE_MASK), mask_id, ids)
    swap = chosen & (kind >= REPLACE_MASK) & (kind < REPLACE_MASK + REPLACE_RANDOM)
    inputs = torch.where(swap, random_ids, inputs)
    targets = torch.where(chosen, ids, IGNORE)
    return inputs, targets


def with_mask_token(tokenizer):
    """The tokenizer with a mask token (itself when it has one): a character tokenizer gets
    one more id after end-of-text, a Hugging Face one the special token [MASK]."""
    if getattr(tokenizer, "mask_id", None) is not None:
        return tokenizer
    if isinstance(tokenizer, CharTokenizer):
        return CharTokenizer(tokenizer.chars, tokenizer.eos_token, MASK)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tokenizer.add_special_tokens([MASK])
        return HFTokenizer(tokenizer.tokenizer, tokenizer.eos_token, tokenizer.bos_token)
    raise InputError("objective", f"masked LM has no mask token for a {type(tokenizer).__name__}")
