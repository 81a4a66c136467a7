"""Training objectives: what a model learns from the windows of tokens the loop draws.

- clm: causal language modelling, every position against the next token (decoder-only models).
- span: T5's span corruption (span.py): the encoder reads a window with spans replaced by
  sentinels, the decoder writes the hidden spans (encoder-decoder models).
- mlm: BERT's masked LM (masking.py): 15% of positions chosen and masked, the originals
  predicted there only (encoders: bidirectional, decoder-only models).

An objective adds what it needs to the tokenizer, turns windows into a batch of tensors (the
last of them the targets) and scores a model on a batch. Its randomness comes from the
generator it is given, so a resumed run and any number of processes draw the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..model.config import ModelConfig
from .head_loss import language_model_loss
from .masking import apply_masks, draw_choices, with_mask_token
from .span import corrupt, noise_mask, sentinel_ids, span_counts, with_sentinels

Batch = tuple[torch.Tensor, ...]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)


class CausalLM:
    """Next-token prediction: the batch is (x, y), y the windows shifted by one."""

    name = "clm"

    def check(self, config: ModelConfig) -> None:
        if config.n_encoder_layers:
            raise InputError("objective", "clm trains decoder-only models; an encoder-decoder "
                             "trains with --objective span")

    def prepare_tokenizer(self, tokenizer, context_length: int):
        return tokenizer

    def draw_masks(self, n: int, length: int, generator: torch.Generator) -> None:
        return None  # nothing random: the generator is left as it was

    def batch(self, x: torch.Tensor, y: torch.Tensor, tokenizer, masks: torch.Tensor | None = None) -> Batch:
        return x, y

    def loss(self, model: torch.nn.Module, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        x, y = batch
        return language_model_loss(model, x, y, reduction)  # the head fused with the loss


class SpanCorruption:
    """T5's span corruption of the windows x (the shifted y is not used); the batch is
    (encoder inputs, decoder inputs, targets)."""

    name = "span"

    def check(self, config: ModelConfig) -> None:
        if not config.n_encoder_layers:
            raise InputError("objective", "span corruption trains encoder-decoder models "
                             "(e.g. --model tiny-t5)")
        span_counts(config.context_length)

    def prepare_tokenizer(self, tokenizer, context_length: int):
        return with_sentinels(tokenizer, span_counts(context_length)[1])

    def draw_masks(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Noise masks (n, length) for n windows."""
        return torch.stack([noise_mask(length, generator) for _ in range(n)])

    def batch(self, x: torch.Tensor, y: torch.Tensor, tokenizer, masks: torch.Tensor | None = None) -> Batch:
        sentinels = sentinel_ids(tokenizer, span_counts(x.shape[1])[1])
        return corrupt(x, masks.to(x.device), sentinels, tokenizer.eos_id, tokenizer.eos_id)

    def loss(self, model: torch.nn.Module, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        inputs, decoder_inputs, targets = batch
        return cross_entropy(model(inputs, decoder_inputs), targets, reduction)  # (B, U, vocab)


class MaskedLM:
    """BERT's masked LM on the windows x (the shifted y is not used); the batch is
    (inputs with masks, targets: IGNORE except at the chosen positions)."""

    name = "mlm"

    def check(self, config: ModelConfig) -> None:
        if config.causal or config.n_encoder_layers:
            raise InputError("objective", "mlm trains a bidirectional encoder (causal=False, no "
                             "decoder; e.g. --preset tiny-bert)")

    def prepare_tokenizer(self, tokenizer, context_length: int):
        return with_mask_token(tokenizer)

    def draw_masks(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """The uniform draws (n, length, 3) that choose and replace positions."""
        return draw_choices(n, length, generator)

    def batch(self, x: torch.Tensor, y: torch.Tensor, tokenizer, masks: torch.Tensor | None = None) -> Batch:
        if tokenizer.mask_id is None:
            raise InputError("objective", "mlm needs a tokenizer with a mask token")
        return apply_masks(x, masks, tokenizer.mask_id, tokenizer.vocab_size)

    def loss(self, model: torch.nn.Module, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        inputs, targets = batch  # IGNORE targets count for nothing; a batch may choose none
        return language_model_loss(model, inputs, targets, reduction)


OBJECTIVES = {"clm": CausalLM(), "span": SpanCorruption(), "mlm": MaskedLM()}


def get_objective(name: str):
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise InputError("objective", f"unknown {name!r}; choose one of {', '.join(OBJECTIVES)}") from None
