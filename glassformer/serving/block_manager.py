"""The paged KV cache's bookkeeping: which block of the pool holds which tokens of which sequence.

The pool holds `n_blocks` blocks of `block_size` token slots. A sequence owns a block table
(its blocks in order: token t lives in block table[t // block_size], slot t % block_size).

- Reference counts: a block may appear in several tables (a shared prefix, forked beams);
  it returns to the free list when its count drops to zero.
- Prefix caching: a full block is keyed by a hash of its tokens chained over the hash of
  every block before it, so equal keys mean equal prefixes (the tokens are checked on a hit).
  A freed block keeps its key until it is reused; the free list is least-recently-freed first,
  so unreferenced cached blocks are evicted in LRU order.
- Blocks come into being when first taken, in order of their ids: a pool of any size costs
  nothing until it is used, and never-used blocks are handed out before freed ones.
- Copy-on-write: before a sequence writes into a block it shares, it gets a private copy.
  Growing counts those copies with the new blocks: it takes every block a step's writes need,
  or none (vLLM's allocate_slots), so a short pool makes a request wait, never fail.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..errors import InputError
from .sequence import Sequence


@dataclass
class Block:
    id: int
    ref_count: int = 0
    key: int | None = None  # prefix hash, once the block is full and registered
    tokens: tuple[int, ...] = ()  # the tokens behind `key`, to confirm a hit


@dataclass
class BlockStats:
    used: int  # referenced by at least one sequence
    free: int  # unreferenced (cached ones included): available for new tokens
    cached: int  # unreferenced but still holding a reusable prefix
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0


def prefix_key(tokens: tuple[int, ...], parent: int | tuple | None) -> int:
    """The key of a full block: its tokens and, through `parent`, every token before them."""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if n_blocks < 1 or block_size < 1:
            raise InputError("blocks",
                             f"need n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size, self.prefix_caching = n_blocks, block_size, prefix_caching
        self.blocks: list[Block] = []  # every block taken so far, by id (the rest never were)
        self.free: OrderedDict[int, None] = OrderedDict()  # taken once, now unreferenced: LRU first
        self.by_key: dict[int, int] = {}  # prefix key -> block id
        self.hit_tokens = 0  # prompt tokens found in the cache (counter)
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def free_count(self) -> int:
        """Blocks available for new tokens: the freed ones and those never taken."""
        return len(self.free) + self.n_blocks - len(self.blocks)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def stats(self) -> BlockStats:
        cached = sum(1 for b in self.free if self.blocks[b].key is not None)
        return BlockStats(self.n_blocks - self.free_count, self.free_count, cached,
                          self.hit_tokens, self.query_tokens)

    def _take(self) -> Block:
        """A free block: one never taken, else the least recently freed, which forgets any
        prefix it held."""
        if len(self.blocks) < self.n_blocks:
            self.blocks.append(Block(len(self.blocks), ref_count=1))
            return self.blocks[-1]
        block = self.blocks[self.free.popitem(last=False)[0]]
        if block.key is not None and self.by_key.get(block.key) == block.id:
            del self.by_key[block.key]
        block.key, block.tokens, block.ref_count = None, (), 1
        return block

    def _ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None  # most recently freed: evicted last

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks yet the cached blocks of its longest cached prefix;
        returns how many of its tokens they hold. At least one token is left to compute (its
        logits are needed), so a fully cached sequence recomputes its last block."""
        assert not seq.block_table and seq.num_computed == 0
        tokens, bs = seq.tokens, self.block_size
        self.query_tokens += len(tokens)
        if not self.prefix_caching:
            return 0
        parent = seq.prefix_root  # blocks computed with another adapter never match
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = prefix_key(chunk, parent)
            block_id = self.by_key.get(key)
            if block_id is None or self.blocks[block_id].tokens != chunk:
                break
            self._ref(self.blocks[block_id])
            seq.block_table.append(block_id)
            seq.block_keys.append(key)
            parent = key
        seq.num_computed = len(seq.block_table) * bs
        self.hit_tokens += seq.num_computed
        return seq.num_computed

    def blocks_needed(self, seq: Sequence, n_tokens: int, first: int | None = None) -> int:
        """The free blocks that holding n_tokens slots takes: the blocks past seq's table, and,
        where slots from `first` on are to be written, a private copy of each shared block they
        fall in (copy-on-write: a forked beam's first write into its parent's last block)."""
        table, end = seq.block_table, self.blocks_for(n_tokens)
        new = max(0, end - len(table))
        if first is None:
            return new
        written = table[first // self.block_size : end]
        return new + sum(1 for b in written if self.blocks[b].ref_count > 1)

    def can_grow(self, seq: Sequence, n_tokens: int, first: int | None = None) -> bool:
        return self.blocks_needed(seq, n_tokens, first) <= self.free_count

    def grow(self, seq: Sequence, n_tokens: int, first: int | None = None) -> list[tuple[int, int]] | None:
        """Extend the block table to hold n_tokens slots and make private every shared block
        that slots from `first` on fall in: the copies made, (source, copy) block ids; None
        (nothing taken) when the free blocks do not suffice for all of it."""
        if not self.can_grow(seq, n_tokens, first):
            return None
        end, copies = self.blocks_for(n_tokens), []
        if first is not None:
            for index in range(first // self.block_size, min(end, len(seq.block_table))):
                copy = self.write_block(seq, index * self.block_size)
                if copy is not None:
                    copies.append(copy)
        while len(seq.block_table) < end:
            seq.block_table.append(self._take().id)
        return copies

    def write_block(self, seq: Sequence, position: int) -> tuple[int, int] | None:
        """Make the block holding `position` private before it is written: (source, copy)
        block ids when it was shared and had to be copied, else None. `grow` with `first`
        counts these copies among the blocks it needs, so the scheduler never gets here short."""
        index = position // self.block_size
        block = self.blocks[seq.block_table[index]]
        if block.ref_count == 1:
            return None
        if not self.free_count:
            raise InputError("blocks", "no free block for a copy-on-write")
        copy = self._take()
        self._unref(block.id)
        seq.block_table[index] = copy.id
        return block.id, copy.id

    def register(self, seq: Sequence) -> None:
        """Key every block of `seq` that its computed tokens have filled, so others reuse it."""
        bs = self.block_size
        while len(seq.block_keys) < min(seq.num_computed, len(seq.block_table) * bs) // bs:
            i = len(seq.block_keys)
            chunk = tuple(seq.tokens[i * bs : (i + 1) * bs])
            key = prefix_key(chunk, seq.block_keys[-1] if seq.block_keys else seq.prefix_root)
            seq.block_keys.append(key)
            block = self.blocks[seq.block_table[i]]
            if self.prefix_caching and block.key is None and key not in self.by_key:
                block.key, block.tokens = key, chunk
                self.by_key[key] = block.id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (beam search, parallel samples)."""
        for block_id in parent.block_table:
            self._ref(self.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.block_keys = list(parent.block_keys)
        child.num_computed = parent.num_computed

    def release(self, seq: Sequence) -> None:
        """Return a sequence's blocks (last first, so its prefix stays cached longest)."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table, seq.block_keys, seq.num_computed = [], [], 0
