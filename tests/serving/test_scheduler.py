import random

import pytest

from glassformer.serving import EngineConfig
from glassformer.serving.beam import BeamGroup
from glassformer.serving.block_manager import BlockManager
from glassformer.serving.scheduler import Scheduler
from glassformer.serving.sequence import RequestParams, Sequence, Status


def _seq(n_prompt: int, max_new: int = 4) -> Sequence:
    return Sequence(list(range(1, n_prompt + 1)), RequestParams(max_new_tokens=max_new), 1000)


def query_group(block_size: int, token_budget: int) -> int:
    return EngineConfig(block_size=block_size, token_budget=token_budget, max_batch=1).query_group


def _scheduler(blocks: BlockManager, max_batch: int, token_budget: int, attention: str = "reference"):
    """A scheduler over `blocks`; reference attention cuts a prompt anywhere (fast: at its
    query groups)."""
    config = EngineConfig(block_size=blocks.block_size, max_batch=max_batch, token_budget=token_budget,
                          attention=attention)
    return Scheduler(blocks, config)


def _step(sched: Scheduler):
    """One step without a model: schedule, count, append a token to whoever caught up."""
    plan = sched.schedule()
    for seq in sched.advance(plan):
        seq.tokens.append(7)
        if len(seq.generated) >= seq.params.max_new_tokens:
            sched.remove(seq)
    return plan


def test_long_prompts_are_prefilled_in_chunks_while_decodes_keep_flowing():
    sched = _scheduler(BlockManager(64, 4), 4, 8)
    short = _seq(3, max_new=10)
    sched.add(short)
    _step(sched)  # short's prompt
    long = _seq(20)
    sched.add(long)
    chunks = []
    for _ in range(4):
        plan = _step(sched)
        assert plan.n_tokens <= 8
        shares = dict(plan.scheduled)
        assert shares[short] == 1  # one decode token every step
        chunks.append(shares.get(long, 0))
    assert chunks == [7, 7, 6, 1]  # three prompt chunks, then its first decode step


def test_max_batch_and_first_come_first_served():
    sched = _scheduler(BlockManager(64, 4), 2, 64)
    seqs = [_seq(3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    plan = _step(sched)
    assert [s for s, _ in plan.scheduled] == seqs[:2] and list(sched.waiting) == seqs[2:]


def test_the_newest_request_is_preempted_and_recomputed_later():
    bm = BlockManager(6, 2)
    sched = _scheduler(bm, 4, 16)
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
    assert bm.free_count == bm.n_blocks


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_never_deadlocks_or_leaks(seed):
    """Also: where the budget cuts a prompt, it cuts at a multiple of the attention's query
    group; a prompt ends where it ends."""
    rng = random.Random(seed)
    block_size, budget = rng.choice([1, 2, 4, 16]), rng.randint(6, 24)
    bm = BlockManager(rng.randint(8, 20) * max(1, 4 // block_size), block_size)
    align = query_group(block_size, budget)
    sched = _scheduler(bm, rng.randint(1, 6), budget, attention="fast")
    assert sched.align == align
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
    assert bm.free_count == bm.n_blocks and all(b.ref_count == 0 for b in bm.blocks)


def _beams(n_prompt: int, width: int) -> BeamGroup:
    params = RequestParams(max_new_tokens=4, beams=width, eos_ids=())
    root = Sequence(list(range(1, n_prompt + 1)), params, 1000)
    return BeamGroup(root, None, 64)


def _fork(group: BeamGroup, sched: Scheduler) -> None:
    """As the engine does after the group's first ranking: the root's prompt is computed; it
    forks, and each member takes another token."""
    root = group.root
    while len(group.members) < group.ranking.width:
        child = group._fork(root, sched.blocks)
        group.members.append(child)
        sched.adopt(child)
    for token, member in enumerate(group.members, 40):
        member.tokens.append(token)


def test_a_forked_beam_short_of_its_copy_on_write_waits_with_its_group():
    """Beams forked on a full pool: the write into the shared block needs a copy, and no block
    is free; the group (the newest request) is preempted whole and comes back whole."""
    bm = BlockManager(4, 4)
    sched = _scheduler(bm, 4, 16)
    old, group = _seq(7, max_new=1), _beams(6, 2)
    sched.add(old)
    sched.add(group.root)
    sched.advance(sched.schedule())  # both prompts: every block taken
    old.tokens.append(7)
    _fork(group, sched)
    root, child = group.members
    assert not bm.free_count and bm.blocks[root.block_table[1]].ref_count == 2
    plan = sched.schedule()  # old decodes; the root's write would need a copy of block 1
    assert [s for s, _ in plan.scheduled] == [old] and plan.preempted == [root, child]
    assert list(sched.waiting) == [root, child] and sched.running == [old] and not plan.copies
    sched.advance(plan)
    sched.remove(old)
    plan = sched.schedule()  # the group comes back whole, its prompt's full block shared
    assert plan.scheduled == [(root, 3), (child, 3)] and sched.running == [root, child]
    assert root.block_table[0] == child.block_table[0] and root.block_table[1] != child.block_table[1]


def test_a_group_joins_only_when_the_blocks_of_all_its_members_are_free():
    bm = BlockManager(6, 4)
    sched = _scheduler(bm, 8, 64)
    group = _beams(6, 3)
    sched.add(group.root)
    sched.advance(sched.schedule())
    _fork(group, sched)
    members = list(group.members)
    sched._preempt_newest(sched.schedule())  # as if a longer one had needed the room
    assert list(sched.waiting) == members and not sched.running
    holder = _seq(12, max_new=2)
    holder.status = Status.RUNNING
    sched.running.append(holder)
    assert bm.grow(holder, 12) == []  # 3 blocks held; 3 free, one the members' cached first block
    plan = sched.schedule()  # one member's chunk would fit (1 block), the three members' not (3)
    assert plan.scheduled == [(holder, 12)] and not plan.refused
    assert list(sched.waiting) == members and all(not m.block_table for m in members)  # none kept
    sched.advance(plan)
    sched.remove(holder)
    plan = sched.schedule()
    assert plan.scheduled == [(m, 3) for m in members] and sched.running == members


def test_a_group_that_cannot_start_on_an_empty_pool_is_refused_not_spun_on():
    bm = BlockManager(3, 4)
    sched = _scheduler(bm, 4, 16)
    group = _beams(6, 2)
    group.members.append(group._fork(group.root, bm))  # two members of 6 tokens: 4 blocks, 3 in the pool
    for member in group.members:
        member.status = Status.WAITING
        sched.add(member)
    later = _seq(3)
    sched.add(later)
    plan = sched.schedule()
    assert plan.refused == [group.root] and not plan.scheduled and list(sched.waiting) == [later]
    assert [s for s, _ in sched.schedule().scheduled] == [later]
    assert bm.used == 1


def test_the_budget_must_cover_a_full_batch():
    with pytest.raises(ValueError, match="token_budget"):
        _scheduler(BlockManager(4, 4), 8, 4)


def test_the_query_group_divides_the_block_within_the_budget():
    assert [query_group(16, budget) for budget in (256, 16, 12, 8, 7, 1)] == [16, 16, 8, 8, 4, 1]
    assert query_group(1, 256) == 1 and query_group(6, 5) == 3
