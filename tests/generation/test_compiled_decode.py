"""The compiled one-token step (generation/compiled.py) against the module path: no graph
break, no recompile once warm, the same greedy tokens, logits within float32 rounding, and a
clear refusal for each request it cannot compute.

Each model compiles once for the whole file (the cache shapes are the same in every test:
generate rounds its cache to the window), so the models are module-scoped."""

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.cli import main
from glassformer.errors import InputError
from glassformer.formats import checkpoint
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation import compiled
from glassformer.generation.chat import ChatSession
from glassformer.generation.compiled import CompiledStep, static_step
from glassformer.generation.core import decode_one_token, prefill
from glassformer.generation.generate import GenerationConfig, generate, generate_batch
from glassformer.model.encoder_decoder import build_model
from glassformer.model.kv_cache import KVCache
from glassformer.model.sink import SinkPolicy

PROMPT = [3, 17, 42, 8, 99, 23, 5]
STEPS = 64


@pytest.fixture(scope="module")
def gpt2_model() -> Transformer:
    """A tiny random GPT-2-style model: learned positions, LayerNorm, GELU, biases, tied head."""
    torch.manual_seed(1)
    config = get_preset("tiny-gpt2").replace(vocab_size=280, context_length=128, init_std=0.3)
    return Transformer(config).eval()


@pytest.fixture(scope="module")
def models(chat_model, gpt2_model) -> dict[str, Transformer]:
    """The conftest's tiny Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention)
    and the GPT-2-style one."""
    return {"llama": chat_model[0], "gpt2": gpt2_model}


def greedy(steps: int = STEPS, **fields) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=steps, eos_ids=(), **fields)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_tokens_equal_the_module_path_with_no_recompile(models, name, monkeypatch):
    model = models[name]
    expected = generate(model, PROMPT, greedy())
    assert len(set(expected.generated_ids)) > 4  # a text that can tell two paths apart
    generate(model, PROMPT[:3], greedy(steps=4, compile=True))  # warm-up: compiles once
    steps, step = [], compiled._STEP
    monkeypatch.setattr(compiled, "_STEP", lambda *inputs: steps.append(1) or step(*inputs))
    with torch.compiler.set_stance("fail_on_recompile"):
        got = generate(model, PROMPT, greedy(compile=True))
    assert got.generated_ids == expected.generated_ids
    assert len(steps) == got.decode_steps == STEPS - 1  # every step the compiled one


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_logits_match_decode_one_token(models, name):
    model = models[name]
    length = model.config.context_length  # generate's compiled cache: rounded to the window
    caches = [KVCache(model.config, 1, max_length=length) for _ in range(2)]
    step = CompiledStep(model)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])  # (1, T)
        logits = [prefill(model, ids, cache) for cache in caches]
        for _ in range(16):
            token = logits[0].argmax(-1)  # (1,)
            logits = [decode_one_token(model, token, caches[0]), step(token, caches[1])]
            torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert caches[1].length == caches[0].length == len(PROMPT) + 16


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_no_graph_break(models, name):
    model = models[name]
    cache = KVCache(model.config, 1, max_length=model.config.context_length)
    with torch.inference_mode():
        prefill(model, torch.tensor([PROMPT]), cache)
        slot = torch.tensor([cache.length])
        explained = torch._dynamo.explain(static_step)(
            model, torch.tensor([7]), slot, cache.keys, cache.values, cache.positions, cache.valid)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_left_padded_batch_equals_the_module_path(models):
    model = models["llama"]
    prompts = [PROMPT, PROMPT[2:], [11, 12]]
    expected = generate_batch(model, prompts, greedy(steps=12))
    got = generate_batch(model, prompts, greedy(steps=12, compile=True))
    assert [r.generated_ids for r in got] == [r.generated_ids for r in expected]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_a_plain_kv_dtype_equals_the_module_path(models, kv_dtype):
    """Keys stored in the kv_dtype and read back in the model's, as the dense cache does."""
    model = models["gpt2"]
    expected = generate(model, PROMPT, greedy(steps=16, kv_dtype=kv_dtype))
    got = generate(model, PROMPT, greedy(steps=16, kv_dtype=kv_dtype, compile=True))
    assert got.generated_ids == expected.generated_ids


