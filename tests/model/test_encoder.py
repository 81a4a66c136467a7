"""The encoder parts (BERT): segment embeddings, the norm on the embeddings, the masked-LM head
and the pooler, each against its formula written plainly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glassformer import ModelConfig, Transformer, get_preset


def _model():
    torch.manual_seed(0)
    return Transformer(get_preset("tiny-bert")).eval()


def test_embedding_is_the_normed_sum_of_tokens_positions_and_segments():
    model = _model()
    ids, types = torch.tensor([[3, 7, 1, 9]]), torch.tensor([[0, 0, 1, 1]])
    e, n = model.embed, model.embed.norm
    total = e.tokens.weight[ids] + e.positions.weight[:4] + e.token_types.weight[types]
    expected = F.layer_norm(total, (32,), n.weight, n.bias, 1e-12)
    torch.testing.assert_close(e(ids, torch.arange(4)[None], types), expected)


def test_mlm_head_and_pooler_follow_their_formulas():
    model = _model()
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    with torch.no_grad():
        h = model.forward_hidden(ids)  # (1, 5, d)
        t = model.head_transform
        moved = F.layer_norm(F.gelu(h @ t.dense.weight.T + t.dense.bias), (32,), t.norm.weight,
                             t.norm.bias, 1e-12)
        expected = moved @ model.embed.tokens.weight.T + model.lm_head.bias
        torch.testing.assert_close(model(ids), expected)
        p = model.pooler.dense
        torch.testing.assert_close(model.pool(h), torch.tanh(h[:, 0] @ p.weight.T + p.bias))


def test_bidirectional_attention_sees_later_tokens():
    model = _model()
    a, b = torch.tensor([[3, 7, 1, 9]]), torch.tensor([[3, 7, 1, 2]])
    with torch.no_grad():
        assert not torch.allclose(model(a)[0, 0], model(b)[0, 0])  # position 0 reads position 3


def test_token_types_without_segment_embeddings_are_refused():
    model = Transformer(get_preset("tiny-gpt2"))
    with pytest.raises(ValueError, match="token_types"):
        model(torch.tensor([[1, 2]]), token_types=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="pooler"):
        model.pool(torch.zeros(1, 2, 32))


@pytest.mark.parametrize("change, field", [({"n_token_types": -1}, "n_token_types"),
                                           ({"head": "seq2seq"}, "head"),
                                           ({"pooler": "yes"}, "pooler")])
def test_invalid_encoder_fields_name_the_field(change, field):
    base = dict(vocab_size=10, context_length=8, d_model=8, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match=field):
        ModelConfig(**base, **change)


def test_bert_base_shapes():
    c = get_preset("bert")
    assert (c.n_layers, c.d_model, c.n_heads, c.ff_dim, c.vocab_size, c.context_length,
            c.n_token_types) == (12, 768, 12, 3072, 30522, 512, 2)
