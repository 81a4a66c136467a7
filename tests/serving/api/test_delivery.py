"""The engine's hand-off to an asyncio reader (the server's): one wake-up of the event loop per
step for all its requests, and every event queued by the time a reader wakes taken at once,
in order."""

import asyncio

from glassformer.generation.generate import GenerationConfig, generate
from glassformer.serving import Engine, EngineConfig, RequestParams

NEW = 6


def expected(model, todo):
    return [generate(model, p, GenerationConfig(max_new_tokens=NEW, eos_ids=())).generated_ids for p in todo]


async def read_all(handle, batches):
    async for batch in handle.batches():
        batches.append(batch)


def wakeups_counted(loop) -> list:
    """Wraps the loop's call_soon_threadsafe; the list gets each wake-up of a reader."""
    calls, original = [], loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        if getattr(callback, "__name__", "") in ("_set_all", "set"):  # a reader's wake-up
            calls.append(callback)
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted
    return calls


def test_a_step_wakes_the_loop_once_for_all_its_requests(tiny, prompts):
    model = tiny()
    todo = prompts([3, 9, 5])
    engine = Engine(model, None, EngineConfig(n_blocks=64))  # stepped here, by hand

    async def main():
        calls = wakeups_counted(asyncio.get_running_loop())
        handles = [engine.submit(p, RequestParams(max_new_tokens=NEW, eos_ids=())) for p in todo]
        batches = [[] for _ in todo]
        readers = [asyncio.create_task(read_all(h, b)) for h, b in zip(handles, batches, strict=True)]
        await asyncio.sleep(0)  # each reader waits for its first event
        per_step = []
        while engine.has_work():
            before = len(calls)
            engine.step()
            per_step.append(len(calls) - before)
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*readers), 30)
        return per_step, batches

    per_step, batches = asyncio.run(main())
    assert per_step == [1] * NEW  # three requests, one wake-up each step
    for got in batches:  # a reader that keeps up gets one event per step
        assert [len(batch) for batch in got] == [1] * NEW
    assert [[e.token_id for b in got for e in b] for got in batches] == expected(model, todo)


def test_events_queued_before_a_reader_wakes_come_in_one_batch_in_order(tiny, prompts):
    model = tiny()
    todo = prompts([4, 7])
    engine = Engine(model, None, EngineConfig(n_blocks=64))

    async def main():
        handles = [engine.submit(p, RequestParams(max_new_tokens=NEW, eos_ids=())) for p in todo]
        batches = [[] for _ in todo]
        readers = [asyncio.create_task(read_all(h, b)) for h, b in zip(handles, batches, strict=True)]
        await asyncio.sleep(0)
        for _ in range(4):  # the loop does not run between these steps
            engine.step()
        await asyncio.sleep(0.05)
        first = [list(b) for b in batches]
        engine.run_until_done()
        await asyncio.wait_for(asyncio.gather(*readers), 30)
        return first, batches

    first, batches = asyncio.run(main())
    assert [[len(batch) for batch in got] for got in first] == [[4], [4]]
    tokens = [[e.token_id for b in got for e in b] for got in batches]
    assert tokens == expected(model, todo)
    for got in batches:
        events = [e for b in got for e in b]
        assert events[-1].finished and not any(e.finished for e in events[:-1])
