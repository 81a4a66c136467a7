"""The fused C++ decode step against the module path on one model (the oracle: the same
converted model run through its own modules), in each weight format the step takes: the step
is taken, its logits are the module path's step by step, its greedy tokens are the module
path's, `generate` takes it, and the serving engine's rows over the paged pool give the same
tokens as `generate`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from glassformer import KVCache, Transformer
from glassformer.accel.fast_decode import FastDecoder, why_not
from glassformer.accel.quantize import quantize_model
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.serving import Engine, EngineConfig, RequestParams

# Logits of the step against the module path on the same weights, relative and in units of
# the logits' spread (their standard deviation, at least 1). float32: summation order only.
# int8 / int4 round each product's activations to 8 bits per block, so a one-ulp difference
# upstream may move an activation by a whole step, and through the cache every later token
# (Gemma 2 at head_dim 256: 2% of the spread seen).
TOLERANCE = {"none": 1e-4, "int8": 5e-2, "int4": 5e-2}


def check_fused_step(load: Callable[[], Transformer], prompt: list[int], new: int = 16) -> None:
    """For each format of TOLERANCE, a fresh `load()` converted to it: the checks above."""
    for fmt, tolerance in TOLERANCE.items():
        model = quantize_model(load(), fmt)
        with torch.no_grad():
            assert why_not(model) is None, f"{fmt}: {why_not(model)}"
            step = model.fused_step()
            assert isinstance(step, FastDecoder)
            tokens = _stepped_alike(model, step, prompt, new, tolerance, fmt)
        assert generate(model, prompt, GenerationConfig(max_new_tokens=new, eos_ids=())
                        ).generated_ids == tokens, fmt
        rows = []
        step.rows = _counted(step.rows, rows)  # the engine's calls to this model's step
        engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64, token_budget=8,
                                                  max_batch=4))
        handle = engine.submit(prompt, RequestParams(max_new_tokens=new, eos_ids=()))
        engine.run_until_done()
        assert rows and handle.result.generated_ids == tokens, fmt


def _stepped_alike(model: Transformer, step: FastDecoder, prompt: list[int], new: int,
                   tolerance: float, fmt: str) -> list[int]:
    """The module path's `new` greedy tokens after `prompt`; at each, the step's logits (fed
    the same token, its own cache) within `tolerance` of the module path's (TOLERANCE), and the
    same argmax."""
    ids = torch.tensor([prompt])  # (1, T)
    fused_cache, module_cache = KVCache(model.config, 1), KVCache(model.config, 1)
    model(ids[:, :-1], cache=fused_cache)
    model(ids[:, :-1], cache=module_cache)
    token, tokens = ids[0, -1:], []
    for t in range(new):
        expected = model(token[None], cache=module_cache)[0, -1]  # (V,)
        fused = step(token, fused_cache)[0]  # (V,)
        spread = max(1.0, float(expected.std()))
        torch.testing.assert_close(fused, expected, atol=tolerance * spread, rtol=tolerance,
                                   msg=lambda m, t=t: f"{fmt}, token {t}: {m}")
        token = expected.argmax()[None]
        assert int(fused.argmax()) == int(token), f"{fmt}: greedy token {t} differs"
        tokens.append(int(token))
    return tokens


def _counted(rows: Callable, calls: list) -> Callable:
    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return rows(*args, **kwargs)
    return counted
