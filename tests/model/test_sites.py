"""The hook sites' table (model/sites.py) against what the modules emit: every site in the table
is emitted by a forward pass of a model that has its piece, every emitted site is in the table,
and each model emits exactly the sites its modules registered when built, in that order. The
one parser of the names, and the registry refusing a name its model lacks."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from glassformer import get_preset
from glassformer.errors import InputError
from glassformer.formats.families import FAMILIES
from glassformer.generation.paths import fused_source
from glassformer.interpret import trace
from glassformer.interpret.trace import capture
from glassformer.model.encoder_decoder import build_model
from glassformer.model.hooks import Hooks
from glassformer.model.sites import (
    CROSS_SITES,
    EMBED_SITES,
    LAYER_SITES,
    OUTPUT_SITES,
    STACK_SITES,
    WEIGHT_SITES,
    Site,
    names,
    parse_head,
    parse_site,
)

# Every family's tiny config and the presets whose pieces no family has (post-norm, ALiBi, ...)
CONFIGS = {**{f.name: f.read(f.example) for f in FAMILIES},
           **{name: get_preset(name) for name in ("tiny-gpt1", "tiny-alibi", "tiny-t5")}}
TABLE = {*EMBED_SITES, *LAYER_SITES, *OUTPUT_SITES, *CROSS_SITES, *STACK_SITES}


def _sites(config) -> list[str]:
    """The sites a model of `config` registered when built, in its registry's order."""
    return list(build_model(config).hooks.sites)


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
def test_a_model_emits_exactly_the_sites_it_registered_in_their_order(name, monkeypatch):
    """An encoder-decoder's shared embedding fires once per stack: each site's first call."""
    emitted = _emitted(CONFIGS[name], monkeypatch)
    assert list(dict.fromkeys(emitted)) == _sites(CONFIGS[name])
    assert {_in_table(site) for site in emitted} <= TABLE


def test_every_site_in_the_table_is_emitted_by_a_model_with_its_piece(monkeypatch):
    emitted = {_in_table(site) for config in CONFIGS.values()
               for site in _emitted(config, monkeypatch)}
    assert sorted(TABLE - emitted) == []


def test_the_pieces_sites_are_named_in_the_table():
    """QK-norm's outputs, and the output norms of OLMo 2 and Gemma 2's sandwich."""
    qk, olmo, gemma2 = (_sites(CONFIGS[name]) for name in ("Qwen3", "OLMo 2", "Gemma 2"))
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


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_registered_name_parses_back_to_itself_with_its_table_dims(name):
    for text, site in build_model(CONFIGS[name]).hooks.sites.items():
        assert parse_site(text) == site and site.full == str(site) == text
        assert site.dims == {**EMBED_SITES, **OUTPUT_SITES, **STACK_SITES, **LAYER_SITES,
                             **CROSS_SITES}[site.name]


def test_the_parser_reads_where_a_site_sits_and_its_axes():
    assert parse_site("blocks.12.attn.q_norm") == Site("", 12, "attn.q_norm")
    assert parse_site("decoder.blocks.0.cross.pattern") == Site("decoder", 0, "cross.pattern")
    assert parse_site("encoder.final_norm") == Site("encoder", None, "final_norm")
    assert parse_site("embed.out") == Site("", None, "embed.out")
    q, pattern, logits = (parse_site(name) for name in ("blocks.1.attn.q", "blocks.1.attn.pattern", "logits"))
    assert (q.token_axis, q.head_axis) == (2, 1)  # (batch, head, pos, d_head)
    assert (pattern.token_axis, pattern.head_axis) == (None, 1)  # (batch, head, query, key)
    assert (logits.token_axis, logits.head_axis) == (1, None)  # (batch, pos, vocab)


@pytest.mark.parametrize("text", ["blocks.x.attn.q", "blocks.0.attn.weights", "blocks.03.resid_post",
                                  "blocks.-1.resid_post", "encoder.blocks.0.cross.q", "decoder.embed.out",
                                  "blocks.0", "resid_post", "", "blocks.0.resid_post.", "embed.tokens "])
def test_the_parser_refuses_a_name_that_is_no_site_in_one_line_naming_it(text):
    with pytest.raises(InputError) as refused:
        parse_site(text, "capture")
    assert str(refused.value) == f"capture: unknown hook site {text!r}; glassformer.trace lists the names"


def test_head_names_parse_to_their_slice_of_the_context():
    head = parse_head("blocks.3.attn.head.2")
    assert (head.site, head.index, str(head)) == (Site("", 3, "attn.context"), 2, "blocks.3.attn.head.2")
    for text in ("blocks.3.attn.2", "blocks.3.attn.head.02", "decoder.blocks.0.attn.head.1",
                 "blocks.3.attn.head"):
        with pytest.raises(InputError, match=r"^ablate: .* is not a head name"):
            parse_head(text)


def test_the_registry_refuses_a_hook_at_a_site_its_model_lacks():
    """A misspelled site, or one of the table a model of another configuration has: one line
    naming it, before any hook is installed (else the hook would silently never fire)."""
    config = CONFIGS["Llama"]
    model = build_model(config)  # no QK-norm
    seen = []
    for name in ("blocks.0.resid_pots", "blocks.0.attn.q_norm", f"blocks.{config.n_layers}.resid_post"):
        with pytest.raises(InputError, match=rf"^unknown hook site\(s\) for this model: {re.escape(name)} "):
            with model.hooks.installed({"blocks.0.resid_post": lambda t, s: seen.append(s), name: print}):
                pass
        assert not model.hooks  # nothing was left installed
    with torch.no_grad(), model.hooks.installed({"blocks.0.resid_post": lambda t, s: seen.append(s)}):
        model(torch.zeros(1, 2, dtype=torch.long))
    assert seen == ["blocks.0.resid_post"]


def test_the_fused_step_sources_are_sites_of_the_table():
    config = CONFIGS["Llama"]
    sources = {site: fused_source(site) for site in _sites(config)}
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
