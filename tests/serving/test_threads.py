"""The engine on its own thread: streaming to threads and to asyncio, cancels, text and stops."""

import asyncio
import threading

import pytest

from glassformer.formats.tokenizers import CharTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.serving import Engine, EngineConfig, RequestParams
from glassformer.serving.errors import EngineStopped

TIMEOUT = 30


def test_streams_from_several_threads_equal_generate(tiny, prompts):
    model = tiny()
    todo = prompts([4, 11, 7])
    expected = [generate(model, p, GenerationConfig(max_new_tokens=10, eos_ids=())).generated_ids
                for p in todo]
    got = [None] * len(todo)
    with Engine(model, None, EngineConfig(n_blocks=64)) as engine:

        def consume(i):
            handle = engine.submit(todo[i], RequestParams(max_new_tokens=10, eos_ids=()))
            got[i] = [event.token_id for event in handle]

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(todo))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads)
    assert got == expected


def test_asyncio_consumers_stream_concurrently(tiny, prompts):
    model = tiny()
    todo = prompts([3, 9])

    async def main(engine):
        async def collect(prompt):
            handle = engine.submit(prompt, RequestParams(max_new_tokens=6, eos_ids=()))
            return [event async for event in handle]

        return await asyncio.wait_for(asyncio.gather(*(collect(p) for p in todo)), TIMEOUT)

    with Engine(model, None, EngineConfig(n_blocks=64)) as engine:
        results = asyncio.run(main(engine))
    for events in results:
        assert len(events) == 6 and events[-1].finished and not any(e.finished for e in events[:-1])
        assert events[-1].stop_reason == "max_new_tokens"


def test_cancel_stops_a_stream_and_frees_its_blocks(tiny, prompts):
    model = tiny()
    with Engine(model, None, EngineConfig(n_blocks=64)) as engine:
        handle = engine.submit(prompts([5])[0], RequestParams(max_new_tokens=50, eos_ids=()))
        first = handle.get(TIMEOUT)
        assert first.token_id is not None
        handle.cancel()
        events = [first, *handle]
        assert events[-1].finished and events[-1].stop_reason == "cancelled"
        assert handle.wait(TIMEOUT).stop_reason == "cancelled"
        assert len(events) < 50
    assert engine.blocks.used == 0 and engine.blocks.free_count == engine.blocks.n_blocks


def test_close_cancels_what_is_left_and_the_thread_ends(tiny, prompts):
    engine = Engine(tiny(), None, EngineConfig(n_blocks=64)).start()
    handle = engine.submit(prompts([5])[0], RequestParams(max_new_tokens=60, eos_ids=()))
    handle.get(TIMEOUT)
    engine.close()
    assert handle.wait(TIMEOUT).stop_reason in ("cancelled", "max_new_tokens", "context_full")
    assert engine._thread is None


def test_text_pieces_and_stop_strings_match_generate(tiny):
    tokenizer = CharTokenizer("abcdefghij klmnopqrstuvwxyz.")
    model = tiny(vocab_size=tokenizer.vocab_size)
    prompt = tokenizer.encode("the cat sat")
    reference = generate(model, prompt, GenerationConfig(max_new_tokens=20, eos_ids=()), tokenizer)
    stop = reference.text[5:7]
    expected = generate(model, prompt, GenerationConfig(max_new_tokens=20, eos_ids=(), stop=(stop,)),
                        tokenizer)
    engine = Engine(model, tokenizer, EngineConfig(n_blocks=64))
    handle = engine.submit(prompt, RequestParams(max_new_tokens=20, eos_ids=(), stop=(stop,)))
    engine.run_until_done()
    events = list(handle)
    result = handle.wait(0)
    assert "".join(e.text for e in events) == result.text == expected.text
    assert result.stop_reason == expected.stop_reason == "stop_string"
    assert result.generated_ids == expected.generated_ids


def test_a_failing_step_ends_every_stream(tiny, prompts):
    engine = Engine(tiny(), None, EngineConfig(n_blocks=64))

    def broken(plan):
        raise RuntimeError("boom")

    engine.runner.run = broken
    with engine:
        handle = engine.submit(prompts([5])[0])
        assert handle.wait(TIMEOUT).stop_reason == "cancelled"
    with pytest.raises(RuntimeError, match="boom"):
        engine.raise_error()
    with pytest.raises(EngineStopped, match="stopped after an error"):
        engine.submit(prompts([5])[0])
