"""EngineConfig: how an engine runs, checked when made and handed whole to the parts that
read it (scheduler, runner, executors)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..model.sink import SinkPolicy

ATTENTION = ("reference", "fast")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    kv_memory_mb: float = 256.0  # the pool's size
    n_blocks: int | None = None  # overrides kv_memory_mb (tests)
    kv_dtype: str = "fp32"  # one of model/kv_formats.py KV_DTYPES
    max_batch: int = 16  # most requests in one step
    token_budget: int = 256  # most tokens in one step (prefill is cut into chunks to fit)
    prefix_caching: bool = True
    attention: str = "fast"  # "fast" | "reference"
    batch_invariant: bool = True  # row tiles: tokens independent of what shares a step (runner.py)
    trace_length: int = 1000  # steps kept in the trace
    compile: bool = False  # plain decoding rows as a compiled step per batch bucket (graph_path.py)
    # attention sinks (model/sink.py), per engine: the pool's accounting (S + W slots a request,
    # no prefix sharing) and the fused step's refusal follow from it
    sink: SinkPolicy | None = None
    # on CUDA, a request's numbers bit for bit independent of what shares its step (fixed
    # shapes); on the CPU the engine is so already
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise InputError("attention", f"choose one of {ATTENTION}, got {self.attention!r}")
        if self.kv_memory_mb <= 0:
            raise InputError("kv_memory_mb", f"must be positive, got {self.kv_memory_mb}")
        if self.max_batch < 1:
            raise InputError("max_batch", f"must be >= 1, got {self.max_batch}")
        if self.token_budget < self.max_batch:  # the one set away from its default is blamed
            field = "max_batch" if self.max_batch != EngineConfig.max_batch else "token_budget"
            raise InputError(field, f"a step of max_batch {self.max_batch} requests needs a token_budget "
                                    f"of as many tokens, got {self.token_budget}")
        if self.sink is not None and not isinstance(self.sink, SinkPolicy):
            raise InputError("sink", f"a SinkPolicy or None, got {type(self.sink).__name__}")
        if self.sink is not None and self.kv_dtype != "fp32":
            raise InputError("sink",
                             f"the sink policy keeps float32 keys; not with kv_dtype={self.kv_dtype!r}")
        if self.deterministic and not self.batch_invariant:
            raise InputError("deterministic", "needs batch_invariant=True (its products in row tiles)")

    @property
    def query_group(self) -> int:
        """How many of a prompt's queries one fast attention call takes together (1 for the
        reference attention), where the scheduler cuts prompts: the largest divisor of the
        block size within the token budget (a cache hit ends at a whole block, so at a group's
        edge, and the oldest request can always take a whole group)."""
        if self.attention != "fast":
            return 1
        size = self.block_size
        return max(d for d in range(1, min(size, self.token_budget) + 1) if size % d == 0)
