"""Encoder-decoder generation on tiny random T5 models: greedy and beam search token for token
equal to transformers' `generate` (the oracle), cached equal to uncached decoding."""

from __future__ import annotations

import pytest
import torch

from glassformer.formats.huggingface import load_hf_model
from glassformer.generation.generate import GenerationConfig, generate, generate_batch, stream
from glassformer.generation.sampling import SamplingConfig

transformers = pytest.importorskip("transformers")
from t5_folders import VERSIONS, VOCAB, save_t5  # noqa: E402  (tests/ is on the path)

SOURCES = [[5, 17, 33, 8, 40, 12, 9, 3], [44, 2, 61, 7]]


@pytest.fixture(scope="module", params=list(VERSIONS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    reference = save_t5(request.param, folder)
    return reference, load_hf_model(folder)


def hf_generate(reference, source: list[int], n: int, beams: int = 1) -> list[int]:
    ids = torch.tensor([source])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, num_beams=beams, decoder_start_token_id=0,
                                 eos_token_id=1, pad_token_id=0, length_penalty=1.0,
                                 early_stopping=False,
                                 use_cache=False)  # its cache assumes as many decoder layers as encoder
    return [t for t in out[0, 1:].tolist()]  # after the start token


def trim(ids: list[int]) -> list[int]:
    """transformers pads a finished beam's row; ours ends at the end-of-text token."""
    return ids[: ids.index(1) + 1] if 1 in ids else ids


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_equals_transformers(pair, source):
    reference, model = pair
    ours = generate(model, source, GenerationConfig(max_new_tokens=12, eos_ids=(1,)))
    assert ours.generated_ids == trim(hf_generate(reference, source, 12))
    assert ours.prompt_ids == source


@pytest.mark.parametrize("source", SOURCES)
def test_beam_search_equals_transformers(pair, source):
    reference, model = pair
    ours = generate(model, source, GenerationConfig(max_new_tokens=10, eos_ids=(1,), beams=3))
    assert ours.generated_ids == trim(hf_generate(reference, source, 10, beams=3))


@pytest.mark.parametrize("beams", [1, 3])
def test_cached_equals_uncached(pair, beams):
    _, model = pair
    for source in SOURCES:
        cached = generate(model, source, GenerationConfig(max_new_tokens=10, eos_ids=(), beams=beams))
        uncached = generate(model, source, GenerationConfig(max_new_tokens=10, eos_ids=(), beams=beams,
                                                            use_cache=False))
        assert cached.generated_ids == uncached.generated_ids
        assert len(cached.generated_ids) == 10


def test_sampling_is_seeded_and_cache_independent(pair):
    _, model = pair
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    runs = [generate(model, SOURCES[0], GenerationConfig(max_new_tokens=8, eos_ids=(), sampling=sampling,
                                                         seed=7, use_cache=cache)).generated_ids
            for cache in (True, True, False)]
    assert runs[0] == runs[1] == runs[2]
    assert all(0 <= t < VOCAB for t in runs[0])


def test_stream_and_batch_give_the_same_tokens(pair):
    _, model = pair
    config = GenerationConfig(max_new_tokens=6, eos_ids=())
    run = stream(model, SOURCES[1], config)
    pieces = [p.token_id for p in run]
    batch = generate_batch(model, SOURCES, config)
    assert pieces == run.result.generated_ids == batch[1].generated_ids
    assert batch[0].generated_ids == generate(model, SOURCES[0], config).generated_ids


def test_empty_source_is_refused(pair):
    _, model = pair
    with pytest.raises(ValueError, match="prompt: empty"):
        generate(model, [], GenerationConfig(max_new_tokens=2))
