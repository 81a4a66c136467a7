"""The decode core: every loop (generate, stream, a batch row, beam search, chat) continues a
prompt the same way, and a seeded row of a batch draws what its prompt alone would."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.generation.beam import beam_search
from glassformer.generation.chat import ChatSession
from glassformer.generation.core import SamplingState, seeded_generators
from glassformer.generation.generate import GenerationConfig, generate, generate_batch, stream
from glassformer.generation.sampling import SamplingConfig


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset("tiny-llama").replace(init_std=0.3)).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _naive_greedy(model: Transformer, prompt: list[int], n: int, eos: int) -> list[int]:
    """The oracle: the argmax of a full forward over everything so far, until end-of-text."""
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < n and ids[-1] != eos:
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_every_loop_continues_a_chat_prompt_identically(chat_model):
    model, tokenizer = chat_model
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}],
                                        add_generation_prompt=True)
    config = GenerationConfig(max_new_tokens=10)
    alone = generate(model, ids, config, tokenizer)
    run = stream(model, ids, config, tokenizer)
    pieces = list(run)
    others = [ids[:5], ids + ids[2:9]]  # shorter and longer: the row is left-padded
    row = generate_batch(model, [others[0], ids, others[1]], config, tokenizer)[1]
    beam = beam_search(model, ids, dataclasses.replace(config, beams=1), tokenizer)
    chat = "".join(ChatSession(model, tokenizer, max_new_tokens=10).reply("hello there"))

    assert alone.generated_ids == _naive_greedy(model, ids, 10, tokenizer.eos_id)
    assert [p.token_id for p in pieces] == run.result.generated_ids == alone.generated_ids
    assert row.generated_ids == beam.generated_ids == alone.generated_ids
    assert "".join(p.text for p in pieces) == row.text == beam.text == chat == alone.text
    assert alone.text and row.stop_reason == beam.stop_reason == alone.stop_reason


SAMPLINGS = [
    SamplingConfig(temperature=1.2),
    SamplingConfig(temperature=1.0, top_p=0.9, presence_penalty=0.5),
    SamplingConfig(temperature=0.8, top_k=5, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.2),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_seeded_row_of_a_batch_draws_what_its_prompt_alone_would(sampling):
    model = _model()
    prompts = [_prompt(11, 1), _prompt(3, 2), _prompt(7, 3)]
    config = GenerationConfig(max_new_tokens=12, sampling=sampling, seed=5, eos_ids=())
    early = generate(model, prompts[1], config).generated_ids[3]
    config = dataclasses.replace(config, eos_ids=(early,))  # row 1 leaves the batch early
    batched = generate_batch(model, prompts, config)
    alone = [generate(model, p, config) for p in prompts]
    assert [r.generated_ids for r in batched] == [r.generated_ids for r in alone]
    assert batched[1].stop_reason == "eos" and len(batched[1].generated_ids) <= 4
    assert max(len(r.generated_ids) for r in batched) == 12
    other_seed = generate(model, prompts[0], dataclasses.replace(config, seed=6))
    assert other_seed.generated_ids != alone[0].generated_ids  # the seed matters


def test_sampling_state_counts_each_row_and_keeps_its_generator_when_rows_leave():
    sampling = SamplingConfig(temperature=1.0, presence_penalty=1.0)
    contexts = [[1, 2, 2], [3]]
    state = SamplingState(sampling, contexts, 6, seeded_generators(0, 2, torch.device("cpu")))
    expected = torch.tensor([[0, 1, 2, 0, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.float)
    torch.testing.assert_close(state.counts, expected)
    logits = torch.zeros(2, 6)
    tokens = state.pick(logits)  # (2,)
    expected[0, tokens[0]] += 1
    expected[1, tokens[1]] += 1
    torch.testing.assert_close(state.counts, expected)
    state.keep(torch.tensor([1]))
    torch.testing.assert_close(state.counts, expected[1:])
    alone = SamplingState(sampling, contexts[1:], 6, seeded_generators(0, 1, torch.device("cpu")))
    alone.pick(logits[1:])
    # the kept row's generator has drawn once, like the generator of the row alone
    assert torch.equal(state.generators[0].get_state(), alone.generators[0].get_state())

