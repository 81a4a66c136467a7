"""One request's share of a step (RequestRows): the one shape of a request's rows, read by the
step (step.py), the executors, the paged attention, capture and interventions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation.paths import Path
from .sequence import Sequence


@dataclass(frozen=True)
class RequestRows:
    """One request's share of a step: rows first .. first + n - 1 of the flat batch."""

    seq: Sequence
    first: int  # its first row in the batch
    n: int  # its rows: a prompt's chunk, or one new token
    slots: torch.Tensor  # (L,) the pool slots its queries see, in position order, its new ones last
    past_window: bool = False  # a chunk past the sink policy's window (model/sink_chunk.py)
    path: Path | None = None  # the path its rows take, with the reason (None: not routed yet)

    @property
    def context(self) -> int:
        """How many keys its last query sees."""
        return self.slots.shape[0]

    @property
    def rows(self) -> slice:
        return slice(self.first, self.first + self.n)

    @property
    def position(self) -> int:
        """The position of its first row in its text."""
        return self.seq.num_computed

    @property
    def prompt(self) -> int:
        """The length of the prompt these rows are of, or 0 for generated tokens (a prompt's
        last token, cut off by the budget, is its query group's as alone)."""
        return self.seq.prompt_len if self.seq.num_computed < self.seq.prompt_len else 0

    @property
    def adapter(self) -> str | None:
        return self.seq.params.adapter

    @property
    def inspects(self) -> frozenset[str]:
        """What it captures, reads or changes at the step's hook sites (RequestParams.inspects)."""
        return self.seq.params.inspects

    @property
    def ends(self) -> bool:
        """Whether its rows reach the end of its tokens: its next token is picked from this step."""
        return self.seq.num_computed + self.n == self.seq.num_tokens

    @property
    def last(self) -> int:
        """Its last row in the batch."""
        return self.first + self.n - 1
