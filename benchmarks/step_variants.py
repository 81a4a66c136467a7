"""What each of the training conversions is worth inside a whole training step, on this CPU.

    python benchmarks/step_variants.py [--preset shakespeare-char] [--repeats 15] [--steps 10]

`accel.use_fast_training` swaps several pieces of a model at once (fused norms, activations
and attention, the products' route). Timed alone, a pass can gain where a step does not: in a
step its operands have left the caches. This builds the preset's model several times with the
same weights: with no conversion ("plain"), with all of it ("fast"), and with all of it but one
kind of the pieces it swapped here ("fast - attention", ...), and alternates them in bursts
of `--steps` training steps (batch and optimizer as the preset's) within one process, so that
a machine whose speed drifts slows every variant alike. Prints ms per step of each (median,
min and max of the bursts) and its ratio to "plain".
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import harness
import torch
from torch import nn

from glassformer.accel import fast_training, fused
from glassformer.accel.attention import attention
from glassformer.accel.onednn import OneDNNLinear
from glassformer.model.encoder_decoder import build_model
from glassformer.training.allocator import keep_freed_memory
from glassformer.training.config import get_recipe
from glassformer.training.optim import make_optimizer
from glassformer.training.step import train_step

# The pieces a conversion swaps, by the kind of module that replaces them.
PIECES = {
    "norms": (fused.FusedLayerNorm, fused.FusedRMSNorm),
    "activations": (fused.FusedGELU, fused.FusedSwiGLU),
    "rotary": (fused.FusedRotary,),
    "products": (OneDNNLinear,),
}


def converted(model: nn.Module, without: str | None) -> nn.Module:
    """`model` through use_fast_training, all but the pieces named `without` ("attention":
    the attention kernel), which keep their plain modules."""
    kernels = {module: module.kernel for module in model.modules() if hasattr(module, "kernel")}
    twin = fast_training._fast_twin

    def keep_some(module, *args):
        replacement = twin(module, *args)
        return None if without in PIECES and isinstance(replacement, PIECES[without]) else replacement

    fast_training._fast_twin = keep_some
    try:
        fast_training.use_fast_training(model)
    finally:
        fast_training._fast_twin = twin
    if without == "attention":
        for module, kernel in kernels.items():
            module.kernel = kernel
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="shakespeare-char")
    parser.add_argument("--steps", type=int, default=10, help="training steps per burst")
    harness.add_arguments(parser, repeats=15)
    args = parser.parse_args()
    record = harness.start("step_variants", args)
    keep_freed_memory()
    recipe = get_recipe(args.preset)
    batch = torch.randint(0, recipe.model.vocab_size, (2, recipe.train.batch_size,
                                                       recipe.model.context_length),
                          generator=torch.Generator().manual_seed(0))
    probe = converted(build_model(recipe.model), None)
    swapped = [piece for piece, kinds in PIECES.items()
               if any(isinstance(module, kinds) for module in probe.modules())]
    if any(getattr(module, "kernel", None) is attention for module in probe.modules()):
        swapped.insert(0, "attention")
    variants = {}
    for name in ["plain", "fast"] + [f"fast - {piece}" for piece in swapped]:
        torch.manual_seed(0)  # the same weights in every variant
        model = build_model(recipe.model)
        if name != "plain":
            converted(model, name.removeprefix("fast - ") if "-" in name else None)
        variants[name] = (model, make_optimizer(model, recipe.train))

    def burst(model, optimizer):
        def run():
            for _ in range(args.steps):
                train_step(model, optimizer, batch[0], batch[1], 1, recipe.train.grad_clip,
                           nullcontext()).item()
        return run

    times = harness.alternating({name: burst(*pair) for name, pair in variants.items()}, args.repeats)
    per_step = {name: timing.scaled(1e3 / args.steps) for name, timing in times.items()}
    plain = per_step["plain"].median
    print(f"{args.preset}, {torch.get_num_threads()} threads; ms per training step, median of "
          f"{args.repeats} bursts of {args.steps}")
    for name, timing in per_step.items():
        print(f"{name:22s} {timing.median:7.1f} ms  (min {timing.min:6.1f}, max {timing.max:6.1f})  "
              f"plain / this {plain / timing.median:5.2f}x")
        record.figure(f"{name}, per step", timing, "ms")
        record.ratio(f"plain / {name} time", plain / timing.median)
    record.write()


if __name__ == "__main__":
    main()
