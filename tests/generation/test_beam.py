import dataclasses
import itertools

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.generation.beam import Hypothesis, beam_search
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig


def _model(name: str = "tiny-llama", **changes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset(name).replace(init_std=0.3, **changes)).eval()


def _prompt(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _log_prob(model: Transformer, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The oracle: sum of log p(token | everything before it), from one full forward."""
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        log_probs = model(ids)[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # (n, V)
    return log_probs.gather(-1, torch.tensor(continuation)[:, None]).sum()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-alibi"])
def test_width_one_is_greedy(name):
    model, prompt = _model(name), _prompt(6)
    greedy = generate(model, prompt, GenerationConfig(max_new_tokens=12, eos_ids=()))
    eos = greedy.generated_ids[7]
    for eos_ids in ((), (eos,)):
        config = GenerationConfig(max_new_tokens=12, eos_ids=eos_ids, beams=1)
        expected = generate(model, prompt, GenerationConfig(max_new_tokens=12, eos_ids=eos_ids))
        result = beam_search(model, prompt, config)
        assert result.generated_ids == expected.generated_ids
        assert result.stop_reason == expected.stop_reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_beam_is_at_least_as_likely_as_greedy_and_scores_are_exact(seed):
    model, prompt = _model(), _prompt(5, seed)
    greedy = generate(model, prompt, GenerationConfig(max_new_tokens=10, eos_ids=()))
    beam = generate(model, prompt, GenerationConfig(max_new_tokens=10, eos_ids=(), beams=4))
    assert beam.n_generated == 10
    torch.testing.assert_close(torch.tensor(beam.log_prob), _log_prob(model, prompt, beam.generated_ids))
    assert beam.log_prob >= _log_prob(model, prompt, greedy.generated_ids).item() - 1e-5


def test_a_beam_as_wide_as_every_prefix_finds_the_exhaustive_optimum():
    model, prompt = _model(vocab_size=6), _prompt(4, vocab=6)
    beam = generate(model, prompt, GenerationConfig(max_new_tokens=3, eos_ids=(), beams=36))
    continuations = torch.tensor(list(itertools.product(range(6), repeat=3)))  # (216, 3)
    ids = torch.cat((torch.tensor(prompt).expand(len(continuations), -1), continuations), dim=1)
    with torch.no_grad():
        log_probs = model(ids)[:, len(prompt) - 1 : -1].log_softmax(-1)  # (216, 3, V)
    scores = log_probs.gather(-1, continuations[..., None]).sum(dim=(1, 2))  # (216,)
    assert beam.generated_ids == continuations[int(scores.argmax())].tolist()


def test_cached_and_uncached_beam_search_agree():
    model, prompt = _model("tiny-mistral"), _prompt(7)
    config = GenerationConfig(max_new_tokens=10, eos_ids=(), beams=3)
    cached = generate(model, prompt, config)
    uncached = generate(model, prompt, dataclasses.replace(config, use_cache=False))
    assert cached.generated_ids == uncached.generated_ids


def test_finished_beams_end_in_end_of_text():
    model, prompt = _model(), _prompt(5)
    greedy = generate(model, prompt, GenerationConfig(max_new_tokens=6, eos_ids=()))
    eos = greedy.generated_ids[1]
    result = generate(model, prompt, GenerationConfig(max_new_tokens=30, eos_ids=(eos,), beams=3))
    assert result.stop_reason == "eos"
    assert result.generated_ids[-1] == eos and eos not in result.generated_ids[:-1]
    torch.testing.assert_close(torch.tensor(result.log_prob), _log_prob(model, prompt, result.generated_ids))


def test_length_penalty_divides_by_length_to_the_power():
    h = Hypothesis((1, 2, 3, 4), -8.0)
    assert h.score(0.0) == -8.0 and h.score(1.0) == -2.0 and h.score(0.5) == -4.0


def test_sampling_settings_are_refused():
    with pytest.raises(ValueError, match="beams"):
        generate(_model(), [1, 2], GenerationConfig(beams=2, sampling=SamplingConfig(temperature=0.8)))
