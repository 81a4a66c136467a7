"""What the hook sites cost when no hook is installed.

The competitor is the model without the feature: a copy whose forward methods (Transformer,
Block, Attention, FeedForward, Embedding) are recompiled from their own source with every
`hooks(site, x)` call replaced by `x`, so nothing else differs; its logits are checked to be
identical first. Both are timed interleaved, many times, and the ratio hooked / hook-free of
the medians (and of the fastest rounds) is printed: the target is within 3%. On a busy machine the
timed ratio is noisy, so the script also measures what one idle site costs (the registry call
plus the string concatenation naming it) and multiplies by the number of sites (an upper
bound: the three attention-weight sites are skipped entirely by the fused kernels).

    .venv/bin/python benchmarks/trace_overhead.py [--device cpu] [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect
import sys
import textwrap
import time
import types

import harness
import torch

from glassformer import Transformer, get_preset
from glassformer.model.layers.attention import Attention
from glassformer.model.layers.block import Block
from glassformer.model.layers.embedding import Embedding
from glassformer.model.layers.feedforward import FeedForward

METHODS = {
    Transformer: ("forward_hidden", "head"), Block: ("forward",), Attention: ("forward",),
    FeedForward: ("forward",), Embedding: ("forward",),
}


class _StripHooks(ast.NodeTransformer):
    """hook(site, x) / self.hooks(site, x) -> x."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        is_hook = (isinstance(f, ast.Name) and f.id == "hook") or (
            isinstance(f, ast.Attribute) and f.attr == "hooks"
        )
        return node.args[1] if is_hook and len(node.args) == 2 else node


def _hook_free(cls: type, name: str) -> types.FunctionType:
    fn = getattr(cls, name)
    tree = ast.fix_missing_locations(_StripHooks().visit(ast.parse(textwrap.dedent(inspect.getsource(fn)))))
    namespace = dict(vars(sys.modules[fn.__module__]))
    exec(compile(tree, f"<hook-free {cls.__name__}.{name}>", "exec"), namespace)
    return namespace[name]


def hook_free_copy(model: Transformer) -> Transformer:
    """A copy of `model` whose forward passes contain no hook call at all."""
    plain = copy.deepcopy(model)
    stripped = {(cls, name): _hook_free(cls, name) for cls, names in METHODS.items() for name in names}
    for module in plain.modules():
        for name in METHODS.get(type(module), ()):
            setattr(module, name, types.MethodType(stripped[type(module), name], module))
    return plain


def synchronized(model: Transformer, ids: torch.Tensor):
    """One forward pass, finished on the device before the clock is read."""
    def run():
        model(ids)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
    return run


def timings(model: Transformer, plain_model: Transformer, ids: torch.Tensor, repeats: int) -> dict:
    """Seconds per forward pass of each, their rounds interleaved so drifting load hits both alike."""
    with torch.inference_mode():
        return harness.alternating({"hooked": synchronized(model, ids),
                                    "hook-free": synchronized(plain_model, ids)}, repeats, warmup=3)


def idle_site_seconds(model: Transformer, calls: int = 200_000) -> float:
    """Seconds per idle hook site: the registry call plus the string concatenation naming it."""
    hook, site, x = model.hooks, "blocks.0.attn", torch.zeros(1)
    start = time.perf_counter()
    for _ in range(calls):
        hook(site + ".q", x)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    harness.add_arguments(parser, repeats=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    record = harness.start("trace_overhead", args)
    cases = [("smollm2-135m", 1), ("smollm2-135m", 32), ("smollm2-135m", 256), ("tiny-llama", 8)]
    print(f"{'model':>14} {'T':>5} {'sites':>6} {'hooked ms':>10} {'hook-free ms':>13} {'ratio':>7}"
          f" {'best ratio':>11} {'idle sites ms':>14} {'share':>7}")
    for preset, T in cases:
        torch.manual_seed(0)
        model = Transformer(get_preset(preset).replace(dropout=0.0)).to(args.device).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, T), device=args.device)
        plain_model = hook_free_copy(model)
        with torch.inference_mode():
            reference = model(ids)
            torch.testing.assert_close(plain_model(ids), reference, rtol=0, atol=0)
            with plain_model.hooks.installed({"logits": lambda t, site: t + 1}):  # never called
                torch.testing.assert_close(plain_model(ids), reference, rtol=0, atol=0)
        times = timings(model, plain_model, ids, args.repeats)
        hooked, plain = times["hooked"].median, times["hook-free"].median
        ratio, best = hooked / plain, times["hooked"].min / times["hook-free"].min
        sites = len(model.hooks.sites)
        idle = sites * idle_site_seconds(model)
        print(f"{preset:>14} {T:>5} {sites:>6} {1e3 * hooked:>10.2f} {1e3 * plain:>13.2f} {ratio:>7.3f}"
              f" {best:>11.3f} {1e3 * idle:>14.3f} {idle / plain:>7.2%}")
        for name, timing in times.items():
            record.figure(f"{preset}, T={T}, {name}", timing.scaled(1e3), "ms")
        record.figure(f"{preset}, T={T}, {sites} idle sites", 1e3 * idle, "ms")
        record.ratio(f"{preset}, T={T}, hooked / hook-free time", ratio)
    record.write()


if __name__ == "__main__":
    main()
