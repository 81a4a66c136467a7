"""GraphPath: the engine's plain decoding rows as one compiled step of fixed shapes (on CUDA, a
recorded graph replayed each step), attending over the paged pool through FlexAttention.

Rows are padded to a bucket (BUCKETS), a padding row writing at the pool's scratch block and
seeing only it. FlexAttention sees one layer's pool as one sequence of keys; its BlockMask lists
each row's own blocks and, inside them, the model's rule on positions (a key's: its block's
place in the table times the block size plus its offset). A row's numbers depend on its request
alone and agree with the module path (paged_attention.py) within float32 rounding.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..accel.capabilities import CapabilityTable, only
from ..errors import InputError
from ..model.kv_cache import AttentionFn
from ..model.layers.masking import AttentionMask
from ..model.transformer import Transformer
from .config import EngineConfig
from .executors import CAPABILITIES as MODULE_CAPABILITIES
from .executors import RopeTables, pool_refusal
from .kv_pool import KVPool
from .step import Executed, RequestRows, StepBatch

# FlexAttention's own block (its default size), which every tile its CUDA kernels choose
# divides: a row's one query sits in a block of this many, and on CUDA the pool's KV blocks
# are a multiple of it (its kernels take a tile of 32 to 128 keys, or, where a KV head's query
# heads are a power of two, no more keys than a block holds).
FLEX_BLOCK = 128


def paged_block_mask(kv_blocks: torch.Tensor, kv_indices: torch.Tensor, block_position: torch.Tensor,
                     q_position: torch.Tensor, block_size: int, pool_slots: int,
                     window: int | None) -> BlockMask:
    """Which pool slots each of B rows sees: kv_blocks (B, 1, 1) and kv_indices (B, 1, 1, n)
    int32, its block table; block_position (blocks,) each block's place in its table;
    q_position (B,) each row's position."""

    def sees(b, h, q_idx, kv_idx):
        key = block_position[kv_idx // block_size] * block_size + kv_idx % block_size
        seen = key <= q_position[b]
        if window is not None:
            seen = seen & (q_position[b] - key < window)
        return seen

    return BlockMask.from_kv_blocks(kv_blocks, kv_indices, BLOCK_SIZE=(FLEX_BLOCK, block_size),
                                    mask_mod=sees, seq_lengths=(1, pool_slots))


class FlexPagedCache:
    """The AttentionCache (model/kv_cache.py) of a graph step: each layer's new keys and values
    (B, KV, 1, d_head) written at `slots` (B,) of the pool, then FlexAttention of the queries
    over the pool under `block_mask`, at each layer's score scale (None: 1/√d_head)."""

    rotates_keys = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                 block_mask: BlockMask, scales: list[float | None]) -> None:
        self.keys, self.values, self.slots = keys, values, slots  # (S_pool, KV, d_head) each layer
        self.block_mask, self.scales = block_mask, scales

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: AttentionMask | None, attention: AttentionFn) -> torch.Tensor:
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(0, self.slots, k[:, :, 0].to(keys.dtype))
        values.index_copy_(0, self.slots, v[:, :, 0].to(values.dtype))
        pooled_k = keys.transpose(0, 1)[None].to(q.dtype)  # (1, KV, S_pool, d_head)
        pooled_v = values.transpose(0, 1)[None].to(q.dtype)  # (1, KV, S_pool, d_head)
        grouped = q.shape[1] != k.shape[1]  # grouped-query attention
        return flex_attention(q, pooled_k, pooled_v, block_mask=self.block_mask, scale=self.scales[layer],
                              enable_gqa=grouped)  # (B, H, 1, d_head)


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
        self.deterministic_bucket = bucket_of(min(config.max_batch, BUCKETS[-1])) if deterministic else None
        self.rope = None if rope is None else rope.short
        self.device = model.embed.tokens.weight.device
        self.refused = pool_refusal("the graph executor", config) or CAPABILITIES.why_not(model.config)
        if self.refused is None and model.config.rope_scaling == "longrope":
            self.refused = "LongRoPE turns a request by one of two sets (the graph executor reads one table)"
        if self.refused is None and self.device.type == "cuda" and model.config.head_dim < FLEX_CUDA_HEAD_DIM:
            self.refused = (f"heads of {model.config.head_dim} dimensions (the graph executor's "
                            f"FlexAttention needs {FLEX_CUDA_HEAD_DIM} on CUDA)")
        # a row's table as wide as the pool, the scratch block last: the mask spans every key it is given
        self.width = pool.n_blocks + 1
        self.block_position = torch.zeros(self.width, dtype=torch.long)  # (blocks,) on the host
        self.block_position_on_device = self.block_position.to(self.device)  # (blocks,)
        self.buffers: dict[int, tuple[torch.Tensor, ...]] = {}
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
        requests, most = batch.requests, BUCKETS[-1]
        hidden = [self._run(requests[i : i + most]) for i in range(0, len(requests), most)]  # (B, d) each
        return Executed(torch.cat(hidden), {})

    def _run(self, requests: tuple[RequestRows, ...]) -> torch.Tensor:
        """The residual streams (B, d) of at most the largest bucket's requests."""
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
        filled = (ids, positions, slots, kv_blocks, kv_indices)
        if rows not in self.buffers:  # the bucket's fixed inputs, on the model's device
            self.buffers[rows] = tuple(torch.empty_like(t, device=self.device) for t in filled)
        fixed = (*self.buffers[rows], self.block_position_on_device)
        for buffer, value in zip(fixed, (*filled, self.block_position), strict=True):
            buffer.copy_(value, non_blocking=True)
        inputs = (*fixed, self.pool.keys, self.pool.values, bs, self.rope)
        if self.device.type == "cuda":  # the buffers stay where the recorded graph reads them
            for tensor in (*fixed, *self.pool.keys, *self.pool.values):
                torch._dynamo.mark_static_address(tensor)
            torch.compiler.cudagraph_mark_step_begin()
            return self.step(self.model, *inputs)[: len(requests)].clone()
        return self.step(self.model, *inputs)[: len(requests)]
