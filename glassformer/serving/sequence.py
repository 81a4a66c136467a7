"""A request inside the engine: its tokens, how many of them are in the KV cache, its blocks,
and the state that picks and checks its next token (its own generator, counts, text stream)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence as Ids
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import torch

from ..generation.core import stop_after
from ..generation.sampling import SamplingConfig, token_counts
from ..generation.stopping import Decoder, TextStream

StopReason = Literal["eos", "stop_string", "max_new_tokens", "context_full", "cancelled"]


@dataclass(frozen=True)
class RequestParams:
    """How one request is continued. The default is greedy decoding of up to 64 tokens."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer)
    eos_ids: tuple[int, ...] | None = None  # None: the tokenizer's eos_id
    beams: int = 1  # > 1: beam search over forked sequences (beam.py)
    length_penalty: float = 1.0  # beam score = sum log p / length^length_penalty
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n likeliest

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens!r}")
        if self.beams < 1:
            raise ValueError(f"beams: must be >= 1, got {self.beams}")
        if self.beams > 1 and (not self.sampling.greedy or self.sampling.uses_counts):
            raise ValueError("beams: beam search ranks raw log-probabilities; drop sampling and penalties")
        if self.logprobs is not None and (self.logprobs < 0 or self.beams > 1):
            raise ValueError(f"logprobs: a count >= 0 without beams, got {self.logprobs!r}")
        if isinstance(self.stop, str):
            raise ValueError("stop: a tuple of strings, not a single string")

    @classmethod
    def from_fields(cls, **fields: Any) -> RequestParams:
        """From flat settings (a JSON line, keyword arguments): RequestParams fields and
        SamplingConfig fields side by side; `stop` may be one string."""
        own = {f.name for f in dataclasses.fields(cls)} - {"sampling"}
        sampling = {f.name for f in dataclasses.fields(SamplingConfig)}
        unknown = sorted(set(fields) - own - sampling)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown setting; use {sorted(own | sampling)}")
        if isinstance(fields.get("stop"), str):
            fields["stop"] = (fields["stop"],)
        for name in ("stop", "eos_ids"):
            if fields.get(name) is not None:
                fields[name] = tuple(fields[name])
        fields.setdefault("temperature", 0.0)
        return cls(sampling=SamplingConfig(**{k: v for k, v in fields.items() if k in sampling}),
                   **{k: v for k, v in fields.items() if k in own})


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt: Ids[int], params: RequestParams, vocab_size: int,
                 tokenizer: Decoder | None = None, eos: set[int] | None = None,
                 request_id: str | None = None) -> None:
        self.id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.tokens = list(prompt)  # the prompt, then every generated token
        self.prompt_len = len(self.tokens)
        self.params, self.eos = params, eos or set()
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose keys and values are in the cache
        self.block_table: list[int] = []
        self.block_keys: list[int] = []  # prefix keys of the full blocks, in order
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed) if params.seed is not None else self.generator.seed()
        self.counts = None
        if params.sampling.uses_counts:  # (1, V) occurrences for the penalties
            self.counts = token_counts(torch.tensor([self.tokens]), vocab_size)
        self.text = None if tokenizer is None else TextStream(tokenizer, params.stop, self.tokens[-4:])
        self.stop_reason: StopReason | None = None
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.preemptions = 0
        self.group = None  # the BeamGroup this sequence is a member of

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

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
