"""T5 folders: tiny random T5ForConditionalGeneration (v1.0: ReLU, tied head with the d_model^-½
rescale; v1.1: gated GELU, untied head) built with transformers (the oracle), saved, loaded by
Glassformer: equal logits (fp32), plus the error paths."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from glassformer.formats.huggingface import config_from_hf, load_hf_model
from glassformer.model.encoder_decoder import EncoderDecoder

transformers = pytest.importorskip("transformers")
from t5_folders import SIZES, VERSIONS, VOCAB, save_t5  # noqa: E402  (tests/ is on the path)


@pytest.fixture(scope="module", params=list(VERSIONS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    reference = save_t5(request.param, folder)
    return folder, reference, load_hf_model(folder)


def test_config_of_each_version(pair):
    _, reference, model = pair
    c = model.config
    assert isinstance(model, EncoderDecoder)
    assert (c.n_encoder_layers, c.n_layers, c.head_dim) == (2, 3, 8)
    v11 = reference.config.is_gated_act
    assert (c.gated, c.activation, c.tie_embeddings, c.scale_head_input) == (
        (True, "gelu_tanh", False, False) if v11 else (False, "relu", True, True))


def test_logits_equal(pair):
    _, reference, model = pair
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, 13), generator=g)
    decoder_ids = torch.randint(2, VOCAB, (2, 9), generator=g)
    with torch.no_grad():
        expected = reference(input_ids=ids, decoder_input_ids=decoder_ids).logits
        torch.testing.assert_close(model(ids, decoder_ids), expected)


def test_logits_equal_with_source_padding(pair):
    _, reference, model = pair
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 11), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 7:] = False  # the second source is 7 tokens, right-padded
    ids[1, 7:] = 0
    decoder_ids = torch.randint(2, VOCAB, (2, 6), generator=g)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=decoder_ids).logits
        torch.testing.assert_close(model(ids, decoder_ids, mask), expected)


def test_cached_decoding_equals_the_whole_pass(pair):
    _, _, model = pair
    from glassformer.model.kv_cache import KVCache

    ids = torch.randint(2, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    targets = torch.tensor([[0, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        whole = model(ids, targets)  # (1, 6, V)
        memory = model.encode(ids)
        cache = KVCache(model.config, 1, max_length=8)
        steps = [model.head(model.forward_hidden(targets[:, t : t + 1], memory, cache=cache))
                 for t in range(targets.shape[1])]
    # one query at a time sums in another order than the whole pass (logits here reach ~100)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-4, rtol=1e-5)
    assert len(cache.cross) == model.config.n_layers  # projected once, kept


def test_unsupported_feed_forward_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="feed_forward_proj 'gated-swish'"):
        config_from_hf({"model_type": "t5", "feed_forward_proj": "gated-swish"} | SIZES)


def test_missing_field_is_named():
    hf = {"model_type": "t5", **SIZES}
    del hf["d_kv"]
    with pytest.raises(ValueError, match="lacks 'd_kv'"):
        config_from_hf(hf)


def test_missing_and_misshapen_tensors(tmp_path):
    save_t5("v1.0", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "decoder.block.1.layer.1.EncDecAttention.k.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensor {name}"):
        load_hf_model(tmp_path)
    save_file(tensors | {name: tensors[name][:, :4].contiguous()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor {name} has shape"):
        load_hf_model(tmp_path)
    save_file(tensors | {"decoder.block.9.layer.0.layer_norm.weight": torch.ones(32)},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor decoder.block.9"):
        load_hf_model(tmp_path)
