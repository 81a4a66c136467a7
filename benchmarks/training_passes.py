"""Training's C++ passes against PyTorch's own, forward and backward, at the `shakespeare-char`
preset's sizes (batch 12, context 64, d_model 128, 4 heads of 32, d_ff 512): attention
(PyTorch's fused scaled_dot_product_attention; also at SmolLM2's fine-tuning sizes: batch 4,
sequence 512, 9 query heads of 64 on 3 key heads), exact GELU (F.gelu), LayerNorm without bias
(F.layer_norm) and the clipping of the preset model's gradients (clip_grad_norm_, foreach);
and, for the fast preset's Muon matrices in float32, the Newton–Schulz iterations (the direct
iteration vs the one on the Gram matrix) and the whole Muon step (StackedMuon's PyTorch ops
vs its one C++ call).
Interleaved rounds of --calls calls each; prints µs per call (median, min, max of the rounds)
and the ratio of the medians.

    python benchmarks/training_passes.py [--repeats 7] [--calls 50]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/training_passes.py      # as on a CPU with AVX2 only
"""

from __future__ import annotations

import argparse
from unittest import mock

import harness
import torch
import torch.nn.functional as F

from glassformer.accel import attention, fused, kernels
from glassformer.accel.fast_training import clip_grad_norm_
from glassformer.model.encoder_decoder import build_model
from glassformer.model.layers.attention_backends import sdpa_attention
from glassformer.model.layers.masking import AttentionMask
from glassformer.training.allocator import keep_freed_memory
from glassformer.training.config import get_recipe
from glassformer.training.optim import StackedMuon, orthogonalize

B, T, D_MODEL, HEADS, D_FF = 12, 64, 128, 4, 512
MUON = (3.4445, -4.7750, 2.0315)


def forward_backward(fn, *inputs):
    """A closure running fn forward and backward on fresh leaves of `inputs`."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    grad = torch.randn_like(fn(*leaves))

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad)

    return run


def direct_newton_schulz(stack: torch.Tensor) -> torch.Tensor:
    """Muon's iteration as torch writes it, in float32, on the wide orientation."""
    a, b, c = MUON
    x = stack.mT if stack.shape[-2] > stack.shape[-1] else stack
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    for _ in range(5):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class PyTorchMuon(StackedMuon):
    """StackedMuon through PyTorch's ops only, its iterations included."""

    def step(self, closure=None):
        with mock.patch.object(kernels, "available", lambda: False):
            return super().step(closure)


def muon_step(optimizer: type[StackedMuon], shapes):
    """A closure stepping `optimizer` in float32 over matrices of `shapes` with fixed gradients."""
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return optimizer(params, lr=0.03, weight_decay=0.1, ns_dtype=torch.float32).step


def preset_gradients(seed: int) -> list[torch.nn.Parameter]:
    """The `shakespeare-char` model's parameters (65 characters), each with a random gradient."""
    torch.manual_seed(seed)
    model = build_model(get_recipe("shakespeare-char").model.replace(vocab_size=65))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def attention_pair(batch: int, time: int, heads: int, kv_heads: int, d_head: int, g) -> tuple:
    """sdpa's and the C++ attention's forward + backward on q, k, v cut from one fused product."""
    widths = [heads * d_head, kv_heads * d_head, kv_heads * d_head]
    qkv = torch.randn(batch, time, sum(widths), generator=g)  # (B, T, (H + 2 KV) d_head)
    q, k, v = (t.view(batch, time, -1, d_head).transpose(1, 2) for t in qkv.split(widths, dim=-1))
    positions = torch.arange(time).expand(batch, time)
    causal = AttentionMask(positions, positions, causal=True, contiguous=True)
    return (forward_backward(lambda q, k, v: sdpa_attention(q, k, v, causal), q, k, v),
            forward_backward(lambda q, k, v: attention.attention(q, k, v, causal), q, k, v))


def contenders() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    u = torch.randn(B, T, D_FF, generator=g)
    x, w = torch.randn(B, T, D_MODEL, generator=g), torch.randn(D_MODEL, generator=g)
    theirs_params, our_params = preset_gradients(0), preset_gradients(0)
    shapes = ((3 * 128, 128), (128, 128), (2 * 336, 128), (128, 336))  # the fast preset's
    stacks = [torch.randn(4, *shape, generator=g) for shape in shapes]
    return {
        "attention": attention_pair(B, T, HEADS, HEADS, D_MODEL // HEADS, g),
        "attention (SmolLM2)": attention_pair(4, 512, 9, 3, 64, g),
        "GELU": (forward_backward(F.gelu, u), forward_backward(fused.gelu, u)),
        "LayerNorm": (forward_backward(lambda x, w: F.layer_norm(x, (D_MODEL,), w), x, w),
                      forward_backward(lambda x, w: fused.layer_norm(x, w, None, 1e-5), x, w)),
        "clip_grad_norm_": (lambda: torch.nn.utils.clip_grad_norm_(theirs_params, 1.0, foreach=True),
                            lambda: clip_grad_norm_(our_params, 1.0)),
        "Newton-Schulz (float32)": (lambda: [direct_newton_schulz(s) for s in stacks],
                                    lambda: [orthogonalize(s, MUON, 5, 1e-7, torch.float32)
                                             for s in stacks]),
        "Muon step (float32)": (muon_step(PyTorchMuon, 4 * shapes), muon_step(StackedMuon, 4 * shapes)),
    }


def calls(run, n: int):
    """One round: `n` calls of `run`."""
    def burst():
        for _ in range(n):
            run()
    return burst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50, help="calls per timed round")
    harness.add_arguments(parser, repeats=7)
    args = parser.parse_args()
    record = harness.start("training_passes", args)
    if not kernels.available():
        raise SystemExit("the C++ kernels are not available here")
    keep_freed_memory()  # as the training loop runs
    print(f"{torch.get_num_threads()} threads; forward + backward, µs per call "
          f"(median of {args.repeats} rounds of {args.calls} calls)")
    per_call = 1e6 / args.calls
    for name, (theirs, ours) in contenders().items():
        runs = {"PyTorch": calls(theirs, args.calls), "Glassformer": calls(ours, args.calls)}
        times = harness.alternating(runs, args.repeats)
        base, mine = times["PyTorch"].scaled(per_call), times["Glassformer"].scaled(per_call)
        ratio = base.median / mine.median
        print(f"{name:24s} PyTorch {base.median:8.0f}  Glassformer {mine.median:8.0f}  {ratio:5.2f}x")
        record.figure(f"{name}, PyTorch", base, "µs")
        record.figure(f"{name}, Glassformer", mine, "µs")
        record.ratio(f"{name}, PyTorch / Glassformer time", ratio)
    record.write()


if __name__ == "__main__":
    main()
