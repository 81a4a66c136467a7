"""Which requests run in the next step, and how many tokens each: continuous batching with
chunked prefill, first come first served, preemption when KV blocks run out.

A step has a token budget. Running requests go first, oldest first: a decoding one needs one
token, one still prefilling takes the next chunk of its prompt (as much as the budget
leaves). Then waiting requests join while budget, batch size and blocks allow. When a running
request needs a block and none is free, the newest running request gives its blocks back
and waits to be recomputed (its full blocks usually stay cached). The oldest request can
always proceed, so the engine never deadlocks; a request too large for the whole pool is
refused at submission.

Under a sink policy (model/sink.py) a request holds the blocks of S + W slots however long it
runs: its tokens enter as many at once as fit before the first eviction, then in whole chunks
of the policy's (one token each while decoding), each token written over the slot of the token
it evicts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import InputError
from ..model.sink import SinkPolicy
from .block_manager import BlockManager
from .interventions import changes, uses_hooks
from .sequence import Sequence, Status


@dataclass
class StepPlan:
    """The scheduler's decision for one step; the runner only executes it."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, copy)

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int = 16, token_budget: int = 256,
                 sink: SinkPolicy | None = None, align: int = 1) -> None:
        """`align`: where the budget cuts a prompt, it cuts at a multiple of this many tokens
        (the fast attention's query group, paged_attention.py `query_group`; at most
        token_budget, so the oldest request always proceeds)."""
        if max_batch < 1:
            raise InputError("max_batch", f"must be >= 1, got {max_batch}")
        if token_budget < max_batch:
            raise InputError("token_budget", f"must be >= max_batch={max_batch}, got {token_budget}")
        self.blocks, self.max_batch, self.token_budget = blocks, max_batch, token_budget
        if not 1 <= align <= token_budget:
            raise InputError("align", f"between 1 and token_budget={token_budget}, got {align}")
        self.sink, self.align = sink, align
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # counter

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """A running sequence forked from another (it holds its blocks already)."""
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a request out (finished or cancelled) and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Blocks for seq's next n tokens (private where written), or False."""
        end, first = seq.num_computed + n, seq.num_computed  # slots needed, first slot written
        if self.sink is not None:
            end, first = min(end, self.sink.capacity), self.sink.slot(first)
        if not self.blocks.grow(seq, end):
            return False
        copy = self.blocks.write_block(seq, first)
        if copy is not None:
            plan.copies.append(copy)
        return True

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:  # a beam waiting for its group, or a sink chunk for a step with room
                i += 1
                continue
            while not self._reserve(seq, n, plan):
                victim = self.running.pop()  # the newest request
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is Status.WAITING:
                break  # it was preempted itself: nothing newer is left running
            plan.scheduled.append((seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_batch and not plan.preempted:
            seq = self.waiting[0]
            if not seq.block_table and not uses_hooks(seq.params):  # a hook sees every row
                self.blocks.match_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0 or not self._reserve(seq, n, plan):
                self.blocks.release(seq)  # keep nothing while waiting
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.scheduled.append((seq, n))
            budget -= n
        return plan

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of seq's tokens the step can take: within the budget, and within the sink
        policy's room. Where its prompt is cut must not depend on what shares the step (the
        numbers of an attention call depend on the queries it takes together): where the
        budget is what stops it, the cut falls at a multiple of `align` (maybe none: 0, it
        waits a step); past the sink policy's window a request takes its whole next chunk or
        waits a step (model/sink_chunk.py)."""
        computed, left = seq.num_computed, seq.num_tokens - seq.num_computed
        room = left if self.sink is None else self.sink.room(computed)
        if self.sink is not None and self.sink.full(computed):
            whole = min(left, room, self.token_budget)
            return whole if whole <= budget else 0
        if budget >= min(left, room):
            return min(left, room)
        return max(0, (computed + budget) // self.align * self.align - computed)

    def advance(self, plan: StepPlan) -> list[Sequence]:
        """After the step ran: count the computed tokens, key the blocks they filled; returns the
        requests that caught up with their tokens (their next token is to be picked)."""
        ready = []
        for seq, n in plan.scheduled:
            seq.num_computed += n
            if not changes(seq.params):  # steered or ablated keys are that request's own
                self.blocks.register(seq)
            if seq.num_computed == seq.num_tokens:
                ready.append(seq)
        return ready
