"""Prefill memory against prompt length: no kernel builds an n × n matrix, so the largest
tensor any operation makes during a prefill (whole or in chunks through the cache) grows
linearly with the prompt; the reference kernel, which returns the n × n weights, is the
counter-example the measurement must catch."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from glassformer import Transformer, get_preset
from glassformer.generation.context_extension import extend_context
from glassformer.generation.core import prefill
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.kv_cache import KVCache


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any aten operation returns while active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _largest(kernel: str, n: int, chunk: int | None) -> int:
    torch.manual_seed(0)
    config = get_preset("tiny-llama").replace(context_length=512, n_layers=1, attention_kernel=kernel)
    model = Transformer(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, n))
    cache = KVCache(config, 1, max_length=n)
    with torch.inference_mode(), LargestTensor() as seen:
        for start in range(0, n, chunk or n):
            prefill(model, ids[:, start : start + (chunk or n)], cache)
    return seen.bytes


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
def test_prefill_memory_grows_linearly_with_the_prompt(kernel, chunk):
    small, large = _largest(kernel, 128, chunk), _largest(kernel, 512, chunk)
    assert large <= 4 * small  # 4 × the tokens: at most 4 × the memory (n × n would be 16 ×)


def test_the_measurement_sees_an_n_by_n_matrix():
    small, large = _largest("reference", 128, None), _largest("reference", 512, None)
    assert large == 16 * small  # the (B, H, n, n) weights


def test_sdpa_prefill_runs_pytorchs_flash_kernel():
    config = get_preset("tiny-llama").replace(n_layers=1, context_length=96)
    model = Transformer(config).eval()
    cache = KVCache(config, 1)
    with torch.inference_mode(), torch.profiler.profile() as profile:
        prefill(model, torch.randint(0, config.vocab_size, (1, 64)), cache)  # whole: is_causal
        prefill(model, torch.randint(0, config.vocab_size, (1, 32)), cache)  # a chunk: a bias
    names = [event.name for event in profile.events()]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 2
    assert not any("attention_math" in name for name in names)


def test_a_prompt_past_the_window_is_refused_in_one_line_or_read_with_the_window_extended():
    model = Transformer(get_preset("tiny-llama").replace(context_length=64)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (100,)).tolist()
    config = GenerationConfig(max_new_tokens=2, eos_ids=())
    with pytest.raises(ValueError, match=r"^prompt: 100 tokens exceed the model's context_length=64 [^\n]*$"):
        generate(model, prompt, config)
    extended = extend_context(model, "yarn", 2.0)
    assert extended.config.context_length == 128
    assert generate(extended, prompt, config).n_generated == 2
