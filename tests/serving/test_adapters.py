"""LoRA adapters served per request: an adapter row against the merged model (the oracle), base
rows bitwise against an engine without adapters while adapter rows share their steps, the
fused decode step kept for base rows, and the adapter registry's refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from glassformer.accel.quantize import quantize_model
from glassformer.generation.config import GenerationConfig
from glassformer.serving import Engine, EngineConfig, RequestParams
from glassformer.serving.errors import AdapterInUse, UnknownAdapter
from glassformer.training.lora import LoRAConfig, add_lora, merge_lora, save_adapter

ENGINE = EngineConfig(block_size=4, n_blocks=64, max_batch=8, token_budget=64)  # no prompt split


def adapter_folder(model, folder, seed: int, targets=("q", "k", "v", "o", "gate", "up", "down"), rank=2):
    """A PEFT adapter for `model` with random A and B (B is zero at init: it would change nothing)."""
    wrapped = copy.deepcopy(model)
    config = LoRAConfig(rank, 4.0, targets=targets)
    add_lora(wrapped, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    folder.mkdir()
    save_adapter(folder, wrapped, config, "")
    return folder, merge_lora(wrapped)


def chosen_logprobs(model, prompt, generated):
    """The log-probability the model gives each generated token, teacher-forced: the oracle."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated]))[0].float()  # (T, V)
    rows = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return rows[torch.arange(len(generated)), torch.tensor(generated)]


def run(engine, requests):
    handles = [engine.submit(p, RequestParams(max_new_tokens=6, logprobs=0, adapter=a)) for p, a in requests]
    events = {h.request_id: [] for h in handles}
    while engine.has_work():
        engine.step()
    for h in handles:
        events[h.request_id] = [e.logprobs.logprob for e in h]
    return [(h.result.generated_ids, events[h.request_id]) for h in handles]


@pytest.mark.parametrize("fused", [False, True])
def test_adapter_rows_equal_the_merged_model_and_base_rows_stay_bitwise(tiny, prompts, tmp_path, fused):
    model = tiny()
    first, merged_first = adapter_folder(model, tmp_path / "a", 1)
    second, merged_second = adapter_folder(model, tmp_path / "b", 2, targets=("q", "v", "down"), rank=3)
    served = quantize_model(copy.deepcopy(model), "none") if fused else model
    p = prompts([9, 5, 7])
    # the same prompt for the base and both adapters: no cached block may cross adapters
    requests = [(p[0], None), (p[0], "a"), (p[1], "b"), (p[2], None), (p[0], "b"), (p[2], "a")]
    engine = Engine(served, config=ENGINE)
    engine.load_adapter("a", str(first))
    engine.load_adapter("b", str(second))
    together = run(engine, requests)
    alone = run(Engine(served, config=ENGINE), [r for r in requests if r[1] is None])
    assert [t for t, (_, a) in zip(together, requests, strict=True) if a is None] == alone
    again = [(p[0], "a"), (p[0], "b")]  # now the prefix cache holds p[0]'s blocks three times
    together += run(engine, again)
    requests += again
    oracle = {"a": merged_first, "b": merged_second}
    for (prompt, name), (generated, logprobs) in zip(requests, together, strict=True):
        if name is not None:
            expected = chosen_logprobs(oracle[name], prompt, generated)
            torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_fused_adapter_rows_equal_the_module_path_s(tiny, prompts, tmp_path, monkeypatch, mode):
    """Adapter rows on the fused step against the same engine with its adapters refused by the
    fused step (the module path, the oracle): two adapters and base rows share each step. The
    two paths add an adapter's update in another order; int8 / int4 layers round their
    activations to 8 bits per block, so one float ulp there may move an activation a whole
    step: a few hundredths in a log-probability (seen on the AVX2 kernels, AMD EPYC Zen 3),
    the bound of tests/test_paths_property.py."""
    from glassformer.accel.fast_decode import FastDecoder
    from glassformer.serving import adapters as served_adapters

    model = tiny()
    first, _ = adapter_folder(model, tmp_path / "a", 1)
    second, _ = adapter_folder(model, tmp_path / "b", 2, targets=("q", "v", "down"), rank=3)
    served = quantize_model(copy.deepcopy(model), mode)
    p = prompts([9, 5, 7, 6])
    requests = [(p[0], "a"), (p[1], None), (p[2], "b"), (p[3], "a"), (p[1], "b"), (p[2], None)]

    def results(fused: bool):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(served_adapters, "fused_adapter", lambda *_: None)
            engine = Engine(served, config=ENGINE)
            engine.load_adapter("a", str(first))
            engine.load_adapter("b", str(second))
            assert all((engine.adapters.loaded[n].fused is not None) == fused for n in "ab")
            return run(engine, requests)

    steps = []  # each fused call's row -> adapter index
    original = FastDecoder.rows

    def rows(self, *args, **kwargs):
        adapter_of = args[6] if len(args) > 6 else kwargs.get("adapter_of")
        steps.append(None if adapter_of is None else adapter_of.tolist())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FastDecoder, "rows", rows)
    fused = results(True)
    assert any(s is not None and -1 in s and 0 in s and 1 in s for s in steps)  # all kinds in one step
    steps.clear()
    module = results(False)
    assert all(s is None for s in steps)  # the oracle's adapter rows never took the fused step
    alone = run(Engine(served, config=ENGINE), [r for r in requests if r[1] is None])
    assert [t for t, (_, a) in zip(fused, requests, strict=True) if a is None] == alone  # bitwise
    tolerance = 1e-5 if mode == "none" else 3e-2
    for (tokens, logprobs), (expected_tokens, expected) in zip(fused, module, strict=True):
        assert tokens == expected_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), atol=tolerance, rtol=1e-5)


