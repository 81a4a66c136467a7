import pytest
import torch

from glassformer import Transformer, get_preset


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread (two cost more in synchronisation than they save)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny():
    """A tiny Llama-shaped model whose large init spreads the logits (clear argmaxes)."""

    def build(name: str = "tiny-llama", **changes) -> Transformer:
        torch.manual_seed(0)
        return Transformer(get_preset(name).replace(init_std=0.3, context_length=64, **changes)).eval()

    return build


@pytest.fixture
def prompts():
    """Random token prompts of the given lengths."""

    def make(lengths, seed: int = 1, vocab: int = 96) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

    return make
