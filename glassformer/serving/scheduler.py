"""Which requests run in the next step, and how many tokens each: continuous batching with
chunked prefill in a token budget, first come first served, preemption of the newest when KV
blocks run out.

Invariants: a request's blocks for a step (its private copies of shared ones included) are
taken all or none; a beam group joins and is preempted whole (a member alone would wait
forever for the others' logits); the oldest request always proceeds, so the engine never
deadlocks (one that cannot start on a pool empty of others is handed back: StepPlan.refused).
Under a sink policy a request holds the blocks of S + W slots however long it runs, and past
its window takes whole chunks of the policy's. Under LongRoPE a text grown past the original
context is recomputed from the start by the long set before the step is planned, as
transformers' Phi-3 generation does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..model.config import ModelConfig
from ..model.layers.positions import uses_long_factors
from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, Status


@dataclass
class StepPlan:
    """The scheduler's decision for one step; the runner only executes it."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, copy)
    refused: list[Sequence] = field(default_factory=list)  # could never fit the pool: to end

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: EngineConfig, model: ModelConfig | None = None) -> None:
        """`model`: the served model's config, for LongRoPE's switch (None: no switch)."""
        self.blocks, self.max_batch, self.token_budget = blocks, config.max_batch, config.token_budget
        self.sink = config.sink
        self.align = config.query_group  # where the budget cuts a prompt
        self.longrope = model if model is not None and model.rope_scaling == "longrope" else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # counter

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """A running sequence forked from another (it holds its blocks already); it takes its
        place beside its group's other members, so the group stays as old as its request."""
        last = max(i for i, other in enumerate(self.running) if other.unit is seq.unit)
        self.running.insert(last + 1, seq)

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

    def _preempt_newest(self, plan: StepPlan) -> list[Sequence]:
        """The newest running request gives its blocks back and waits at the front of the queue,
        a beam group all its members at once (what they scheduled this step is dropped)."""
        unit = list(self.running[-1].unit.members)
        self.running = [seq for seq in self.running if seq not in unit]
        for seq in unit:
            self.blocks.release(seq)
            seq.status = Status.WAITING
            seq.preemptions += 1
            seq.unit.forget(seq)  # its logits come again once it is recomputed
        self.preemptions += len(unit)
        self.waiting.extendleft(reversed(unit))
        plan.preempted.extend(unit)
        plan.scheduled = [(seq, n) for seq, n in plan.scheduled if seq not in unit]
        plan.copies = [c for c in plan.copies if self.blocks.blocks[c[1]].ref_count > 0]
        return unit

    def _span(self, seq: Sequence, n: int) -> tuple[int, int]:
        """(slots needed, first slot written) for seq's next n tokens."""
        end, first = seq.num_computed + n, seq.num_computed
        if self.sink is not None:
            end, first = min(end, self.sink.capacity), self.sink.slot(first)
        return end, first

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Every block seq's next n tokens write (private copies of shared ones included), or
        False with nothing taken."""
        copies = self.blocks.grow(seq, *self._span(seq, n))
        plan.copies += copies or []
        return copies is not None

    def _switch_long_texts(self) -> None:
        """LongRoPE: a text grown past the original context turns long, recomputed from the start;
        its blocks then match only other long texts' in the prefix cache."""
        for seq in (*self.running, *self.waiting):
            if not seq.rope_long and uses_long_factors(self.longrope, seq.num_tokens - 1):
                self.blocks.release(seq)
                seq.unit.forget(seq)  # its logits come again once it is recomputed
                seq.rope_long = True
                seq.prefix_root = (seq.prefix_root, "longrope long factors")

    def schedule(self) -> StepPlan:
        if self.longrope is not None:
            self._switch_long_texts()
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
                if seq in self._preempt_newest(plan):
                    break
            if seq.status is Status.WAITING:
                break  # its own request was the newest: nothing newer is left running
            plan.scheduled.append((seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_batch and not plan.preempted:
            taken = self._admit(plan, budget)
            if not taken:
                break
            budget -= taken
        if not plan.scheduled and self.running and not plan.preempted:
            self._preempt_newest(plan)  # nothing running could proceed: make room rather than spin
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> int:
        """Start the first waiting request if it gets the blocks of its next chunk (the tokens it
        takes, 0 when it waits); a beam group with all its members, if the blocks of all their
        recomputation are free. One that cannot start on a pool empty of others never will:
        it goes to plan.refused."""
        unit, chunks = list(self.waiting[0].unit.members), []
        for seq in unit:
            if not seq.block_table and not seq.params.inspects:  # a hook sees every row
                self.blocks.match_prefix(seq)
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1]
        fits = chunks[0] > 0
        if fits and len(unit) > 1:
            whole = sum(self.blocks.blocks_needed(seq, *self._span(seq, seq.num_tokens - seq.num_computed))
                        for seq in unit)
            fits = whole <= self.blocks.free_count
        if fits:
            fits = all(n == 0 or self._reserve(seq, n, plan) for seq, n in zip(unit, chunks, strict=True))
        if not fits:
            for seq in unit:
                self.blocks.release(seq)  # keep nothing while waiting
            if not self.running and not plan.scheduled and chunks[0] > 0:
                for seq in unit:
                    self.waiting.remove(seq)
                plan.refused.append(unit[0])
            return 0
        for seq, n in zip(unit, chunks, strict=True):
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if n:
                plan.scheduled.append((seq, n))
        return sum(chunks)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of seq's tokens the step can take, within the budget and the sink policy's
        room. Where the budget cuts a prompt it cuts at a multiple of `align` (maybe 0: it
        waits), so the cut never depends on what shares the step; past the sink policy's
        window a request takes its whole next chunk or waits (model/sink_chunk.py)."""
        computed, left = seq.num_computed, seq.num_tokens - seq.num_computed
        if self.sink is not None:
            left = min(left, self.sink.room(computed))
            if self.sink.full(computed):  # its whole next chunk, or nothing
                whole = min(left, self.token_budget)
                return whole if whole <= budget else 0
        if budget >= left:
            return left
        return max(0, (computed + budget) // self.align * self.align - computed)

    def advance(self, plan: StepPlan) -> list[Sequence]:
        """After the step ran: count the computed tokens, key the blocks they filled; returns the
        requests that caught up with their tokens (their next token is to be picked)."""
        ready = []
        for seq, n in plan.scheduled:
            seq.num_computed += n
            if not seq.params.changes_model:  # steered or ablated keys are that request's own
                self.blocks.register(seq)
            if seq.num_computed == seq.num_tokens:
                ready.append(seq)
        return ready

