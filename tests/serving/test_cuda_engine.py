"""The engine on a GPU (marked cuda, skipped without one): the graph executor decodes as the
module path, and with EngineConfig.deterministic a request's tokens and log-probabilities are
bit for bit the same alone and in a batch of eight mixed requests (the module path in float32
and bfloat16, the graph in float32)."""

from __future__ import annotations

import pytest
import torch

from glassformer.accel.precision import CUBLAS_WORKSPACE, choose_precision, use_precision
from glassformer.errors import InputError
from glassformer.generation.config import RequestParams
from glassformer.generation.paths import MODULES
from glassformer.serving import Engine, EngineConfig
from glassformer.serving.graph_path import FLEX_BLOCK, FLEX_CUDA_HEAD_DIM, GRAPH, GraphPath
from glassformer.serving.kv_pool import KVPool

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# tiny-llama with heads as wide as FlexAttention's CUDA kernels take (the preset's are 8), three
# query heads to a key head as SmolLM2's (not a power of two: FlexAttention's main kernel)
WIDE_HEADS = dict(d_model=6 * FLEX_CUDA_HEAD_DIM, n_heads=6, n_kv_heads=2, d_ff=128)


@pytest.fixture
def deterministic(monkeypatch):
    """The process as `--deterministic` sets it on CUDA, restored afterwards."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
              torch.backends.cudnn.allow_tf32)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    use_precision(choose_precision("cuda", deterministic=True))
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[1:]


def _first_request(model, config: EngineConfig, requests) -> tuple[list, set[str]]:
    """The first request's (token, log-probability) pairs and the paths its rows took."""
    engine = Engine(model, None, config)
    handles = [engine.submit(p, q, request_id=str(i)) for i, (p, q) in enumerate(requests)]
    engine.run_until_done()
    paths = {path for trace in engine.trace for (rid, _), (path, _) in zip(trace.requests, trace.paths,
                                                                          strict=True) if rid == "0"}
    return [(e.token_id, e.logprobs.logprob) for e in handles[0] if e.token_id is not None], paths


def test_the_graph_executor_decodes_as_the_module_path(tiny, prompts):
    model = tiny(**WIDE_HEADS).to("cuda")
    requests = [(p, RequestParams(max_new_tokens=n, eos_ids=(), logprobs=0)) for p, n in
                zip(prompts([3, 9, 6]), [6, 4, 2], strict=True)]
    config = EngineConfig(block_size=FLEX_BLOCK, n_blocks=4, max_batch=4, token_budget=16)
    want = [_first_request(model, config, [r])[0] for r in requests]
    graph = EngineConfig(block_size=FLEX_BLOCK, n_blocks=4, max_batch=4, token_budget=16, compile=True)
    got = [_first_request(model, graph, [r]) for r in requests]
    assert [[t for t, _ in tokens] for tokens, _ in got] == [[t for t, _ in tokens] for tokens in want]
    assert got[0][1] == {GRAPH, MODULES}  # its prompt on the module path, its tokens in the graph


def test_the_graph_executor_refuses_kv_blocks_flex_attention_cannot_tile(tiny):
    with pytest.raises(InputError, match=f"multiple of {FLEX_BLOCK} tokens"):
        Engine(tiny(**WIDE_HEADS).to("cuda"), None, EngineConfig(block_size=16, n_blocks=16, compile=True))


def test_heads_too_narrow_for_flex_attention_keep_the_module_path(tiny):
    def executor(model):
        return GraphPath(model, KVPool(model.config, 4, FLEX_BLOCK, device="cuda", scratch=True),
                         EngineConfig(block_size=FLEX_BLOCK), None)

    assert "8 dimensions" in executor(tiny().to("cuda")).refused
    assert executor(tiny(**WIDE_HEADS).to("cuda")).refused is None


# the graph compiles once per dtype: float32 only, within gpu_check's time for these tests
@pytest.mark.parametrize(("dtype", "graph"), [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.float32, True)])
def test_deterministic_keeps_a_requests_tokens_alone_and_in_a_mixed_batch(tiny, mixed_requests, deterministic,
                                                                         dtype, graph):
    model = tiny(**WIDE_HEADS).to(device="cuda", dtype=dtype)
    config = EngineConfig(block_size=FLEX_BLOCK if graph else 16, n_blocks=64, max_batch=8, token_budget=64,
                          compile=graph, deterministic=True)
    requests = mixed_requests(6)
    alone, _ = _first_request(model, config, requests[:1])
    shared, paths = _first_request(model, config, requests)
    assert shared == alone  # bit for bit: tokens and log-probabilities
    assert (GRAPH in paths) == graph


def test_deterministic_on_cuda_needs_the_process_settings(tiny, monkeypatch):
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    with pytest.raises(ValueError, match="use_precision"):
        Engine(tiny().to("cuda"), None, EngineConfig(n_blocks=16, deterministic=True))
