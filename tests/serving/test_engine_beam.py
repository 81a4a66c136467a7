"""Beam search as forked sequences sharing blocks, against generation/beam.py (the oracle)."""

import pytest
import torch

from glassformer.errors import InputError
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig
from glassformer.serving import Engine, EngineConfig, RequestParams


def _assert_as_generate(model, prompts, handles, expected, plain):
    """Each beam request's result is generate's beam search's; the plain request (prompt
    prompts([5], seed=9)) is its greedy generate."""
    for handle, want in zip(handles, expected, strict=True):
        got = handle.wait(0)
        assert got.generated_ids == want.generated_ids and got.stop_reason == want.stop_reason
        assert got.log_prob == pytest.approx(want.log_prob, abs=1e-4)
    solo = generate(model, prompts([5], seed=9)[0], GenerationConfig(max_new_tokens=8, eos_ids=()))
    assert plain.wait(0).generated_ids == solo.generated_ids


@pytest.mark.parametrize("beams", [2, 3])
@pytest.mark.parametrize("block_size", [1, 4])
def test_beam_search_equals_generate_and_leaks_nothing(tiny, prompts, beams, block_size):
    model = tiny()
    todo = prompts([6, 13])
    expected = [generate(model, p, GenerationConfig(max_new_tokens=8, beams=beams, eos_ids=(3,)))
                for p in todo]
    engine = Engine(model, None, EngineConfig(n_blocks=80, block_size=block_size, token_budget=32,
                                              max_batch=8))
    params = RequestParams(max_new_tokens=8, beams=beams, eos_ids=(3,))
    handles = [engine.submit(p, params) for p in todo]
    other = engine.submit(prompts([5], seed=9)[0], RequestParams(max_new_tokens=8, eos_ids=()))
    engine.run_until_done()
    _assert_as_generate(model, prompts, handles, expected, other)
    assert engine.blocks.used == 0 and engine.blocks.free_count == engine.blocks.n_blocks


def test_beams_share_the_prompt_blocks(tiny, prompts):
    engine = Engine(tiny(), None, EngineConfig(n_blocks=40, block_size=4))
    engine.submit(prompts([16])[0], RequestParams(max_new_tokens=6, beams=3, eos_ids=()))
    engine.step()  # the prompt
    engine.step()  # three beams, forked
    members = engine.scheduler.running
    assert len(members) == 3
    assert members[0].block_table[:4] == members[1].block_table[:4] == members[2].block_table[:4]
    assert engine.blocks.blocks[members[0].block_table[0]].ref_count == 3
    engine.run_until_done()
    assert engine.blocks.used == 0


def test_beam_text_and_cancel(tiny):
    tokenizer = CharTokenizer("abcdefghij klmnopqrstuvwxyz.")
    model = tiny(vocab_size=tokenizer.vocab_size)
    prompt = tokenizer.encode("the cat")
    want = generate(model, prompt, GenerationConfig(max_new_tokens=6, beams=2, eos_ids=()), tokenizer)
    engine = Engine(model, tokenizer, EngineConfig(n_blocks=40))
    handle = engine.submit(prompt, RequestParams(max_new_tokens=6, beams=2, eos_ids=()))
    engine.run_until_done()
    events = list(handle)
    assert len(events) == 1 and events[0].text == want.text == handle.wait(0).text
    cancelled = engine.submit(prompt, RequestParams(max_new_tokens=6, beams=2, eos_ids=()))
    engine.step()
    engine.step()
    cancelled.cancel()
    engine.run_until_done()
    assert cancelled.wait(0).stop_reason == "cancelled" and engine.blocks.used == 0
    with pytest.raises(ValueError, match="beams"):
        RequestParams(beams=2, sampling=SamplingConfig(temperature=1.0))


class CountingTokenizer(CharTokenizer):
    """Remembers the longest run of ids it was asked to decode."""

    longest = 0

    def decode(self, ids):
        self.longest = max(self.longest, len(ids))
        return super().decode(ids)


