"""generation/config.py: what `generate` and the serving engine share (Decoding), the sites a
request names parsed when it is made, and its one check against a model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.errors import InputError
from glassformer.generation.config import Decoding, GenerationConfig, RequestParams, Steer
from glassformer.generation.sampling import SamplingConfig
from glassformer.model.sites import Head, Site


def _fields(cls) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


def test_generate_and_the_engine_share_the_decoding_and_nothing_else():
    shared = _fields(GenerationConfig) & _fields(RequestParams)
    assert shared == _fields(Decoding) == {"max_new_tokens", "sampling", "seed", "stop", "eos_ids",
                                           "beams", "length_penalty"}
    for name in _fields(RequestParams) - shared:  # the engine's own: no field of generate's
        with pytest.raises(TypeError, match=f"'{name}'"):
            GenerationConfig(**{name: None})
    for cls in (GenerationConfig, RequestParams):  # the shared checks hold for both
        with pytest.raises(InputError, match="^beams: "):
            cls(beams=2, sampling=SamplingConfig(temperature=1.0))


def test_a_request_holds_its_sites_and_heads_parsed():
    v = torch.ones(4)
    params = RequestParams(capture=("blocks.1.resid_post", "embed.out"), ablate=("blocks.0.attn.head.3",),
                           steer=(Steer("blocks.0.resid_mid", v, 1.0),))
    assert params.capture == (Site("", 1, "resid_post"), Site("", None, "embed.out"))
    assert params.ablate == (Head(Site("", 0, "attn.context"), 3),)
    assert params.steer[0].site == Site("", 0, "resid_mid")
    assert params == RequestParams(capture=params.capture, ablate=params.ablate, steer=params.steer)
    refused = [(dict(capture=("blocks.0.resid_pots",)), "^capture: unknown hook site 'blocks.0.resid_pots'"),
               (dict(ablate=("blocks.0.attn.2",)), "^ablate: 'blocks.0.attn.2' is not a head name")]
    for fields, refusal in refused:
        with pytest.raises(InputError, match=refusal):
            RequestParams(**fields)
    with pytest.raises(InputError, match="^steer: unknown hook site 'blocks.0.resid'"):
        Steer("blocks.0.resid", v, 1.0)


def test_the_check_against_a_model_names_each_field():
    model = Transformer(get_preset("tiny-llama"))
    config, sites = model.config, model.hooks.sites
    d = config.d_model
    RequestParams(capture=("blocks.1.attn.q",), steer=(Steer("blocks.0.resid_post", torch.ones(d), 1.0),),
                  ablate=("blocks.1.attn.head.0",), lens=2, lens_layers=(0, config.n_layers),
                  logprobs=config.vocab_size).check(config, sites)
    refused = [
        (dict(capture=(f"blocks.{config.n_layers}.resid_post",)), "^capture: the model has no site"),
        (dict(capture=("blocks.0.attn.q_norm",)), "^capture: the model has no site"),  # no QK-norm
        (dict(capture=("blocks.0.attn.pattern",)), "^capture: .*token axis"),
        (dict(capture=("final_norm",)), "^capture: .*token axis"),  # read out after the blocks
        (dict(steer=(Steer("blocks.0.mlp.hidden", torch.ones(d), 1.0),)), "^steer: .*d_model"),
        (dict(steer=(Steer("final_norm", torch.ones(d), 1.0),)), "^steer: .*after the engine's blocks"),
        (dict(steer=(Steer("blocks.0.resid_post", torch.ones(d + 1), 1.0),)), "^steer: .*width"),
        (dict(ablate=(f"blocks.0.attn.head.{config.n_heads}",)), "^ablate: block 0 has no head"),
        (dict(ablate=(f"blocks.{config.n_layers}.attn.head.0",)), "^ablate: the model has no block"),
        (dict(lens=1, lens_layers=(config.n_layers + 1,)), "^lens_layers: layers are 0"),
        (dict(lens=1, lens_layers=(1, 1)), "^lens_layers: each layer once"),
        (dict(logprobs=config.vocab_size + 1), "^logprobs: at most the vocabulary's"),
    ]
    for fields, refusal in refused:
        with pytest.raises(InputError, match=refusal):
            RequestParams(**fields).check(config, sites)
