import pytest

from glassformer.serving.block_manager import BlockManager
from glassformer.serving.sequence import RequestParams, Sequence


def _seq(tokens) -> Sequence:
    return Sequence(list(tokens), RequestParams(), vocab_size=1000)


def _computed(bm: BlockManager, seq: Sequence, n: int) -> None:
    """As if the engine had computed the first n tokens of seq."""
    assert bm.grow(seq, n) is not None
    seq.num_computed = n
    bm.register(seq)


def _whole(bm: BlockManager) -> None:
    assert bm.free_count == bm.n_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_grow_and_release_return_every_block():
    bm = BlockManager(8, 4)
    seq = _seq(range(10))
    assert bm.grow(seq, 10) == [] and len(seq.block_table) == 3
    assert bm.grow(_seq(range(30)), 30) is None  # 8 blocks needed, 5 free: nothing taken
    assert bm.used == 3 and bm.free_count == 5
    bm.release(seq)
    _whole(bm)


def test_a_shared_prefix_reuses_full_blocks_only():
    bm = BlockManager(16, 4)
    first = _seq(range(10))
    _computed(bm, first, 10)  # blocks [0..4) [4..8) full, [8..10) partial
    second = _seq([*range(9), 99, 98])
    assert bm.match_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    other = _seq([1, *range(1, 12)])  # differs in the first block: no hit
    assert bm.match_prefix(other) == 0 and other.block_table == []
    for s in (first, second, other):
        bm.release(s)
    _whole(bm)
    assert bm.cached == 2
    assert bm.hit_tokens == 8


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, 4)
    first = _seq(range(8))
    _computed(bm, first, 8)
    again = _seq(range(8))
    assert bm.match_prefix(again) == 4  # the last block is recomputed for the logits
    bm.release(first)
    bm.release(again)
    _whole(bm)


def test_a_hit_checks_the_tokens_not_just_the_key():
    bm = BlockManager(8, 4)
    first = _seq(range(8))
    _computed(bm, first, 8)
    bm.blocks[first.block_table[0]].tokens = (7, 7, 7, 7)  # as if two prefixes shared a key
    assert bm.match_prefix(_seq(range(9))) == 0


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(4, 2)
    old, new = _seq([1, 2, 3]), _seq([5, 6, 7])
    _computed(bm, old, 2)
    _computed(bm, new, 2)
    bm.release(old)
    bm.release(new)
    assert bm.cached == 2
    taker = _seq(range(6))
    assert bm.grow(taker, 6) is not None  # three blocks: the two never used, then old's
    assert bm.match_prefix(_seq([1, 2, 3])) == 0  # evicted
    probe = _seq([5, 6, 7])
    assert bm.match_prefix(probe) == 2  # still cached
    bm.release(taker)
    bm.release(probe)
    _whole(bm)


def test_fork_shares_blocks_and_a_write_copies_the_shared_one():
    bm = BlockManager(8, 4)
    parent = _seq(range(6))
    _computed(bm, parent, 6)
    child = _seq(range(6))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    source = parent.block_table[1]
    copies = bm.grow(child, 7, first=6)  # position 6 is in the shared partial block
    assert copies == [(source, child.block_table[1])] and child.block_table[1] != source
    assert child.block_table[0] == parent.block_table[0]  # the full block before stays shared
    assert bm.blocks[source].ref_count == 1 and bm.grow(parent, 7, first=6) == []
    bm.release(parent)
    bm.release(child)
    _whole(bm)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 2, prefix_caching=False)
    first = _seq(range(6))
    _computed(bm, first, 6)
    assert bm.match_prefix(_seq(range(6))) == 0 and bm.cached == 0


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_growing_counts_the_copy_a_write_into_a_shared_block_needs():
    bm = BlockManager(4, 4)
    parent = _seq(range(6))
    _computed(bm, parent, 6)  # blocks [0..4) full, [4..6) partial
    child = _seq(range(6))
    bm.fork(parent, child)
    assert bm.grow(_seq(range(4)), 4) == []  # one block left free
    assert bm.blocks_needed(child, 9) == 1 <= bm.free_count  # without its writes
    assert bm.blocks_needed(child, 9, first=6) == 2  # a new block and a copy of the shared one
    before = (list(child.block_table), [b.ref_count for b in bm.blocks], list(bm.free), bm.free_count)
    assert bm.grow(child, 9, first=6) is None
    assert (child.block_table, [b.ref_count for b in bm.blocks], list(bm.free), bm.free_count) == before
    source = child.block_table[1]
    assert bm.blocks_needed(child, 8, first=6) == 1
    assert bm.grow(child, 8, first=6) == [(source, child.block_table[1])] != [(source, source)]
    assert bm.blocks[source].ref_count == 1 and not bm.free_count
    assert bm.blocks_needed(parent, 8, first=6) == 0  # the copy made parent's block private
    assert bm.grow(parent, 8, first=6) == []


def test_a_write_past_the_shared_blocks_copies_nothing():
    bm = BlockManager(8, 4)
    parent = _seq(range(8))
    _computed(bm, parent, 8)  # two full blocks
    child = _seq(range(8))
    bm.fork(parent, child)
    assert bm.blocks_needed(child, 9, first=8) == 1  # only the new block
    assert bm.grow(child, 9, first=8) == [] and child.block_table[:2] == parent.block_table
    bm.release(parent)
    bm.release(child)
    _whole(bm)