def test_beam_stop_strings_follow_the_text_token_by_token(tiny):
    tokenizer = CountingTokenizer("abcdefghij klmnopqrstuvwxyz.")
    model = tiny(vocab_size=tokenizer.vocab_size)
    prompt = tokenizer.encode("the cat")
    free = generate(model, prompt, GenerationConfig(max_new_tokens=14, beams=3, eos_ids=()), tokenizer)
    stop = (free.text[5:7],)  # appears in the unconstrained winner: some beam meets it
    config = GenerationConfig(max_new_tokens=14, beams=3, eos_ids=(), stop=stop)
    want = generate(model, prompt, config, tokenizer)
    engine = Engine(model, tokenizer, EngineConfig(n_blocks=60))
    tokenizer.longest = 0
    handle = engine.submit(prompt, RequestParams(max_new_tokens=14, beams=3, eos_ids=(), stop=stop))
    engine.run_until_done()
    got = handle.wait(0)
    assert want.stop_reason == "stop_string"
    assert (got.generated_ids, got.text, got.stop_reason) == (want.generated_ids, want.text, want.stop_reason)
    assert tokenizer.longest <= 6  # windows of a few ids, never a candidate's whole text


@pytest.mark.parametrize("block_size", [1, 2])
def test_beams_on_a_pool_with_few_free_blocks_wait_their_turn_and_equal_generate(tiny, prompts, block_size):
    """Every fork's first write needs a copy of the shared block, on a pool just larger than
    the largest request: groups wait or are preempted whole, and each search's result is still
    generate's."""
    model = tiny()
    todo, widths = prompts([6, 9, 5, 7, 4], seed=3), [4, 2, 3, 4, 2]
    want = [generate(model, p, GenerationConfig(max_new_tokens=8, beams=w, eos_ids=(3,)))
            for p, w in zip(todo, widths, strict=True)]
    largest = max(-(-(len(p) + 8) // block_size) * w for p, w in zip(todo, widths, strict=True))
    engine = Engine(model, None, EngineConfig(n_blocks=largest + 2, block_size=block_size, token_budget=32,
                                              max_batch=8))
    plain = engine.submit(prompts([5], seed=9)[0], RequestParams(max_new_tokens=8, eos_ids=()))
    handles = [engine.submit(p, RequestParams(max_new_tokens=8, beams=w, eos_ids=(3,)))
               for p, w in zip(todo, widths, strict=True)]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 300, "the engine stopped making progress"
    assert engine.scheduler.preemptions > 0  # the pool was short: groups had to give way
    _assert_as_generate(model, prompts, handles, want, plain)
    assert engine.blocks.used == 0


def test_best_beams_are_the_ranked_beams_with_their_exact_log_probs(tiny, prompts):
    """With best_beams, the result's runners-up follow the winner, each beam's summed
    log-probability the model's own over its tokens (one full forward), best first."""
    model, prompt = tiny(), prompts([7])[0]
    engine = Engine(model, None, EngineConfig(n_blocks=80, max_batch=8))
    handle = engine.submit(prompt, RequestParams(max_new_tokens=5, beams=4, best_beams=3, eos_ids=()))
    engine.run_until_done()
    result = handle.wait(0)
    want = generate(model, prompt, GenerationConfig(max_new_tokens=5, beams=4, eos_ids=()))
    beams = [result, *result.runners_up]
    assert len(beams) == 3 and result.generated_ids == want.generated_ids
    assert len({tuple(b.generated_ids) for b in beams}) == 3
    for beam in beams:
        ids = torch.tensor([prompt + beam.generated_ids])
        with torch.no_grad():
            rows = model(ids)[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # (5, V)
        oracle = rows.gather(-1, torch.tensor(beam.generated_ids)[:, None]).sum()
        assert beam.log_prob == pytest.approx(float(oracle), abs=1e-4)
    assert [b.log_prob for b in beams] == sorted((b.log_prob for b in beams), reverse=True)
    with pytest.raises(InputError, match="best_beams"):
        RequestParams(beams=2, best_beams=3)
