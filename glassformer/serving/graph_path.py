"""GraphPath: the engine's decoding rows as one compiled step of fixed shapes (on CUDA, a
recorded graph replayed each step), over the paged pool through FlexAttention (flex_paged.py).

    rows      B decoding requests (one new token each), padded to a bucket (BUCKETS)
    buffers   per bucket, fixed: token ids, positions, the slot each row writes (B,); each
              row's block table (B, 1, 1, n) and its length in blocks (B, 1, 1); shared by
              all buckets, each pool block's place in its table (blocks,). Filled on the host
              and copied once a step; a padding row is token 0 at position 0, writing its keys
              at the pool's scratch block (kv_pool.py) and seeing only them
    step      the model's embedding and blocks over (B, 1) with the RoPE table read at the
              positions and the FlexAttention cache, compiled once per bucket
              (torch.compile, fullgraph, static shapes; mode="reduce-overhead" on CUDA)

A row's numbers depend on its own request alone: padding rows write nowhere a request reads,
and no row sees another's blocks. The products run over the bucket's rows at once (not the
module path's row tiles, row_tiles.py), so they agree with the module path within float32
rounding, not bit for bit; and a GPU's kernels, chosen by shape, may round a row otherwise in
another bucket. Deterministic (EngineConfig.deterministic on CUDA), every step is padded to
max_batch's bucket, so every kernel sees one shape.

It refuses (`refuses`, the trace's reason) what its table (`CAPABILITIES`: the masks are causal
and one window, the scores plain, one RoPE table) or its fixed shapes do not compute: prompt
chunks, rows that inspect, steer or name an adapter, other pools than float32 at text
positions, the reference attention; those rows take the module path.
"""

from __future__ import annotations

import torch

from ..accel.capabilities import CapabilityTable, only
from ..errors import InputError
from ..model.transformer import Transformer
from .capture import LensRows
from .config import EngineConfig
from .executors import CAPABILITIES as MODULE_CAPABILITIES
from .executors import Executed, RopeTables, pool_refusal
from .flex_paged import FLEX_BLOCK, FlexPagedCache, paged_block_mask
from .kv_pool import KVPool
from .rows import RequestRows
from .step import StepBatch

GRAPH = "graph"
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# FlexAttention's kernels on CUDA (Triton, PyTorch 2.11) take heads of at least this many
# dimensions; the CPU's take any.
FLEX_CUDA_HEAD_DIM = 16

# What the graph executor computes: the module path's table, but for what its FlexAttention
# mask (causal, one window) leaves out (and LongRoPE: `refused`).
CAPABILITIES = CapabilityTable("graph executor", {
    **MODULE_CAPABILITIES.rules,
    "position": only("rope", "learned", "sinusoidal", "none",
                     reason="ALiBi and T5's bias add to the scores; its mask is causal and a window"),
    "attn_softcap": only(None, reason="its attention's scores are plain"),
    "layer_windows": only(None, reason="its mask has one window"),
})


def bucket_of(rows: int) -> int:
    """The smallest bucket that holds `rows` (at most the largest)."""
    return next(b for b in BUCKETS if b >= rows)


def graph_step(model: Transformer, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               kv_blocks: torch.Tensor, kv_indices: torch.Tensor, block_position: torch.Tensor,
               keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int,
               rope: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None) -> torch.Tensor:
    """One token per row, ids and positions (B,), written at slots (B,): the residual streams
    after the last block, (B, d). `rope`: cos and sin (context, rotated) per kind of layer."""
    block_mask = paged_block_mask(kv_blocks, kv_indices, block_position, positions, block_size,
                                  keys[0].shape[0], model.config.sliding_window)
    cache = FlexPagedCache(keys, values, slots, block_mask, [block.attn.scale for block in model.blocks])
    angles = None
    if rope is not None:  # (B, 1, 1, rotated) each
        angles = tuple((cos[positions][:, None, None], sin[positions][:, None, None]) for cos, sin in rope)
    x = model.embed(ids[:, None], positions[:, None])  # (B, 1, d)
    for block in model.blocks:
        x = block(x, None, angles, cache)
    return x[:, 0]


