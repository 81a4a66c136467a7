"""A request inside the engine: its tokens, how many are in the KV cache, its blocks, and what
picks and checks its next token (its own generator, counts, text stream)."""

from __future__ import annotations

import time
from collections.abc import Sequence as Ids
from enum import Enum

import torch

from ..generation.config import RequestParams, StopReason
from ..generation.core import eos_ids, seeded_generators, stop_after
from ..generation.sampling import token_counts
from ..generation.stopping import Decoder, TextStream


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt: Ids[int], params: RequestParams, vocab_size: int,
                 tokenizer: Decoder | None = None, request_id: str = "req",
                 device: torch.device | None = None) -> None:
        """`request_id`: unique in its engine (Engine.submit numbers those not given);
        `device`: the model's, where the request's generator and token counts live (the engine
        samples there)."""
        self.id = request_id
        self.tokens = list(prompt)  # the prompt, then every generated token
        self.prompt_len = len(self.tokens)
        self.params, self.eos = params, eos_ids(params, tokenizer)
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose keys and values are in the cache
        self.block_table: list[int] = []
        self.block_keys: list[int] = []  # prefix keys of the full blocks, in order
        self.prefix_root = None  # the first block's parent key: its adapter's (Engine.submit)
        self.rope_long = False  # LongRoPE: its keys turn by the long set (executors.py RopeTables)
        self.generator = seeded_generators(params.seed, 1, device or torch.device("cpu"))[0]
        self.counts = None
        if params.sampling.uses_counts:  # (1, V) occurrences for the penalties
            self.counts = token_counts(torch.tensor([self.tokens], device=device), vocab_size)
        self.text = None if tokenizer is None else TextStream(tokenizer, params.stop, self.tokens[-4:])
        self.stop_reason: StopReason | None = None
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.preemptions = 0
        self.unit = self  # what is scheduled, answered and ended as one: itself, or its BeamGroup
        # capture: site -> position -> the site's tensor for that row (its token axis removed)
        self.captured: dict[str, dict[int, torch.Tensor]] = {site.full: {} for site in params.capture}
        # lens: position -> the top-k token ids and probabilities there, (sites, k) each
        self.lens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    # a request of one sequence, as a BeamGroup is one of several (beam.py)
    @property
    def members(self) -> list[Sequence]:
        return [self]

    @property
    def root(self) -> Sequence:
        return self

    def forget(self, seq: Sequence) -> None:
        """A member was preempted: one sequence keeps nothing of its pick between steps."""

    def accept(self, token: int, context_length: int) -> str:
        """Append a generated token and decide whether to stop; returns the newly visible text."""
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.tokens.append(token)
        if self.counts is not None:
            self.counts[0, token] += 1
        self.stop_reason, piece = stop_after(token, self.eos, self.text, len(self.generated),
                                             self.params.max_new_tokens)
        if self.stop_reason is None and self.num_tokens > context_length:
            self.stop_reason = "context_full"  # no position left for the next token
        if self.stop_reason is not None:
            self.finish_time = now
            if self.text is not None:
                piece += self.text.flush()
        return piece