def test_chat_turns_equal_the_module_path(chat_model):
    model, tokenizer = chat_model
    replies = []
    for compile in (False, True):
        session = ChatSession(model, tokenizer, max_new_tokens=8, max_context=256, seed=0,
                              compile=compile)
        replies.append([("".join(session.reply(text)), session.last_prefill)
                        for text in ("hello there", "how are you today?")])
    assert replies[1] == replies[0]


@pytest.mark.parametrize("fields", [
    {"beams": 2}, {"use_cache": False}, {"kv_dtype": "int8"}, {"kv_dtype": "fp8"},
    {"sink": SinkPolicy(2, 8)},
])
def test_refuses_what_the_request_needs(fields):
    with pytest.raises(InputError, match="compile") as refused:
        greedy(compile=True, **fields)
    assert refused.value.field == "compile" and "\n" not in str(refused.value)


def tiny(name: str, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(get_preset(name).replace(**fields)).eval()


@pytest.mark.parametrize("model, reason", [
    (lambda: tiny("tiny-t5"), "encoder-decoder"),
    (lambda: tiny("tiny-bidirectional"), "bidirectional"),
    (lambda: tiny("tiny-llama", attention_kernel="flash"), "flash"),
])
def test_refuses_what_the_model_needs(model, reason):
    with pytest.raises(InputError, match=reason) as refused:
        generate(model(), PROMPT[:3], greedy(steps=2, compile=True))
    assert refused.value.field == "compile"


def test_refuses_hooks_and_a_fused_step():
    model = tiny("tiny-llama")
    with model.hooks.installed({"blocks.0.resid_post": lambda t, site: t * 2}):
        with pytest.raises(InputError, match="hooks"):
            generate(model, PROMPT[:3], greedy(steps=2, compile=True))
    model.install_fused_step(lambda m: None)
    with pytest.raises(InputError, match="fused C\\+\\+ step"):
        generate(model, PROMPT[:3], greedy(steps=2, compile=True))
    with pytest.raises(InputError, match="fused"):
        ChatSession(model, type("T", (), {"chat_template": "x"})(), compile=True)



@pytest.mark.parametrize("command, flags, named", [
    (["generate", "hi"], ["--beams", "2"], "compile: beam search"),
    (["generate", "hi"], ["--no-cache"], "compile: the compiled step decodes against the KV cache"),
])
def test_the_command_refuses_in_one_line(command, flags, named, capsys):
    assert main([*command, "--model", "never-read", "--compile", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]


@pytest.mark.parametrize("command", [["generate", "hi"], ["generate", "--prompts-file"],
                                     ["serve", "--port", "0"]])
def test_a_converted_model_is_refused_the_compiled_step_in_one_line(command, kernels, tmp_path, capsys):
    """The compiled step (generate; chat's ChatSession above) and the engine's graph executor
    (generate's prompts file, serve) each refuse the fused C++ step's model, in the same words."""
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-llama").replace(vocab_size=300)).eval()
    tokenizer = HFTokenizer.train_bpe(["the cat sat on the mat"] * 9, 300)
    checkpoint.save_to_run(tmp_path / "run", 1, ("latest",), model, tokenizer, {})
    if "--prompts-file" in command:
        (tmp_path / "prompts.jsonl").write_text('{"prompt": "the cat"}\n', encoding="utf-8")
        command = [*command, str(tmp_path / "prompts.jsonl")]
    assert main([*command, "--model", str(tmp_path / "run"), "--compile", "--quantize", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--compile: compiles the plain PyTorch weights; not with --quantize (a fused C++ step)" in err[-1]
    assert not any("Traceback" in line for line in err)
