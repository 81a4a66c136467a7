"""A chunk past the sink cache's window (model/sink_chunk.py) against streaming, one token a
call, on a deep model: every logit of the text and every key left in the cache."""

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.accel.quantize import quantize_model
from glassformer.generation.config import GenerationConfig
from glassformer.generation.generate import generate
from glassformer.model.sink import SinkKVCache, SinkPolicy


def _model(position="rope", **extra):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, context_length=64, d_model=32, n_layers=3, n_heads=4,
                         n_kv_heads=2, position=position, norm="rmsnorm", activation="silu",
                         gated=True, **extra)
    return Transformer(config).eval()


def _read(model, ids, policy, chunk):
    """Logits of every token of ids (1, n) fed as the cache's room allows, and the cache."""
    policy = SinkPolicy(policy.sink_tokens, policy.window, chunk)
    cache = SinkKVCache(model.config, 1, policy)
    logits, start, sizes = [], 0, []
    with torch.no_grad():
        while start < ids.shape[1]:
            end = min(start + cache.room(), ids.shape[1])
            logits.append(model(ids[:, start:end], cache)[0])  # (end - start, V)
            sizes.append(end - start)
            start = end
    return torch.cat(logits), cache, sizes


@pytest.mark.parametrize("position, extra", [
    ("rope", {}), ("alibi", {}), ("none", {}), ("relative", {"scale_scores": False}),
    ("rope", {"rope_scaling": "yarn", "rope_factor": 2.0}),
])
@pytest.mark.parametrize("sinks", [0, 3])
def test_chunks_past_the_window_equal_streaming(position, extra, sinks):
    model, policy = _model(position, **extra), SinkPolicy(sinks, 9)
    ids = torch.randint(0, 61, (1, 50))
    streamed, one_by_one, stream_sizes = _read(model, ids, policy, chunk=1)
    chunked, in_chunks, chunk_sizes = _read(model, ids, policy, chunk=6)
    assert set(stream_sizes[1:]) == {1} and max(chunk_sizes[1:]) == 6  # the chunks did run
    torch.testing.assert_close(chunked, streamed, atol=2e-5, rtol=1e-5)
    for layer in range(3):  # every key stored unrotated in the slot streaming gives it
        torch.testing.assert_close(in_chunks.keys[layer], one_by_one.keys[layer], atol=2e-5, rtol=1e-5)
    assert in_chunks.seen == one_by_one.seen == 50 and in_chunks.length == policy.capacity - 1


def test_a_chunk_as_wide_as_the_window_and_decoding_after_it():
    """chunk = W: the first query sees only the W - 1 keys kept before it; generation after a
    chunked prompt picks the streamed tokens."""
    model, policy = _model(), SinkPolicy(2, 7)
    ids = torch.randint(0, 61, (1, 40))
    streamed, _, _ = _read(model, ids, policy, chunk=1)
    chunked, cache, sizes = _read(model, ids, policy, chunk=100)
    assert sizes == [9, 7, 7, 7, 7, 3]
    torch.testing.assert_close(chunked, streamed, atol=2e-5, rtol=1e-5)
    config = GenerationConfig(max_new_tokens=12, eos_ids=(), sink=SinkPolicy(2, 7, chunk=100))
    assert generate(model, ids[0].tolist(), config).generated_ids == [
        int(t) for t in _greedy_streamed(model, ids, policy, 12)]


def _greedy_streamed(model, ids, policy, n):
    logits, cache, _ = _read(model, ids, policy, chunk=1)
    token, out = logits[-1].argmax(), []
    with torch.no_grad():
        for _ in range(n):
            out.append(token)
            token = model(token.view(1, 1), cache)[0, -1].argmax()
    return out


@pytest.mark.parametrize("chunk", [0, -2, 1.5, True])
def test_bad_chunk_is_one_line(chunk):
    with pytest.raises(ValueError, match="^chunk: "):
        SinkPolicy(2, 7, chunk)


@pytest.mark.parametrize("fmt, tolerance", [("bf16", 0.05), ("int8", 2e-5), ("int4", 2e-5)])
def test_every_weight_format_reads_chunks_as_it_streams(fmt, tolerance):
    model, policy = quantize_model(_model(), fmt), SinkPolicy(2, 7)
    ids = torch.randint(0, 61, (1, 30))
    streamed, _, _ = _read(model, ids, policy, chunk=1)
    chunked, _, sizes = _read(model, ids, policy, chunk=4)
    assert max(sizes[1:]) == 4
    torch.testing.assert_close(chunked.float(), streamed.float(), atol=tolerance, rtol=0)
