"""LoRA against peft (the oracle): a tiny Llama built in transformers, converted by Glassformer's
Hugging Face loader; the same adapter weights give the same logits and gradients; an adapter
trained here loads in peft.PeftModel on the exported base; merged equals unmerged; bad input
is one line and leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import torch
from llama_folder import TEXT, llama_folder
from safetensors.torch import load_file

from glassformer import load
from glassformer.cli import main
from glassformer.formats.checkpoint import write_checkpoint
from glassformer.formats.export import export_hf
from glassformer.formats.huggingface import load_hf
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.model.config import ModelConfig
from glassformer.model.transformer import Transformer
from glassformer.training.config import TrainConfig
from glassformer.training.loop import train
from glassformer.training.lora import (
    TARGETS,
    LoRAConfig,
    LoRALinear,
    adapter_tensors,
    add_lora,
    apply_adapter,
    merge_lora,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(base, **changes) -> TrainConfig:
    fields = dict(batch_size=2, max_iters=2, warmup_iters=0, eval_interval=2, eval_iters=1,
                  log_interval=1, sample_tokens=0, device="cpu", lr=1e-2, init=str(base),
                  lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,gate,down")
    return TrainConfig(**fields | changes)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    llama_folder(folder)
    return folder


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def _peft_model(folder, adapter=None):
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    if adapter is not None:
        return peft.PeftModel.from_pretrained(reference, adapter).eval()
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=PEFT_TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(reference, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: give the update something to say
                p.normal_(0, 0.2)
    return model.eval()


def test_logits_and_gradients_match_peft(base, tmp_path):
    reference = _peft_model(base)
    reference.save_pretrained(tmp_path / "adapter")
    model, _ = load_hf(base)
    config = apply_adapter(model, tmp_path / "adapter")
    assert config == LoRAConfig(4, 12, 0.0, TARGETS)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 2 * 4  # qkv, out, up, down

    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 11, 300, generator=torch.Generator().manual_seed(1))
    ours, theirs = model(ids), reference(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    named = dict(reference.named_parameters())
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
    # the gradients sum 22 rows x 300 logits in PyTorch's BLAS order, which differs by CPU:
    # on AMD EPYC (Zen 3) one of 128 entries moved 1.6e-4 of a gradient near 0.3
    for i, t in adapter_tensors(model):
        key = f"base_model.model.model.layers.{i}.{names[t]}.lora_{{}}.default.weight"
        layer = next(m for m in model.blocks[i].modules() if isinstance(m, LoRALinear) and t in m.slices)
        torch.testing.assert_close(layer.lora_A[t].grad, named[key.format("A")].grad, atol=5e-4, rtol=1e-4)
        torch.testing.assert_close(layer.lora_B[t].grad, named[key.format("B")].grad, atol=5e-4, rtol=1e-4)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_merged_equals_unmerged(base, tmp_path):
    _peft_model(base).save_pretrained(tmp_path / "adapter")
    model, _ = load_hf(base)
    apply_adapter(model, tmp_path / "adapter")
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        unmerged = model(ids)
        merged = merge_lora(model)(ids)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


def test_trained_adapter_loads_in_peft_on_the_exported_base(base, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    summary = train(corpus, out, {"context_length": 16}, _config(base), progress=False)
    latest = out / "latest"
    assert not (latest / "model.safetensors").exists()
    saved = json.loads((latest / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8.0
    assert saved["base_model_name_or_path"] == str(base.resolve())
    adapter = load_file(str(latest / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * 5  # layers x targets x (A, B)
    n_adapter = sum(t.numel() for t in adapter.values())
    assert summary["trainable_parameters"] == n_adapter
    moments = load_file(str(latest / "training_state.safetensors"))  # AdamW's, adapters only
    assert sum(t.numel() for k, t in moments.items() if k.endswith("exp_avg")) == n_adapter

    lm = load(str(base))
    export_hf(lm.model, lm.tokenizer, tmp_path / "exported")
    reference = _peft_model(tmp_path / "exported", latest)
    model, _ = load_hf(base)
    apply_adapter(model, out, base=str(base))
    ids = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, plain = model(ids), load_hf(base)[0](ids)
        torch.testing.assert_close(ours, reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert (ours - plain).abs().max() > 1e-3  # the adapter learned something
    with pytest.raises(ValueError, match="holds a LoRA adapter, not a whole model"):
        load(out)

    # glassformer export --merge-lora: the folded model gives the adapted logits
    merged = tmp_path / "merged"
    assert main(["export", "--model", str(base), "--merge-lora", str(out), "-o", str(merged)]) == 0
    with torch.no_grad():
        torch.testing.assert_close(load(merged).model(ids), ours, atol=1e-5, rtol=1e-5)
    # an adapter for another base (by name) is refused, nothing written
    capsys.readouterr()
    assert main(["export", "--model", str(merged), "--merge-lora", str(out), "-o",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the adapter was trained on" in err[0]
    assert not (tmp_path / "x").exists()


def test_resume_is_exact(base, corpus, tmp_path):
    config = _config(base, max_iters=4, lr_decay_iters=4, lora_dropout=0.1)
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(corpus, whole, {"context_length": 16}, config, progress=False)
    train(corpus, split, {"context_length": 16}, config.replace(max_iters=2), progress=False)
    train(corpus, split, None, config, resume=True, progress=False)
    a = load_file(str(whole / "latest" / "adapter_model.safetensors"))
    b = load_file(str(split / "latest" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_adapter_for_another_shape_is_refused(base, tmp_path):
    _peft_model(base).save_pretrained(tmp_path / "adapter")
    config = ModelConfig(vocab_size=300, context_length=16, d_model=16, n_layers=2, n_heads=4,
                         n_kv_heads=2, position="rope", norm="rmsnorm", activation="silu",
                         gated=True, d_ff=64)
    with pytest.raises(ValueError, match="an adapter for another base$"):
        apply_adapter(Transformer(config), tmp_path / "adapter")
    # the base it names, when it can be found here, must be the one given
    adapter_config = tmp_path / "adapter" / "adapter_config.json"
    assert json.loads(adapter_config.read_text())["base_model_name_or_path"] == str(base)
    with pytest.raises(ValueError, match="the adapter was trained on"):
        apply_adapter(load_hf(base)[0], tmp_path / "adapter", base=str(tmp_path))
    # a base named by a hub id cannot be found here: the shapes decide
    adapter_config.write_text(json.dumps(json.loads(adapter_config.read_text())
                                         | {"base_model_name_or_path": "elsewhere/llama"}))
    apply_adapter(load_hf(base)[0], tmp_path / "adapter", base=str(base))


def test_frozen_base_and_zero_start():
    config = ModelConfig(vocab_size=20, context_length=8, d_model=16, n_layers=1, n_heads=2,
                         position="rope", gated=True, activation="silu")
    model = Transformer(config)
    ids = torch.randint(0, 20, (1, 8))
    with torch.no_grad():
        before = model(ids)
    add_lora(model, LoRAConfig(2, 4.0, targets=("k", "up")))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)  # B starts at zero
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["blocks.0.attn.qkv.lora_A.k", "blocks.0.attn.qkv.lora_B.k",
                         "blocks.0.mlp.up.lora_A.up", "blocks.0.mlp.up.lora_B.up"]
    assert model.blocks[0].mlp.up.lora_B["up"].shape == (config.ff_dim, 2)


@pytest.fixture()
def plain_checkpoint(tmp_path):
    """A tiny model without a gated feed-forward, saved as a Glassformer checkpoint."""
    tokenizer = CharTokenizer("".join(sorted(set(TEXT))))
    config = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=16, d_model=16,
                         n_layers=1, n_heads=2)
    write_checkpoint(tmp_path / "plain", Transformer(config), tokenizer, {})
    return tmp_path / "plain"


@pytest.mark.parametrize("flags, message", [
    (["--lora-targets", "gate"], "--lora-targets: this model has no 'gate' projection"),
    (["--lora-targets", "q,bogus"], "--lora-targets: 'q,bogus': give distinct names"),
    (["--lora-rank", "0"], "--lora-rank: must be an integer >= 1, got 0"),
])
def test_bad_lora_flags_are_one_line(plain_checkpoint, corpus, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    args = ["train", "--init", str(plain_checkpoint), "--data", str(corpus), "--out", str(out),
            "--lora-rank", "2", "--max-iters", "1", "--no-progress", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_lora_without_init_is_refused():
    with pytest.raises(ValueError, match="^lora_rank: LoRA adapts a pretrained model"):
        TrainConfig(lora_rank=4)


@pytest.mark.slow
def test_smollm2_adapter_in_peft(smollm2_path, corpus, tmp_path):
    config = _config(smollm2_path, batch_size=1, max_iters=1, eval_interval=1, lr=1e-3,
                     lora_targets="q,k,v,o,gate,up,down")
    train(corpus, tmp_path / "run", {"context_length": 32}, config, progress=False)
    base = load(smollm2_path)
    export_hf(base.model, base.tokenizer, tmp_path / "exported")
    reference = _peft_model(tmp_path / "exported", tmp_path / "run" / "latest")
    apply_adapter(base.model, tmp_path / "run", base=str(smollm2_path))
    ids = torch.tensor([base.tokenizer.encode("The king spoke to his people")])
    with torch.no_grad():
        torch.testing.assert_close(base.model(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)
