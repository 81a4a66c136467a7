"""Glassformer against a reference implementation, layer by layer, on the same weights and tokens.

For each place in the forward pass (embeddings; each block's attention output and residual
stream; the final norm, or an encoder's masked-LM transform; the logits) the largest absolute
difference is reported, and the first place that exceeds `atol + rtol · max|reference|` is
named: a wrong port shows where it starts.

The reference is Hugging Face `transformers` (an optional dependency, imported only here):
ours are read at our hook sites, theirs with forward hooks on the matching submodules. An
encoder-decoder (T5) reads the tokens as its source and, behind its start token, as the
decoder's input; its places are each stack's blocks (self- and cross-attention outputs,
residual streams) and final norm, then the logits.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..formats import hub
from ..formats.families import BY_MODEL_TYPE
from ..formats.files import read_json_object
from ..model.encoder_decoder import EncoderDecoder
from ..model.transformer import Transformer
from .trace import capture


@dataclass(frozen=True)
class SiteDiff:
    site: str  # our hook site name
    max_abs_diff: float
    tolerance: float
    reference_max: float  # max |reference| at this site, for scale

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


@dataclass(frozen=True)
class Comparison:
    sites: list[SiteDiff]
    n_tokens: int

    @property
    def first_failure(self) -> SiteDiff | None:
        return next((s for s in self.sites if not s.ok), None)

    def to_dict(self) -> dict[str, Any]:
        failure = self.first_failure
        return {"n_tokens": self.n_tokens, "ok": failure is None,
                "first_failure": None if failure is None else failure.site,
                "sites": [asdict(s) | {"ok": s.ok} for s in self.sites]}


def sites(n_layers: int, final_norm: bool = True, head_transform: bool = False) -> list[str]:
    """The compared places, in forward order, as our hook site names."""
    names = ["embed.out"]
    for i in range(n_layers):
        names += [f"blocks.{i}.attn.out", f"blocks.{i}.resid_post"]
    names += ["final_norm"] * final_norm + ["head_transform"] * head_transform
    return [*names, "logits"]


def seq2seq_sites(n_encoder_layers: int, n_layers: int) -> list[str]:
    """An encoder-decoder's compared places, in forward order."""
    names = [f"encoder.blocks.{i}.{site}" for i in range(n_encoder_layers)
             for site in ("attn.out", "resid_post")]
    names += ["encoder.final_norm"]
    names += [f"decoder.blocks.{i}.{site}" for i in range(n_layers)
              for site in ("attn.out", "cross.out", "resid_post")]
    return [*names, "decoder.final_norm", "logits"]


def compare(model: Transformer | EncoderDecoder, reference: torch.nn.Module, ids: torch.Tensor,
            atol: float = 1e-4, rtol: float = 1e-4) -> Comparison:
    """Run both on ids (1, T) and diff every site."""
    if isinstance(model, EncoderDecoder):
        start = torch.full_like(ids[:, :1], model.config.decoder_start_id)
        decoder_ids = torch.cat([start, ids[:, :-1]], dim=1)  # (1, T): the tokens, shifted right
        theirs = seq2seq_activations(reference, ids, decoder_ids)
        with torch.no_grad(), capture(model, list(theirs)) as ours:
            model(ids, decoder_ids)
    else:
        theirs = reference_activations(reference, ids)
        with torch.no_grad(), capture(model, list(theirs)) as ours:
            model(ids)
    rows = []
    for site, expected in theirs.items():
        diff = (ours[site].float() - expected.float()).abs().max().item()
        scale = expected.abs().max().item()
        rows.append(SiteDiff(site, diff, atol + rtol * scale, scale))
    return Comparison(rows, ids.shape[1])


