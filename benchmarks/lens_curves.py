"""The logit lens against a tuned lens on a real model: mean KL(final ‖ lens) per layer.

A tuned lens is trained on the first part of a text slice (`--chars` characters) and both
lenses are measured on held-out windows from its end (glassformer.interpret.lens.held_out).
Prints the CPU line, one row per residual stream (nats) and a Markdown table of the same.

    .venv/bin/python benchmarks/lens_curves.py [--model smollm2-135m-instruct] \
        [--data glassformer/data/tinyshakespeare.txt] [--chars 60000] [--steps 30] [--context 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import harness
import torch

from glassformer import load
from glassformer.data import tinyshakespeare
from glassformer.formats.files import read_text
from glassformer.interpret.lens import LensTraining, held_out, kl_curve, residual_sites, train_tuned_lens

DATA = tinyshakespeare()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--chars", type=int, default=60_000, help="characters of the text used")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--measure", type=int, default=4, help="held-out windows measured")
    harness.add_arguments(parser, repeats=None)
    args = parser.parse_args()
    record = harness.start("lens_curves", args)

    loaded = load(args.model, progress=False)
    model = loaded.model.eval()
    tokens = torch.tensor(loaded.encode(read_text(args.data)[: args.chars]), dtype=torch.long)
    settings = LensTraining(steps=args.steps, batch=args.batch, context=args.context, lr=args.lr)
    train, measure = held_out(tokens, settings.context, args.measure)
    start = time.perf_counter()
    tuned = train_tuned_lens(model, train, settings,
                             lambda step, loss: print(f"step {step}: KL summed {loss:.2f}", flush=True))
    seconds = time.perf_counter() - start
    logit, tuned_curve = kl_curve(model, measure), kl_curve(model, measure, tuned)

    record.figure("tuned lens training", seconds, "s", steps=settings.steps,
                  tokens_per_step=settings.batch * settings.context)
    rows = ["| residual | logit lens KL | tuned lens KL |", "|---|---|---|"]
    for site, a, b in zip(residual_sites(model.config), logit.tolist(), tuned_curve.tolist(), strict=True):
        record.figure(f"logit lens KL {site}", a, "nats")
        record.figure(f"tuned lens KL {site}", b, "nats")
        rows.append(f"| {site} | {a:.3f} | {b:.3f} |")
    below = [site for site, a, b in zip(residual_sites(model.config), logit, tuned_curve, strict=True)
             if b < a]
    record.notes.update(train_tokens=len(train), measured_tokens=measure.numel(),
                        tuned_below_logit=len(below), residuals=len(logit))
    print(f"trained in {seconds:.0f} s on {len(train)} tokens; measured on {measure.numel()} held-out "
          f"tokens; tuned lens below the logit lens at {len(below)} of {len(logit)} residuals")
    print("\n".join(rows))
    record.write()


if __name__ == "__main__":
    main()
