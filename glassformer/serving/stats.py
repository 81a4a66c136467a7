"""What the engine is doing, for people and the live page: counters, and a trace entry per step
(the requests that ran, their tokens, and the path their rows took with the reason)."""

from __future__ import annotations

from dataclasses import dataclass

from .block_manager import BlockManager
from .scheduler import Scheduler, StepPlan


@dataclass(frozen=True)
class StepTrace:
    step: int
    start: float  # time.perf_counter() when the forward began
    seconds: float  # the forward and the token picks
    requests: list[tuple[str, int]]  # (request id, tokens computed in this step)
    preempted: list[str]  # the requests that gave their blocks back
    paths: list[tuple[str, str]]  # per request: (path, reason)

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.requests)


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0  # prompt and generated tokens run through the model
    tokens_generated: int = 0
    finished: int = 0
    # the rest copied from the scheduler and the block manager after each step
    preemptions: int = 0
    running: int = 0
    waiting: int = 0
    blocks_cached: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    def record(self, plan: StepPlan, n_generated: int, scheduler: Scheduler, blocks: BlockManager) -> None:
        self.steps += 1
        self.tokens_computed += plan.n_tokens
        self.tokens_generated += n_generated
        self.preemptions = scheduler.preemptions
        self.running, self.waiting = len(scheduler.running), len(scheduler.waiting)
        self.blocks_cached = blocks.cached
        self.prefix_hit_tokens, self.prefix_query_tokens = blocks.hit_tokens, blocks.query_tokens