def reference_activations(reference: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference's tensors at our sites, from output_hidden_states and forward hooks."""
    kind = reference.config.model_type
    family = BY_MODEL_TYPE.get(kind)
    layout = None if family is None else family.compare  # where its model keeps each place
    if layout is None:
        raise InputError("compare", f"no layout for reference model_type {kind!r}")
    base = reference.get_submodule(layout.base)
    layers = base.get_submodule(layout.layers)
    found: dict[str, torch.Tensor] = {}

    def keep(site: str):
        def hook(module, args, output):
            found[site] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.get_submodule(layout.attention).register_forward_hook(keep(f"blocks.{i}.attn.out")))
        handles.append(layer.register_forward_hook(keep(f"blocks.{i}.resid_post")))
    if layout.final_norm is not None:
        handles.append(base.get_submodule(layout.final_norm).register_forward_hook(keep("final_norm")))
    if layout.head_transform is not None:
        transform = reference.get_submodule(layout.head_transform)
        handles.append(transform.register_forward_hook(keep("head_transform")))
    options = {"use_cache": False} if layout.final_norm is not None else {}  # an encoder has no cache
    try:
        with torch.no_grad():
            out = reference(ids, output_hidden_states=True, **options)
    finally:
        for handle in handles:
            handle.remove()
    found["embed.out"] = out.hidden_states[0]
    found["logits"] = out.logits
    return {site: found[site] for site in sites(len(layers), layout.final_norm is not None,
                                                layout.head_transform is not None)}


def seq2seq_activations(reference: torch.nn.Module, ids: torch.Tensor,
                        decoder_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A T5 reference's tensors at our encoder-decoder sites, from forward hooks."""
    if reference.config.model_type != "t5":
        raise InputError("compare", f"no layout for reference model_type {reference.config.model_type!r}")
    found: dict[str, torch.Tensor] = {}

    def keep(site: str):
        def hook(module, args, output):
            found[site] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    modules = {}
    for stack in ("encoder", "decoder"):
        for i, block in enumerate(getattr(reference, stack).block):
            modules[f"{stack}.blocks.{i}.attn.out"] = block.layer[0].SelfAttention
            if stack == "decoder":
                modules[f"{stack}.blocks.{i}.cross.out"] = block.layer[1].EncDecAttention
            modules[f"{stack}.blocks.{i}.resid_post"] = block
        modules[f"{stack}.final_norm"] = getattr(reference, stack).final_layer_norm
    handles = [module.register_forward_hook(keep(site)) for site, module in modules.items()]
    try:
        with torch.no_grad():
            found["logits"] = reference(input_ids=ids, decoder_input_ids=decoder_ids,
                                        use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    sites = seq2seq_sites(len(reference.encoder.block), len(reference.decoder.block))
    return {site: found[site] for site in sites}


def hf_reference(source: str, model: Transformer | EncoderDecoder, tokenizer: Any) -> torch.nn.Module:
    """transformers' model for `source`: the GGUF or Hugging Face folder itself, or, for a
    Glassformer checkpoint, our weights exported to a Hugging Face folder."""
    try:
        import transformers
    except ImportError:
        raise InputError(None,
                         "compare --reference hf needs transformers: pip install transformers") from None
    path = Path(source).expanduser()
    if not path.exists() and source in hub.MODELS:
        path = hub.model_path(source)
    auto = transformers.AutoModelForCausalLM
    if model.config.n_encoder_layers:
        auto = transformers.AutoModelForSeq2SeqLM
    elif not model.config.causal:
        auto = transformers.AutoModelForMaskedLM

    def load(folder: Path, **kwargs: Any) -> torch.nn.Module:
        return auto.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **kwargs)

    config_path = path / "config.json"
    if path.is_file():
        reference = load(path.parent, gguf_file=path.name)
    elif config_path.is_file() and "model_type" in read_json_object(config_path):
        reference = load(path)
    else:
        from ..formats.export import export_hf

        with tempfile.TemporaryDirectory() as tmp:
            folder = export_hf(model, tokenizer, Path(tmp) / "hf")
            reference = load(folder)
    return reference.eval()
