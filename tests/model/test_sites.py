"""The hook sites' table (model/sites.py) against what the modules emit: every site in the table
is emitted by a forward pass of a model that has its piece, every emitted site is in the table,
and each model emits exactly the sites glassformer.trace lists for its configuration."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from glassformer import get_preset
from glassformer.formats.families import FAMILIES
from glassformer.generation.paths import fused_source
from glassformer.interpret import trace
from glassformer.interpret.trace import capture, site_names
from glassformer.model.encoder_decoder import build_model
from glassformer.model.hooks import Hooks
from glassformer.model.sites import (
    CROSS_SITES,
    EMBED_SITES,
    LAYER_SITES,
    OUTPUT_SITES,
    STACK_SITES,
    WEIGHT_SITES,
    layer_site,
    names,
)

# Every family's tiny config and the presets whose pieces no family has (post-norm, ALiBi, ...)
CONFIGS = {**{f.name: f.read(f.example) for f in FAMILIES},
           **{name: get_preset(name) for name in ("tiny-gpt1", "tiny-alibi", "tiny-t5")}}
TABLE = {*EMBED_SITES, *LAYER_SITES, *OUTPUT_SITES, *CROSS_SITES, *STACK_SITES}


def _emitted(config, monkeypatch) -> list[str]:
    """Every name the modules pass to their hooks in one forward pass with every site captured."""
    seen: list[str] = []
    call = Hooks.__call__

    def recording(self, site, tensor):
        seen.append(site)
        return call(self, site, tensor)

    monkeypatch.setattr(Hooks, "__call__", recording)
    torch.manual_seed(0)
    model = build_model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 5))
    with torch.no_grad(), capture(model):  # every site listed, so the weight sites form too
        model(ids, ids) if config.n_encoder_layers else model(ids)
    return seen


def _in_table(site: str) -> str:
    """The table's name of an emitted site: its stack and block index taken off."""
    return re.sub(r"^(encoder\.|decoder\.)?(blocks\.\d+\.)?", "", site)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_model_emits_exactly_the_sites_the_trace_lists(name, monkeypatch):
    emitted = _emitted(CONFIGS[name], monkeypatch)
    assert sorted(set(emitted)) == sorted(site_names(CONFIGS[name]))
    assert {_in_table(site) for site in emitted} <= TABLE


def test_every_site_in_the_table_is_emitted_by_a_model_with_its_piece(monkeypatch):
    emitted = {_in_table(site) for config in CONFIGS.values()
               for site in _emitted(config, monkeypatch)}
    assert sorted(TABLE - emitted) == []


def test_the_pieces_sites_are_named_in_the_table():
    """QK-norm's outputs, and the output norms of OLMo 2 and Gemma 2's sandwich."""
    qk, olmo, gemma2 = (site_names(CONFIGS[name]) for name in ("Qwen3", "OLMo 2", "Gemma 2"))
    assert {"blocks.0.attn.q_norm", "blocks.0.attn.k_norm"} <= set(qk)
    assert {"blocks.1.attn_out_norm", "blocks.1.mlp_out_norm"} <= set(olmo) - {"blocks.1.norm1"}
    assert {"blocks.0.norm1", "blocks.0.attn_out_norm", "blocks.0.norm2",
            "blocks.0.mlp_out_norm"} <= set(gemma2)


def test_names_take_a_scope_of_the_table():
    assert names("blocks.3", LAYER_SITES, "attn")["q_norm"] == "blocks.3.attn.q_norm"
    assert names("decoder.blocks.0", CROSS_SITES, "cross")["pattern"] == "decoder.blocks.0.cross.pattern"
    assert names("", EMBED_SITES, "embed")["out"] == "embed.out"
    assert set(names("blocks.0", LAYER_SITES)) == {"resid_pre", "norm1", "attn_out_norm", "resid_mid",
                                                   "norm2", "mlp_out_norm", "resid_post"}
    assert set(WEIGHT_SITES) <= set(names("", LAYER_SITES, "attn")) & set(names("", CROSS_SITES, "cross"))


def test_layer_site_parses_block_sites_only():
    assert layer_site("blocks.12.attn.q_norm") == (12, "attn.q_norm")
    assert layer_site("blocks.x.attn.q") is None
    assert layer_site("blocks.0.attn.weights") is None
    assert layer_site("decoder.blocks.0.resid_pre") is None
    assert layer_site("final_norm") is None


def test_the_fused_step_sources_are_sites_of_the_table():
    config = CONFIGS["Llama"]
    sources = {site: fused_source(site) for site in site_names(config)}
    named = {site for site, source in sources.items() if source is not None}
    assert named == {"embed.out", *(f"blocks.{i}.{s}" for i in range(config.n_layers)
                                    for s in ("resid_pre", "resid_post", "attn.out", "mlp.out"))}


def test_the_trace_lists_every_site_of_a_decoder_with_its_dimensions():
    """Its docstring's listing, one line a site: the name (blocks.{i}. before a layer's) and
    the dimensions as the table has them."""
    lines = {line.split()[0]: line for line in inspect.getdoc(trace).splitlines() if line.startswith("    ")}
    for site, dims in {**EMBED_SITES, **{f"blocks.{{i}}.{s}": d for s, d in LAYER_SITES.items()},
                       **OUTPUT_SITES}.items():
        assert f"({', '.join(dims)})" in lines[site], site