class DecodeBuffers:
    """One bucket's fixed inputs, on the model's device."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)  # (B,)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # (B,)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)  # (B,)
        self.kv_blocks = torch.zeros(rows, 1, 1, dtype=torch.int32, device=device)  # (B, 1, 1)
        self.kv_indices = torch.zeros(rows, 1, 1, width, dtype=torch.int32, device=device)  # (B, 1, 1, n)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.positions, self.slots, self.kv_blocks, self.kv_indices


class GraphPath:
    name = GRAPH

    def __init__(self, model: Transformer, pool: KVPool, config: EngineConfig, rope: RopeTables | None,
                 deterministic: bool = False) -> None:
        """`pool`: taken whole, with its scratch block (KVPool(scratch=True)); `deterministic`:
        every step padded to max_batch's bucket, whatever its number of rows (one shape for
        every kernel), else to the smallest bucket that holds them."""
        if pool.scratch_block is None:
            raise ValueError("the graph path needs a pool with a scratch block (KVPool(scratch=True))")
        self.model, self.pool = model, pool
        # deterministic: every step at max_batch's bucket (None: the smallest that holds its rows)
        self.deterministic_bucket = bucket_of(min(config.max_batch, BUCKETS[-1])) if deterministic else None
        self.rope = None if rope is None else rope.short
        self.device = model.embed.tokens.weight.device
        self.refused = pool_refusal("the graph executor", config) or CAPABILITIES.why_not(model.config)
        if self.refused is None and model.config.rope_scaling == "longrope":
            self.refused = "LongRoPE turns a request by one of two sets (the graph executor reads one table)"
        if self.refused is None and self.device.type == "cuda" and model.config.head_dim < FLEX_CUDA_HEAD_DIM:
            self.refused = (f"heads of {model.config.head_dim} dimensions (the graph executor's "
                            f"FlexAttention needs {FLEX_CUDA_HEAD_DIM} on CUDA)")
        blocks = pool.n_blocks + 1  # the scratch block last
        # a row's table as wide as the pool: FlexAttention's mask spans every key it is given
        self.width = blocks
        self.block_position = torch.zeros(blocks, dtype=torch.long)  # (blocks,) on the host
        self.block_position_on_device = self.block_position.to(self.device)  # (blocks,)
        self.buffers: dict[int, DecodeBuffers] = {}
        cuda = self.device.type == "cuda"
        if cuda and pool.block_size % FLEX_BLOCK:
            raise InputError("block_size", f"the graph executor on CUDA (--compile) needs KV blocks of a "
                             f"multiple of {FLEX_BLOCK} tokens (FlexAttention's tiles), not "
                             f"{pool.block_size}")
        self.step = torch.compile(graph_step, fullgraph=True, dynamic=False,
                                  mode="reduce-overhead" if cuda else None)

    def refuses(self, rows: RequestRows) -> str | None:
        params = rows.seq.params
        if self.refused is not None:
            return self.refused
        if rows.prompt or rows.n > 1:
            return "a prompt's chunk (the graph executor runs one new token per row)"
        if params.inspects:
            return "it captures, steers or reads the lens (the graph executor has no hook sites)"
        if params.adapter is not None:
            return f"its adapter {params.adapter!r} runs on the module path (not in the graph executor)"
        return None

    def takes(self, rows: RequestRows) -> str:
        return "a plain decoding row, in the bucket's graph"

    def execute(self, batch: StepBatch) -> Executed:
        hidden = [self._run(batch, start) for start in range(0, len(batch.requests), BUCKETS[-1])]
        return Executed(torch.cat(hidden) if len(hidden) > 1 else hidden[0],
                        LensRows(self.model.config, []))

    def _run(self, batch: StepBatch, start: int) -> torch.Tensor:
        """The residual streams (B, d) of the batch's requests start.. (at most a bucket's)."""
        requests = batch.requests[start : start + BUCKETS[-1]]
        rows = max(self.deterministic_bucket or 1, bucket_of(len(requests)))
        bs, scratch = self.pool.block_size, self.pool.scratch_block
        ids = torch.zeros(rows, dtype=torch.long)  # (B,) on the host, as every index below
        positions = torch.zeros(rows, dtype=torch.long)  # (B,)
        slots = torch.full((rows,), scratch * bs, dtype=torch.long)  # (B,) padding: the scratch block
        kv_blocks = torch.ones(rows, 1, 1, dtype=torch.int32)  # (B, 1, 1)
        kv_indices = torch.full((rows, 1, 1, self.width), scratch, dtype=torch.int32)  # (B, 1, 1, n)
        for i, r in enumerate(requests):
            seq, position = r.seq, r.slots.shape[0] - 1
            table = seq.block_table[: position // bs + 1]
            ids[i], positions[i], slots[i] = seq.tokens[seq.num_computed], position, r.slots[-1]
            kv_blocks[i] = len(table)
            kv_indices[i, 0, 0, : len(table)] = torch.tensor(table, dtype=torch.int32)  # the rest unread
            self.block_position[table] = torch.arange(len(table))
        buffers = self.buffers.get(rows)
        if buffers is None:
            buffers = self.buffers[rows] = DecodeBuffers(rows, self.width, self.device)
        filled = (ids, positions, slots, kv_blocks, kv_indices)
        for buffer, value in zip(buffers.tensors(), filled, strict=True):
            buffer.copy_(value, non_blocking=True)
        self.block_position_on_device.copy_(self.block_position, non_blocking=True)
        fixed = (*buffers.tensors(), self.block_position_on_device)
        inputs = (*fixed, self.pool.keys, self.pool.values, bs, self.rope)
        if self.device.type == "cuda":  # the buffers stay where the recorded graph reads them
            for tensor in (*fixed, *self.pool.keys, *self.pool.values):
                torch._dynamo.mark_static_address(tensor)
            torch.compiler.cudagraph_mark_step_begin()
            return self.step(self.model, *inputs)[: len(requests)].clone()
        return self.step(self.model, *inputs)[: len(requests)]
