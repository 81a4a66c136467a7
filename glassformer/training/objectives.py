"""Training objectives: what a step reads and what it predicts, from the same token windows.

An objective turns a window's inputs x and next tokens y (B, T) into a Batch: the ids the
model reads and, at each position, the id it should predict (IGNORE: no loss there). The loss
is the cross-entropy over the counted positions (training.loop.lm_loss). Adding an objective is
one function + one entry in OBJECTIVES (+ its name in ObjectiveName).

    clm  causal LM: read x, predict y (the next token); a causal model
    mlm  masked LM: read x with 15% of positions masked (masking.py), predict the originals
         there; a bidirectional model and a tokenizer with a mask token
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..model.config import ModelConfig
from .masking import mask_tokens

ObjectiveName = Literal["clm", "mlm"]


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (B, T) the ids the model reads
    targets: torch.Tensor  # (B, T) the id to predict at each position; IGNORE: none


def causal_lm(x: torch.Tensor, y: torch.Tensor, tokenizer: Any, generator: torch.Generator) -> Batch:
    return Batch(x, y)


def masked_lm(x: torch.Tensor, y: torch.Tensor, tokenizer: Any, generator: torch.Generator) -> Batch:
    return Batch(*mask_tokens(x, tokenizer.mask_id, tokenizer.vocab_size, generator))


@dataclass(frozen=True)
class Objective:
    make_batch: Callable[[torch.Tensor, torch.Tensor, Any, torch.Generator], Batch]
    causal: bool | None  # the model it trains: causal, bidirectional (False), either (None)
    mask_token: bool = False  # the tokenizer needs a mask token


OBJECTIVES: dict[str, Objective] = {
    "clm": Objective(causal_lm, causal=None),
    "mlm": Objective(masked_lm, causal=False, mask_token=True),
}


def get_objective(name: str, model: ModelConfig, tokenizer: Any = None) -> Objective:
    """The objective called `name`, checked against the model (and tokenizer) it will train."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective: unknown {name!r}; choose one of {', '.join(OBJECTIVES)}")
    objective = OBJECTIVES[name]
    if objective.causal is not None and model.causal != objective.causal:
        kind = "a causal" if objective.causal else "a bidirectional (causal=False)"
        raise ValueError(f"objective: {name} trains {kind} model; this one has causal={model.causal} "
                         f"(try --preset tiny-bert or --no-causal)")
    if objective.mask_token and tokenizer is not None and getattr(tokenizer, "mask_id", None) is None:
        raise ValueError(f"objective: {name} needs a tokenizer with a mask token; this one has none")
    return objective
