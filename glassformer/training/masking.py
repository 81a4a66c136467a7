"""BERT's masking (Devlin et al., 2019): which positions a masked-LM step predicts, and what
the model reads there.

    chosen   = each position with probability 0.15
    of those:  80% read the mask token, 10% a random token, 10% the token itself
    targets  = the original token at chosen positions, IGNORE elsewhere (no loss there)

Random numbers come from an explicit CPU torch.Generator (the run's data generator), so a run
is reproducible and resumes exactly on any device.
"""

from __future__ import annotations

import torch

IGNORE = -100  # a target that counts for nothing (cross_entropy's ignore_index)
CHOOSE, REPLACE_MASK, REPLACE_RANDOM = 0.15, 0.8, 0.1


def mask_tokens(ids: torch.Tensor, mask_id: int, vocab_size: int, generator: torch.Generator,
                rate: float = CHOOSE) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both shaped like ids (B, T)."""
    shape = ids.shape
    chosen = torch.rand(shape, generator=generator) < rate  # (B, T)
    kind = torch.rand(shape, generator=generator)  # (B, T): < 0.8 mask, < 0.9 random, else keep
    random_ids = torch.randint(0, vocab_size, shape, generator=generator)  # (B, T)
    chosen, kind, random_ids = (t.to(ids.device) for t in (chosen, kind, random_ids))
    inputs = torch.where(chosen & (kind < REPLACE_MASK), mask_id, ids)
    swap = chosen & (kind >= REPLACE_MASK) & (kind < REPLACE_MASK + REPLACE_RANDOM)
    inputs = torch.where(swap, random_ids, inputs)
    targets = torch.where(chosen, ids, IGNORE)
    return inputs, targets
