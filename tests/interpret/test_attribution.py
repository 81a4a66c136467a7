import numpy as np
import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.interpret.attribution import TENTHS, attention_rollout, integrated_gradients, token_baseline
from glassformer.interpret.trace import run_with_cache


def sharp_model(name: str = "tiny-llama") -> Transformer:
    # Large weights make the logit clearly nonlinear in the embeddings, so quadrature matters.
    torch.manual_seed(0)
    return Transformer(get_preset(name).replace(init_std=0.1)).eval()


def ids_for(model: Transformer, T: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, model.config.vocab_size, (1, T), generator=g)


def test_rollout_matches_the_matrix_products_written_out():
    g = torch.Generator().manual_seed(0)
    patterns = [torch.rand(1, 3, 4, 4, generator=g).softmax(-1) for _ in range(3)]
    expected = np.eye(4)
    for p in patterns:
        a = 0.5 * p[0].double().numpy().mean(axis=0) + 0.5 * np.eye(4)
        a = a / a.sum(axis=1, keepdims=True)
        expected = a @ expected
    torch.testing.assert_close(attention_rollout(patterns)[0], torch.tensor(expected, dtype=torch.float32))


def test_rollout_of_a_causal_model_is_a_lower_triangular_distribution():
    model = sharp_model()
    T = 6
    _, cache = run_with_cache(model, ids_for(model, T), names=lambda n: n.endswith("pattern"))
    rollout = attention_rollout(list(cache.values()))[0]  # (T, T)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(T))
    assert (rollout.triu(1) == 0).all()
    assert rollout[0, 0] == 1  # the first token only ever sees itself


def test_rollout_rejects_decode_step_weights():
    with pytest.raises(ValueError, match="square"):
        attention_rollout([torch.ones(1, 2, 1, 5) / 5])
    with pytest.raises(ValueError, match="at least one"):
        attention_rollout([])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-gpt1"])
def test_integrated_gradients_are_complete(name):
    model = sharp_model(name)
    ids = ids_for(model)
    result = integrated_gradients(model, ids, target=7, steps=8)
    logits = model(ids).detach()
    assert result.logit == pytest.approx(float(logits[0, -1, 7]), abs=1e-4)
    difference = result.logit - result.baseline_logit
    assert abs(difference) > 0.1
    assert float(result.attributions.sum()) == pytest.approx(difference, rel=1e-3, abs=1e-3)
    assert abs(result.completeness_gap) < 1e-3


def test_too_few_steps_leave_a_completeness_gap():
    # The check above can fail: two points per panel miss the curvature along the path.
    model = sharp_model()
    coarse = integrated_gradients(model, ids_for(model), target=7, steps=2)
    assert abs(coarse.completeness_gap) > 1e-2


def test_integrated_gradients_match_a_fine_trapezoid_rule():
    model = sharp_model()
    ids = ids_for(model)
    x = model.embed.tokens(ids).detach()[0]  # (T, d)
    # 0 and 3000 geometrically spaced points down to 1e-10 (the function moves at every scale)
    alphas = torch.cat([torch.zeros(1), torch.logspace(-10, 0, 3000, dtype=torch.float64)])
    widths = alphas[1:] - alphas[:-1]
    weights = torch.zeros_like(alphas)
    weights[1:] += widths / 2
    weights[:-1] += widths / 2
    total = torch.zeros_like(x)
    for a, w in zip(alphas.float().split(500), weights.float().split(500), strict=True):
        points = (a[:, None, None] * x).requires_grad_(True)  # (n, T, d)
        with model.hooks.installed({"embed.tokens": lambda t, s, points=points: points}):
            logit = model(ids.expand(len(a), -1))[:, 2, 11]
        total += (w[:, None, None] * torch.autograd.grad(logit.sum(), points)[0]).sum(0)
    expected = (x * total).sum(-1)  # (T,)
    result = integrated_gradients(model, ids, target=11, position=2, steps=8)
    torch.testing.assert_close(result.attributions, expected, rtol=1e-3, atol=1e-3)
    assert (result.attributions[3:] == 0).all()  # causal: later tokens cannot matter


def test_a_token_equal_to_its_baseline_gets_nothing():
    model = sharp_model()
    ids = ids_for(model)
    baseline = torch.zeros(6, model.config.d_model)
    baseline[1] = model.embed.tokens(ids)[0, 1].detach()
    result = integrated_gradients(model, ids, target=3, baseline=baseline, steps=8)
    assert result.attributions[1] == 0
    assert abs(result.completeness_gap) < 1e-3


def test_integrated_gradients_refuse_training_mode_and_bad_baselines():
    model = sharp_model()
    with pytest.raises(ValueError, match="baseline"):
        integrated_gradients(model, ids_for(model), target=0, baseline=torch.zeros(2, 3))
    model.train()
    with pytest.raises(ValueError, match="eval"):
        integrated_gradients(model, ids_for(model), target=0)


def test_a_token_baseline_holds_the_first_position_and_stays_complete():
    model = sharp_model()
    ids = ids_for(model)
    baseline = token_baseline(model, ids, token_id=5)
    x = model.embed.tokens(ids)[0].detach()
    torch.testing.assert_close(baseline[0], x[0])
    torch.testing.assert_close(baseline[1:], model.embed.tokens.weight[5].detach().expand(5, -1))
    result = integrated_gradients(model, ids, target=7, baseline=baseline, steps=4, edges=TENTHS)
    assert result.attributions[0] == 0
    assert abs(result.baseline_logit) > 0 and abs(result.completeness_gap) < 1e-3


def test_a_token_baseline_reads_a_table_kept_in_blocks():
    from glassformer.accel.quantized_embedding import QuantizedEmbedding
    from glassformer.accel.quantized_linear import QuantizedLinear

    model = sharp_model()
    ids = ids_for(model)
    model.embed.tokens = QuantizedEmbedding(QuantizedLinear.from_weight(model.embed.tokens.weight, "int4"))
    baseline = token_baseline(model, ids, token_id=5)  # no float table to index: a lookup
    table = model.embed.tokens.dequantized_weight()
    torch.testing.assert_close(baseline[1:], table[5].expand(5, -1), atol=0, rtol=0)
    torch.testing.assert_close(baseline[0], table[ids[0, 0]], atol=0, rtol=0)
