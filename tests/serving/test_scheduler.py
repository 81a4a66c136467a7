import random

import pytest

from glassformer.serving.block_manager import BlockManager
from glassformer.serving.paged_attention import query_group
from glassformer.serving.scheduler import Scheduler
from glassformer.serving.sequence import RequestParams, Sequence


def _seq(n_prompt: int, max_new: int = 4) -> Sequence:
    return Sequence(list(range(1, n_prompt + 1)), RequestParams(max_new_tokens=max_new), 1000)


def _step(sched: Scheduler):
    """One step without a model: schedule, count, append a token to whoever caught up."""
    plan = sched.schedule()
    for seq in sched.advance(plan):
        seq.tokens.append(7)
        if len(seq.generated) >= seq.params.max_new_tokens:
            sched.remove(seq)
    return plan


def test_long_prompts_are_prefilled_in_chunks_while_decodes_keep_flowing():
    sched = Scheduler(BlockManager(64, 4), max_batch=4, token_budget=8)
    short = _seq(3, max_new=10)
    sched.add(short)
    _step(sched)  # short's prompt
    long = _seq(20)
    sched.add(long)
    chunks = []
    for _ in range(4):
        plan = _step(sched)
        assert plan.n_tokens <= 8
        shares = dict((s.id, n) for s, n in plan.scheduled)
        assert shares[short.id] == 1  # one decode token every step
        chunks.append(shares.get(long.id, 0))
    assert chunks == [7, 7, 6, 1]  # three prompt chunks, then its first decode step


def test_max_batch_and_first_come_first_served():
    sched = Scheduler(BlockManager(64, 4), max_batch=2, token_budget=64)
    seqs = [_seq(3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    plan = _step(sched)
    assert [s for s, _ in plan.scheduled] == seqs[:2] and list(sched.waiting) == seqs[2:]


def test_the_newest_request_is_preempted_and_recomputed_later():
    bm = BlockManager(6, 2)
    sched = Scheduler(bm, max_batch=4, token_budget=16)
    old, new = _seq(4, max_new=6), _seq(4, max_new=6)
    sched.add(old)
    sched.add(new)
    _step(sched)  # both prompts: 4 blocks of 6
    preempted = []
    for _ in range(40):
        if not sched.has_work():
            break
        preempted += _step(sched).preempted
    assert preempted and preempted[0] is new and new.preemptions >= 1 and old.preemptions == 0
    assert len(old.generated) == len(new.generated) == 6
    assert len(bm.free) == bm.n_blocks


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_never_deadlocks_or_leaks(seed):
    """Also: where the budget cuts a prompt, it cuts at a multiple of the attention's query
    group; a prompt ends where it ends."""
    rng = random.Random(seed)
    block_size, budget = rng.choice([1, 2, 4, 16]), rng.randint(6, 24)
    bm = BlockManager(rng.randint(8, 20) * max(1, 4 // block_size), block_size)
    align = query_group(block_size, budget)
    sched = Scheduler(bm, max_batch=rng.randint(1, 6), token_budget=budget, align=align)
    seqs = []
    for _ in range(2000):
        if len(seqs) < 12 and rng.random() < 0.3:
            s = _seq(rng.randint(1, 30), max_new=rng.randint(1, 5))
            seqs.append(s)
            sched.add(s)
        if rng.random() < 0.05 and sched.running:
            sched.remove(rng.choice(sched.running))  # a cancel
        for seq, n in _step(sched).scheduled:
            end = seq.num_computed  # advanced by the step
            assert n > 0 and (end % align == 0 or end >= seq.prompt_len)
        if len(seqs) == 12 and not sched.has_work():
            break
    assert not sched.has_work(), "requests left behind"
    assert len(bm.free) == bm.n_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_the_budget_must_cover_a_full_batch():
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(BlockManager(4, 4), max_batch=8, token_budget=4)
    with pytest.raises(ValueError, match="align"):
        Scheduler(BlockManager(4, 4), max_batch=2, token_budget=4, align=8)


def test_the_query_group_divides_the_block_within_the_budget():
    assert [query_group(16, budget) for budget in (256, 16, 12, 8, 7, 1)] == [16, 16, 8, 8, 4, 1]
    assert query_group(1, 256) == 1 and query_group(6, 5) == 3
