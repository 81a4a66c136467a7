"""One step of the engine as a value: the scheduler's plan as the rows the executors run.

The N new tokens of a step (decode rows and prompt chunks alike) are one flat sequence, a
request's share of it one RequestRows; `route` is the one decision of the path a share takes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from collections.abc import Sequence as Listed
from dataclasses import dataclass
from typing import Protocol

import torch

from ..generation.paths import Path
from ..model.sink import SinkPolicy
from .scheduler import StepPlan
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
    def prompt(self) -> int:
        """The length of the prompt these rows are of, or 0 for generated tokens (a prompt's
        last token, cut off by the budget, is its query group's as alone)."""
        return self.seq.prompt_len if self.seq.num_computed < self.seq.prompt_len else 0

    @property
    def ends(self) -> bool:
        """Whether its rows reach the end of its tokens: its next token is picked from this step."""
        return self.seq.num_computed + self.n == self.seq.num_tokens


def flat_rows(requests: Listed[RequestRows]) -> torch.Tensor:
    """The requests' rows of the flat batch, in order: (M,) on the host."""
    return torch.cat([torch.arange(r.first, r.first + r.n) for r in requests])


def recounted(requests: Listed[RequestRows]) -> list[RequestRows]:
    """The requests with their rows counted from 0 over their own rows alone."""
    firsts = itertools.accumulate((r.n for r in requests), initial=0)  # one more than the requests
    return [dataclasses.replace(r, first=first) for r, first in zip(requests, firsts, strict=False)]


@dataclass(frozen=True)
class StepBatch:
    ids: torch.Tensor  # (N,) the step's new tokens
    positions: torch.Tensor  # (N,) their positions: in the text, or in the cache under the sink policy
    requests: tuple[RequestRows, ...]
    copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (source block, copy), before the step
    index: torch.Tensor | None = None  # (N',) rows of the whole step, for a path's share (None: the whole)

    def on(self, path: str) -> StepBatch | None:
        """The share of the requests whose rows take `path`, rows counted from 0; None if none."""
        mine = [r for r in self.requests if r.path.name == path]
        if len(mine) == len(self.requests):
            return self
        if not mine:
            return None
        index = flat_rows(mine)  # (N',)
        rows = index.to(self.ids.device)
        return StepBatch(self.ids[rows], self.positions[rows], tuple(recounted(mine)), (), index)


@dataclass(frozen=True)
class Executed:
    hidden: torch.Tensor  # (N, d) each row's residual stream after the last block
    lens: dict[Sequence, dict[str, torch.Tensor]]  # lens request -> site -> its kept rows (n, d)


class Executor(Protocol):
    name: str  # the path it runs: FUSED, GRAPH or MODULES

    def execute(self, share: StepBatch) -> Executed:
        """Runs the rows of its share (StepBatch.on)."""

    def refuses(self, rows: RequestRows) -> str | None:
        """Why it does not run these rows, or None when it does."""

    def takes(self, rows: RequestRows) -> str:
        """Why it runs rows it does not refuse, in words."""


def route(executors: Listed[Executor], rows: RequestRows) -> Path:
    """The path of the first executor that does not refuse the rows, with the reason: why the
    one before it refused them, or, for the first, why it takes them. The engine's last, the
    module path, takes every row."""
    declined = None
    for executor in executors:
        reason = executor.refuses(rows)
        if reason is None:
            return Path(executor.name, declined or executor.takes(rows))
        declined = reason
    raise ValueError(f"no executor takes the rows of {rows.seq.id}: {declined}")


def step_batch(plan: StepPlan, path_of: Callable[[RequestRows], Path], block_size: int,
               sink: SinkPolicy | None, device: torch.device) -> StepBatch:
    """The plan's scheduled tokens as one batch; `path_of(rows)` chooses a request's path."""
    ids, positions, requests = [], [], []
    for seq, n in plan.scheduled:
        context = seq.num_computed + n
        # a chunk past the sink policy's window (model/sink_chunk.py): its queries sit at the
        # cache's last n positions and see the W - 1 latest keys before its own
        past_window = sink is not None and n > 1 and sink.full(seq.num_computed)
        slots = seen_slots(seq, context, past_window, block_size, sink)  # (L,)
        rows = RequestRows(seq, len(ids), n, slots, past_window)
        requests.append(dataclasses.replace(rows, path=path_of(rows)))
        ids += seq.tokens[seq.num_computed : context]
        first = rows.context - n if sink is None else sink.position(seq.num_computed, n)
        positions += range(first, first + n)  # text positions, or the cache's
    return StepBatch(torch.tensor(ids, device=device), torch.tensor(positions, device=device),  # (N,) each
                     tuple(requests), tuple(plan.copies))


def slots_of(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """The pool slots of a sequence's first `length` tokens: (length,)."""
    table = torch.tensor(block_table, dtype=torch.long)
    return (table[:, None] * block_size + torch.arange(block_size)).flatten()[:length]


def seen_slots(seq: Sequence, context: int, past_window: bool, block_size: int,
               sink: SinkPolicy | None) -> torch.Tensor:
    """The pool slots of what seq's tokens up to `context` attend to, in position order: its
    first `context` tokens, or under the sink policy the kept ones, or for a chunk past its
    window the sinks, the W - 1 latest before it and its own (L,)."""
    if sink is None:
        return slots_of(seq.block_table, context, block_size)
    first = seq.num_computed
    kept = (sink.chunk_slots(first) + [sink.slot(t) for t in range(first, context)]
            if past_window else sink.kept_slots(context))
    kept = torch.tensor(kept, dtype=torch.long)  # (L,)
    table = torch.tensor(seq.block_table, dtype=torch.long)
    return table[kept // block_size] * block_size + kept % block_size
