"""Residual sites, what each block adds to the stream, and the lens, read from the fused decode
step's emitted rows: a request that asks only for those runs on the fused step, its capture
and lens equal run_with_cache and logit_lens on the module path of the same converted model, and
emitting rows leaves every row's numbers bitwise as they are without emission."""

import pytest
import torch

from glassformer.accel.fast_decode import FastDecoder
from glassformer.accel.quantize import quantize_model
from glassformer.interpret.lens import lens_sites, logit_lens
from glassformer.interpret.trace import run_with_cache
from glassformer.serving import Engine, EngineConfig, RequestParams, runner

EMITTED = ("embed.out", "blocks.0.resid_pre", "blocks.1.resid_pre", "blocks.1.resid_post",
           "blocks.0.attn.out", "blocks.1.mlp.out")


@pytest.fixture
def emitted(monkeypatch):
    """The rows each fused step was asked to emit, per call."""
    calls = []
    rows = FastDecoder.rows

    def spy(self, x, positions, slots, angles, keys, values, adapter_of=None, adapters=(),
            emit=None, residuals=None, writes=None):
        calls.append([] if emit is None else emit.tolist())
        return rows(self, x, positions, slots, angles, keys, values, adapter_of, adapters, emit, residuals,
                    writes)

    monkeypatch.setattr(FastDecoder, "rows", spy)
    return calls


@pytest.mark.parametrize("mode", ["fp32", "int8", "int4"])
def test_residual_capture_and_lens_on_the_fused_step_equal_the_module_path(
        tiny, prompts, kernels, mode, emitted, run_in_turn):
    model = quantize_model(tiny(), mode)
    plain = RequestParams(max_new_tokens=6, eos_ids=())
    inspecting = RequestParams(max_new_tokens=6, eos_ids=(), capture=EMITTED, lens=3, lens_layers=(2, 0))
    residual = RequestParams(max_new_tokens=6, eos_ids=(), capture=EMITTED[:2])  # no block's writes
    other_site = RequestParams(max_new_tokens=6, eos_ids=(), capture=("blocks.0.attn.q",))
    results = run_in_turn(model, prompts([9, 4, 13, 4]), [plain, inspecting, other_site, residual])
    # every row of the two inspecting requests (4 prompt rows and 5 generated ones each), prompt
    # chunks included, and never another request's rows (attn.q's keeps the module path)
    assert sum(len(rows) for rows in emitted) == 2 * (4 + 5)
    for result, sites in ((results[1], EMITTED), (results[3], EMITTED[:2])):
        tokens = torch.tensor([result.prompt_ids + result.generated_ids[:-1]])
        _, cache = run_with_cache(model, tokens, names=sites)
        for site in sites:
            torch.testing.assert_close(result.captured[site], cache[site], atol=1e-5, rtol=1e-5)
    result = results[1]
    tokens = torch.tensor([result.prompt_ids + result.generated_ids[:-1]])
    oracle = logit_lens(model, tokens, top_k=3)
    chosen = [lens_sites(model.config).index(site) for site in lens_sites(model.config, (2, 0))]
    torch.testing.assert_close(result.lens[1], oracle.probs[chosen, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(result.lens[0][:, :, 0], oracle.ids[chosen, 0, :, 0])


@pytest.mark.parametrize("mode", ["fp32", "int4"])
def test_emitting_rows_changes_no_row(tiny, kernels, mode):
    model = quantize_model(tiny(), mode)
    config, step = model.config, model.fused_step
    kv, d_head, n_slots = config.kv_heads, config.head_dim, 32
    positions = torch.tensor([3, 7, 0])  # (B,)
    slots = torch.stack([torch.randperm(n_slots)[:8] for _ in range(3)])  # (B, S)
    x = torch.randn(3, config.d_model)  # (B, d)
    cos, sin = torch.randn(3, d_head), torch.randn(3, d_head)  # (B, d_head) each
    pool = [torch.randn(n_slots, kv, d_head) for _ in range(2 * config.n_layers)]  # keys, values

    def run(emit, with_writes=False):
        keys, values = [t.clone() for t in pool[::2]], [t.clone() for t in pool[1::2]]
        residuals = writes = None
        if emit is not None:  # NaN where the step wrote nothing
            m, n_layers, d = len(emit), config.n_layers, config.d_model
            residuals = torch.full((m, n_layers + 1, d), torch.nan)  # (M, L + 1, d)
            if with_writes:
                writes = torch.full((m, n_layers, 2, d), torch.nan)  # (M, L, 2, d)
        with torch.inference_mode():
            rows = None if emit is None else torch.tensor(emit)  # (M,)
            h = step().rows(x, positions, slots, ((cos, sin),), keys, values, emit=rows, residuals=residuals,
                            writes=writes)
        return h, keys, values, residuals, writes

    h, keys, values, _, _ = run(None)
    for emit, with_writes in (([1], False), ([2, 0], True)):
        h_e, keys_e, values_e, residuals, writes = run(emit, with_writes)
        assert torch.equal(h_e, h)
        assert all(torch.equal(a, b) for a, b in zip(keys + values, keys_e + values_e, strict=True))
        assert torch.equal(residuals[:, 0], x[emit]) and torch.equal(residuals[:, -1], h[emit])
        assert not residuals.isnan().any()
        if with_writes:  # each layer's stream: the one before plus its attention, then its feed-forward
            assert torch.equal(residuals[:, 1:], residuals[:, :-1] + writes[:, :, 0] + writes[:, :, 1])


@pytest.mark.parametrize("mode", [None, "int4"])
def test_a_lens_that_reads_the_last_residual_gives_the_step_s_own_logits(tiny, prompts, request, mode,
                                                                         monkeypatch):
    """The last residual's read-out is the model's output: the step's one read-out takes it from
    the lens's row (module path and fused step), and every token and log-probability stays bitwise as without
    the lens."""
    if mode is not None:
        request.getfixturevalue("kernels")
    model = tiny() if mode is None else quantize_model(tiny(), mode)
    last = model.config.n_layers
    taken = []
    output_row = runner.output_row
    monkeypatch.setattr(runner, "output_row",
                        lambda *args: taken.append((row := output_row(*args)) is not None) or row)

    def events(lens):
        engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64, token_budget=8, max_batch=4))
        handles = [engine.submit(p, RequestParams(max_new_tokens=5, eos_ids=(), logprobs=3, **fields))
                   for p, fields in zip(prompts([9, 5, 13, 6]), lens, strict=True)]
        engine.run_until_done()
        return [[(e.token_id, e.logprobs) for e in h if e.token_id is not None] for h in handles]

    plain = events([{}] * 4)
    assert not any(taken)
    lenses = [{"lens": 2}, {"lens": 3, "lens_layers": (1, last)}, {"lens": 2, "lens_layers": (0,)}, {}]
    reading = events(lenses)
    assert any(taken)
    assert reading == plain
