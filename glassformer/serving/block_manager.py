"""The paged KV cache's bookkeeping: which block of the pool holds which tokens of which sequence
(token t of a block table lives in block table[t // block_size], slot t % block_size).

A block may sit in several tables (a shared prefix, forked beams) and is free again when its
reference count drops to zero; a write into a shared block goes into a private copy. A full
block is keyed by a hash of its tokens chained over every block before it (its tokens checked
on a hit); a freed block keeps its key until reused, least recently freed first (LRU). A block
comes into being when first taken, in order of ids: a pool costs nothing unused.
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

    @property
    def used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.n_blocks - self.free_count

    @property
    def cached(self) -> int:
        """Unreferenced blocks that still hold a reusable prefix."""
        return sum(1 for b in self.free if self.blocks[b].key is not None)

    def _keyed(self, seq: Sequence, i: int) -> tuple[tuple[int, ...], int]:
        """The tokens of seq's full block i and its prefix key: a hash of them chained over the
        key of the block before (the first's parent: seq.prefix_root, its adapter's)."""
        chunk = tuple(seq.tokens[i * self.block_size : (i + 1) * self.block_size])
        return chunk, hash((seq.block_keys[i - 1] if i else seq.prefix_root, chunk))

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
        self.query_tokens += seq.num_tokens
        if not self.prefix_caching:
            return 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            chunk, key = self._keyed(seq, i)
            block_id = self.by_key.get(key)
            if block_id is None or self.blocks[block_id].tokens != chunk:
                break
            self._ref(self.blocks[block_id])
            seq.block_table.append(block_id)
            seq.block_keys.append(key)
        seq.num_computed = len(seq.block_table) * self.block_size
        self.hit_tokens += seq.num_computed
        return seq.num_computed

    def _shared_written(self, seq: Sequence, n_tokens: int, first: int | None) -> list[int]:
        """Where in seq's table the shared blocks are that slots first .. n_tokens - 1 fall in
        (none when `first` is None): each is copied before it is written (copy-on-write)."""
        if first is None:
            return []
        end, table = min(self.blocks_for(n_tokens), len(seq.block_table)), seq.block_table
        return [i for i in range(first // self.block_size, end) if self.blocks[table[i]].ref_count > 1]

    def blocks_needed(self, seq: Sequence, n_tokens: int, first: int | None = None) -> int:
        """The free blocks that holding n_tokens slots takes: the blocks past seq's table, and a
        copy of each shared block that slots from `first` on fall in (a forked beam's first
        write into its parent's last block)."""
        new = max(0, self.blocks_for(n_tokens) - len(seq.block_table))
        return new + len(self._shared_written(seq, n_tokens, first))

    def grow(self, seq: Sequence, n_tokens: int, first: int | None = None) -> list[tuple[int, int]] | None:
        """Extend the block table to hold n_tokens slots, with a private copy of each shared block
        that slots from `first` on fall in: the copies, (source, copy) block ids; None (nothing
        taken) when the free blocks do not suffice for all of it (the request waits)."""
        if self.blocks_needed(seq, n_tokens, first) > self.free_count:
            return None
        copies = []
        for index in self._shared_written(seq, n_tokens, first):
            source, copy = seq.block_table[index], self._take().id
            self._unref(source)  # still held by the others
            seq.block_table[index] = copy
            copies.append((source, copy))
        while len(seq.block_table) < self.blocks_for(n_tokens):
            seq.block_table.append(self._take().id)
        return copies

    def register(self, seq: Sequence) -> None:
        """Key every block of `seq` that its computed tokens have filled, so others reuse it."""
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_keys), full):
            chunk, key = self._keyed(seq, i)
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
