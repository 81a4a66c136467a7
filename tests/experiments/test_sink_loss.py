"""sink_loss: the block means against plain per-token losses, and the goal on SmolLM2."""


import pytest
import torch
import torch.nn.functional as F

from glassformer import ModelConfig, Transformer
from glassformer.data import tinyshakespeare
from glassformer.experiments.sink_loss import recomputed_losses, sink_loss, streamed_losses
from glassformer.model.sink import SinkPolicy


def test_streamed_losses_are_each_tokens_loss_over_the_kept_tokens():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=40, context_length=64, d_model=32, n_layers=1, n_heads=4,
                                    position="rope", init_std=0.3)).eval()
    ids, policy = torch.randint(0, 40, (30,)), SinkPolicy(2, 4)
    got = streamed_losses(model, ids, policy)
    with torch.no_grad():
        want = torch.stack([F.cross_entropy(model(ids[None, policy.kept(t + 1)])[0, -1], ids[t + 1])
                            for t in range(29)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    result = sink_loss(model, (ids.tolist() * 3)[:64], window=4, sink_tokens=2, stride=1)
    assert len(result["blocks"]["sink"]) == len(result["blocks"]["dense"]) == 63 // 4
    text = torch.tensor((ids.tolist() * 3)[:64])
    with torch.no_grad():  # the oracle: token 63 predicted from the 4 tokens before it, from scratch
        last = F.cross_entropy(model(text[None, 59:63])[0, -1], text[63])
    assert recomputed_losses(model, text, 4, [63])[0].item() == pytest.approx(last.item(), abs=1e-5)
    window_only = streamed_losses(model, text, SinkPolicy(0, 4))
    quarter = list(range(63 - 63 // 4, 63))
    late = window_only[quarter].mean() / recomputed_losses(model, text, 4, [i + 1 for i in quarter]).mean()
    early = window_only[4:8].mean() / recomputed_losses(model, text, 4, [5, 6, 7, 8]).mean()
    want = late / early
    assert result["flat_window"] == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.slow
def test_sinks_keep_smollm2_loss_flat_over_16_windows(smollm2_path):
    from glassformer import load

    language_model = load(str(smollm2_path), quantize="none", progress=False)
    window = 64
    text = tinyshakespeare().read_text(encoding="utf-8")[:20000]
    ids = language_model.tokenizer.encode(text)[: 16 * window]
    result = sink_loss(language_model.model, ids, window, sink_tokens=4)
    print(result)
    # the goal: sink + window within 5% of its loss at W (against recompute on the same tokens)
    assert abs(result["flat_sink"] - 1) <= 0.05, result
    assert result["over_recompute_window"] > 1.05 > result["over_recompute_sink"]  # window-only degrades
