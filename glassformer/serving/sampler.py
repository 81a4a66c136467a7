"""The step's one pick: from the step's logits (R, V), one outcome per sequence that caught up
with its tokens. Greedy rows take their argmax in one call (accel/greedy.py); every other row
is drawn with its request's settings and own generator on the logits' device, the draws
reaching the host at once. A row holding NaN or Inf, or a pick that fails, ends that request
alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..accel.greedy import argmax_rows
from ..generation.sampling import next_token
from .beam import BeamGroup
from .handle import TokenLogprobs
from .sequence import Sequence

NON_FINITE = ("its logits hold NaN or Inf: its activations overflowed (a steer's alpha, an adapter's "
              "weights?); no token was picked")


@dataclass(frozen=True)
class Picked:
    """A sequence's next token, and its log-probabilities where its request asks for them."""

    token: int
    logprobs: TokenLogprobs | None = None


# One sequence's outcome: its token; the error that ended its pick; its beam group, whose
# members have all offered (to be ranked now); or None, a member that offered and waits.
Outcome = Picked | Exception | BeamGroup | None


def broken_rows(logits: torch.Tensor) -> set[int]:
    """The rows of (R, V) logits holding NaN or Inf, listed only if any: a row's largest and
    smallest value are finite exactly when all of its are (both carry a NaN; +Inf shows in the
    largest, -Inf in the smallest), two reductions without a (R, V) mask."""
    finite = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))  # (R,)
    return set() if bool(finite.all()) else set((~finite).nonzero().flatten().tolist())


def draw(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """A draw from one row (1, V) with the request's settings and its own generator: (1,), on
    the logits' device."""
    return next_token(logits, seq.params.sampling, seq.generator, seq.counts)


def logprobs_of(row: torch.Tensor, token: int, top: int | None) -> TokenLogprobs | None:
    """The chosen token's log-probability and the `top` likeliest tokens' from one row (V,)."""
    if top is None:
        return None
    logprobs = torch.log_softmax(row.float(), dim=-1)
    values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
    return TokenLogprobs(float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist(), strict=True)))


def pick(ready: list[Sequence], logits: torch.Tensor) -> list[Outcome]:
    """Each ready sequence's outcome from its row of `logits` (R, V), in order."""
    broken = broken_rows(logits)
    outcomes: list[Outcome] = [None] * len(ready)
    greedy, drawn = [], {}  # rows to take the argmax of; row -> its draw (1,), still on the device
    for i, seq in enumerate(ready):
        if i in broken:
            outcomes[i] = FloatingPointError(NON_FINITE)
        elif isinstance(seq.unit, BeamGroup):
            outcomes[i] = seq.unit if seq.unit.offer(seq, logits[i]) else None
        elif seq.params.sampling.greedy and not seq.params.sampling.uses_counts:
            greedy.append(i)
        else:
            try:
                drawn[i] = draw(seq, logits[i : i + 1])
            except Exception as error:  # a request that fails here fails alone
                outcomes[i] = error
    tokens: dict[int, int] = {}
    if greedy:  # (R,): each row's own argmax, every row's at once (no copy when all are greedy)
        argmax = argmax_rows(logits if len(greedy) == len(ready) else logits[greedy]).tolist()
        tokens = dict(zip(greedy, argmax, strict=True))
    if drawn:
        tokens |= dict(zip(drawn, torch.cat(list(drawn.values())).tolist(), strict=True))
    for i, token in tokens.items():
        try:
            outcomes[i] = Picked(token, logprobs_of(logits[i], token, ready[i].params.logprobs))
        except Exception as error:
            outcomes[i] = error
    return outcomes