def test_without_row_tiles_adapter_rows_still_equal_the_merged_model(tiny, prompts, tmp_path):
    model = tiny()
    folder, merged = adapter_folder(model, tmp_path / "a", 3)
    engine = Engine(model, config=EngineConfig(block_size=4, n_blocks=64, batch_invariant=False))
    engine.load_adapter("a", str(folder))
    p = prompts([6, 8])
    for (generated, logprobs), prompt in zip(run(engine, [(p[0], "a"), (p[1], "a")]), p, strict=True):
        torch.testing.assert_close(torch.tensor(logprobs), chosen_logprobs(merged, prompt, generated),
                                   atol=1e-5, rtol=1e-5)
    assert not any("lora" in name for name, _ in model.named_modules())  # the model is untouched


def test_bad_adapters_are_refused_and_change_nothing(tiny, tmp_path):
    model = tiny()
    engine = Engine(model, config=ENGINE)
    good, _ = adapter_folder(model, tmp_path / "good", 1)
    other, _ = adapter_folder(tiny(d_model=48, d_ff=96), tmp_path / "other", 1)
    with pytest.raises(ValueError, match="^lora_path: no LoRA adapter"):
        engine.load_adapter("x", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="another base"):
        engine.load_adapter("x", str(other))
    config = (good / "adapter_config.json").read_text()
    (good / "adapter_config.json").write_text(config.replace('"r": 2', '"r": 4'))
    with pytest.raises(ValueError, match="another rank"):
        engine.load_adapter("x", str(good))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    named = Engine(model, config=ENGINE, base=str(tmp_path / "one"))  # the adapter names another base
    settings = json.loads((good / "adapter_config.json").read_text())
    settings |= {"r": 2, "base_model_name_or_path": str(tmp_path / "two")}
    (good / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="the adapter was trained on"):
        named.load_adapter("x", str(good))
    assert not engine.adapters.loaded and not named.adapters.loaded
    with pytest.raises(ValueError, match="^adapter: no LoRA adapter named 'x'"):
        engine.submit([1, 2], RequestParams(adapter="x"))
    with pytest.raises(TypeError, match="'adapter'"):  # generate applies an adapter to the model
        GenerationConfig(adapter="x")


def test_an_adapter_in_use_is_not_unloaded(tiny, tmp_path):
    model = tiny()
    folder, _ = adapter_folder(model, tmp_path / "a", 1)
    engine = Engine(model, config=ENGINE)
    engine.load_adapter("a", str(folder))
    with pytest.raises(ValueError, match="loaded already"):
        engine.load_adapter("a", str(folder))
    handle = engine.submit([1, 2, 3], RequestParams(max_new_tokens=3, adapter="a"))
    engine.step()
    with pytest.raises(AdapterInUse, match="in use by 1"):
        engine.unload_adapter("a")
    engine.run_until_done()
    assert handle.result.stop_reason == "max_new_tokens"
    engine.unload_adapter("a")
    with pytest.raises(UnknownAdapter, match="lora_name: no adapter named 'a'"):
        engine.unload_adapter("a")


@pytest.fixture(scope="module")
def peft_pair(tmp_path_factory):
    """A tiny Hugging Face Llama and an adapter made by peft itself (random B), both on disk."""
    peft = pytest.importorskip("peft")
    from llama_folder import llama_folder

    folder = tmp_path_factory.mktemp("peft")
    hf = llama_folder(folder / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapted = peft.get_peft_model(hf, config).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    adapted.save_pretrained(folder / "adapter")
    return folder / "base", folder / "adapter", adapted


def test_a_peft_adapter_served_gives_peft_s_logits(peft_pair):
    from glassformer import load

    base, adapter, adapted = peft_pair
    language_model = load(base)
    engine = Engine(language_model.model, config=ENGINE, base=str(base))
    engine.load_adapter("peft", str(adapter))
    prompt = language_model.encode("the quick brown fox")
    [(generated, logprobs), _] = run(engine, [(prompt, "peft"), (prompt, None)])
    with torch.no_grad():
        logits = adapted(torch.tensor([prompt + generated])).logits[0]  # (T, V)
    oracle = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)[torch.arange(len(generated)), generated]
    torch.testing.assert_close(torch.tensor(logprobs), oracle, atol=1e-5, rtol=1e-5)


def test_generate_lora_and_generate_many_equal_the_merged_model(peft_pair, tmp_path, capsys):
    from glassformer import load
    from glassformer.cli import main

    base, adapter, _ = peft_pair
    merged = tmp_path / "merged"
    assert main(["export", "--model", str(base), "--merge-lora", str(adapter), "-o", str(merged)]) == 0
    capsys.readouterr()
    answers = []
    for args in (["--model", str(base), "--lora", str(adapter)], ["--model", str(merged)]):
        assert main(["generate", "the lazy dog", "-n", "8", "--json", *args]) == 0
        answers.append(json.loads(capsys.readouterr().out)["generated_ids"])
    assert answers[0] == answers[1]
    many = load(base).generate_many(["the lazy dog", "pack my box"], max_new_tokens=8,
                                    adapters={"mine": adapter}, adapter="mine")
    assert many[0].generated_ids == answers[1]
    assert many[1].generated_ids == load(merged).generate("pack my box", max_new_tokens=8).generated_ids
    missing = tmp_path / "none"
    for command, says in ((["generate", "x", "--lora", str(missing)], "no LoRA adapter"),
                          (["serve", "--lora", f"x={missing}"], "lora_path: no LoRA adapter"),
                          (["serve", "--name", "t", "--lora", f"t={adapter}"], "the base model's name")):
        assert main([*command, "--model", str(base)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0]
