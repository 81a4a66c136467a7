"""What a generation is asked for and what it gives back: GenerationConfig, GenerationResult and
the Piece a stream yields per token. Plain values shared by every decode loop."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from .sampling import SamplingConfig

StopReason = Literal["eos", "stop_string", "max_new_tokens", "context_full"]


@dataclass(frozen=True)
class GenerationConfig:
    """How to continue a prompt. The default is greedy decoding with the KV cache."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    seed: int | None = None  # None: a fresh random seed; every row of a batch draws with its own
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded text (needs a tokenizer)
    eos_ids: tuple[int, ...] | None = None  # None: the tokenizer's eos_id
    use_cache: bool = True
    beams: int = 1  # > 1: beam search (beam.py)
    length_penalty: float = 1.0  # beam score = sum log p / length^length_penalty
    truncate: bool = False  # a prompt longer than the window is cut from the left
    overflow: Literal["stop", "slide"] = "stop"  # at the window's end: stop, or drop old tokens

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens!r}")
        if self.beams < 1:
            raise ValueError(f"beams: must be >= 1, got {self.beams}")
        if self.overflow not in ("stop", "slide"):
            raise ValueError(f"overflow: choose 'stop' or 'slide', got {self.overflow!r}")
        if isinstance(self.stop, str):
            raise ValueError("stop: a tuple of strings, not a single string")


@dataclass
class GenerationResult:
    prompt_ids: list[int]  # what the model saw (after truncation)
    generated_ids: list[int]  # including the end-of-text token when one ended the text
    text: str | None  # the visible text, cut before a stop string; None without a tokenizer
    stop_reason: StopReason
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int  # forward passes after the prefill
    truncated_tokens: int = 0  # prompt tokens dropped from the left
    log_prob: float | None = None  # sum of log-probabilities of generated_ids (beam search)
    stop_string: str | None = None  # the stop string that ended the text

    @property
    def n_generated(self) -> int:
        return len(self.generated_ids)

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {
            "n_generated": self.n_generated,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
        }


@dataclass(frozen=True)
class Piece:
    """One generated token of row `row` and the text it made visible ('' while held back)."""

    row: int
    token_id: int
    text: str
