"""length: models trained at context 64, read at 64 … 1024 tokens.

Learned, sinusoidal, RoPE and ALiBi models train for equal time at context 64. Each is then
scored (perplexity over the same validation tokens, cut into windows of the evaluation
length) with its window widened: RoPE as it is and with linear interpolation, NTK-aware
scaling and YaRN at factor L/64; and RoPE fine-tuned briefly at 256 tokens with each scaling
(factor 4), then read at every length. A learned position table has no rows past 64.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from ..formats.checkpoint import load_model
from ..generation.context_extension import extend_context
from ..model.transformer import Transformer
from ..training.data import TokenData, draw_starts, windows
from ..training.perplexity import perplexity
from .report import save_figure
from .runner import Cell, Context, Summary
from .timed import base_model, train_config, train_timed

NEEDS_DATA = True
TITLE = "Length: reading past the trained window"
TRAIN_CONTEXT = 64
LENGTHS = (64, 128, 256, 512, 1024)
POSITIONS = ("learned", "sinusoidal", "rope", "alibi")
SCALINGS = ("linear", "ntk", "yarn")
FINETUNED = ("none", *SCALINGS)  # "none": plain RoPE fine-tuned alike, the control
FINETUNE_LENGTH = 256
FINETUNE_LR = 3e-4


def settings(budget: float, data: Path) -> dict:
    return {"budget": budget, "data": str(data),
            "train_seconds": round(max(0.6 * budget / len(POSITIONS) - 2.0, 0.5), 2),
            "finetune_seconds": round(max(0.25 * budget / len(FINETUNED), 0.5), 2),
            "eval_tokens": int(min(max(budget * 20 // 1024, 1), 32) * 1024)}


def cells(config: dict) -> list[Cell]:
    out = [Cell(f"train/{p}", _train_cell(p), f"train {p}") for p in POSITIONS]
    variants = ["learned", "sinusoidal", "rope", *(f"rope+{s}" for s in SCALINGS), "alibi"]
    out += [Cell(f"eval/{v}", _eval_cell(v), f"read {v}") for v in variants]
    out += [Cell(f"finetune/{s}", _finetune_cell(s), f"fine-tune rope+{s}") for s in FINETUNED]
    return out


def _train_cell(position: str):
    def run(ctx: Context) -> dict:
        folder = ctx.folder(f"train/{position}")
        config = base_model().replace(position=position, context_length=TRAIN_CONTEXT)
        summary = train_timed(ctx.settings["data"], folder,
                              config, train_config(ctx.settings["train_seconds"], seed=0))
        for state in folder.glob("step-*/training_state.safetensors"):
            state.unlink()  # the optimizer's state: only the weights are read again
        return {"position": position, "iters": summary["iters"], "val_loss": summary["val_loss"]}

    return run


def _trained(ctx: Context, position: str) -> tuple[Transformer, TokenData]:
    folder = ctx.kept(f"train/{position}")
    model, _, meta = load_model(folder)
    tokens = TokenData.open(folder / "tokens.bin", TRAIN_CONTEXT, meta["train"]["val_fraction"])
    return model.eval(), tokens


def widened(model: Transformer, length: int, scaling: str = "none") -> Transformer | None:
    """`model` read with a window of `length` tokens; None where its positions cannot be."""
    config = model.config
    if length == config.context_length and scaling == "none":
        return model
    if config.position == "learned":
        return None  # no rows in the table past the trained window
    if scaling == "none":  # sinusoids, RoPE angles, ALiBi distances: functions of the position
        other = Transformer(config.replace(context_length=length))
        other.load_state_dict(model.state_dict(), strict=True)
        return other.eval()
    return extend_context(model, scaling, length / config.context_length).eval()


def _scores(model: Transformer, val: np.ndarray, eval_tokens: int, scaling: str = "none") -> list:
    """Perplexity at every evaluation length (None where the model cannot read it)."""
    scores = []
    for length in LENGTHS:
        wide = widened(model, length, scaling)
        scores.append(None if wide is None else
                      perplexity(wide, val, batch_size=4, max_tokens=eval_tokens)["perplexity"])
    return scores


def _eval_cell(variant: str):
    position, _, scaling = variant.partition("+")

    def run(ctx: Context) -> dict:
        model, tokens = _trained(ctx, position)
        val = np.asarray(tokens.val, dtype=np.int64)
        return {"variant": variant, "lengths": list(LENGTHS),
                "perplexity": _scores(model, val, ctx.settings["eval_tokens"], scaling or "none")}

    return run


def _finetune_cell(scaling: str):
    def run(ctx: Context) -> dict:
        model, tokens = _trained(ctx, "rope")
        model = extend_context(model, scaling, FINETUNE_LENGTH / TRAIN_CONTEXT)
        steps = finetune(model, tokens.train, ctx.settings["finetune_seconds"])
        val = np.asarray(tokens.val, dtype=np.int64)
        name = "rope" if scaling == "none" else f"rope+{scaling}"
        return {"variant": f"{name}, fine-tuned", "lengths": list(LENGTHS),
                "finetune_steps": steps,
                "perplexity": _scores(model.eval(), val, ctx.settings["eval_tokens"])}

    return run


def finetune(model: Transformer, train_tokens: np.ndarray, seconds: float, seed: int = 0) -> int:
    """Train `model` in place at its own window for `seconds` (constant rate, as many tokens
    per step as the base recipe); returns the number of steps."""
    from ..training.optim import make_optimizer
    from ..training.step import train_step

    config = train_config(seconds, seed).replace(lr=FINETUNE_LR, min_lr=FINETUNE_LR)
    T = model.config.context_length
    batch = max(1, config.batch_size * TRAIN_CONTEXT // T)
    optimizer = make_optimizer(model.train(), config)
    generator = torch.Generator().manual_seed(config.seed)
    steps, started = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - started < seconds:
        x, y = windows(train_tokens, draw_starts(len(train_tokens), T, batch, generator), T)
        train_step(model, optimizer, x, y, 1, config.grad_clip, nullcontext())
        steps += 1
    return steps


def summarize(config: dict, results: dict[str, dict], out: Path) -> Summary:
    lines = {r["variant"]: r["perplexity"] for k, r in results.items() if not k.startswith("train/")}
    table = {"title": "Validation perplexity against evaluation length",
             "columns": ["model", *(f"L={n}" for n in LENGTHS)],
             "rows": [[name, *values] for name, values in lines.items()],
             "note": f"trained at {TRAIN_CONTEXT} tokens for {config['train_seconds']} s each; "
                     f"scalings without fine-tune use factor L/{TRAIN_CONTEXT}; fine-tuned ones "
                     f"trained {config['finetune_seconds']} s at {FINETUNE_LENGTH} tokens (factor "
                     f"{FINETUNE_LENGTH // TRAIN_CONTEXT}); the same {config['eval_tokens']} "
                     "validation tokens at every length. A dash: learned positions have no rows "
                     "past the window."}
    figure = save_figure(out, "length_perplexity.png", lambda fig: _draw(fig, lines), size=(9, 4.5))
    return Summary(tables=[table], figures=[{"file": figure, "caption": "Perplexity against "
                   "evaluation length (log scales); the dotted line marks the trained window"}],
                   claims=_claims(lines))


def _claims(lines: dict[str, list]) -> list[dict]:
    at = {name: dict(zip(LENGTHS, values, strict=True)) for name, values in lines.items()}
    far = LENGTHS[-1]

    def extrapolates(name: str) -> dict:
        ratio = at[name][far] / at[name][TRAIN_CONTEXT]
        return {"claim": f"{name} positions extrapolate to {far} tokens (perplexity within 10% "
                         f"of its value at {TRAIN_CONTEXT})", "held": ratio < 1.1,
                "evidence": f"{at[name][TRAIN_CONTEXT]:.2f} at {TRAIN_CONTEXT}, {at[name][far]:.2f} "
                            f"at {far} ({ratio:.2f}x)"}

    rope = extrapolates("rope")
    claims = [rope, extrapolates("alibi"),
              {"claim": f"learned positions cannot read past the {TRAIN_CONTEXT}-token window",
               "held": all(v is None for n, v in at["learned"].items() if n > TRAIN_CONTEXT),
               "evidence": f"the table has {TRAIN_CONTEXT} rows: no score past them"}]
    plain_far, tuned_plain = at["rope"][far], at["rope, fine-tuned"][FINETUNE_LENGTH]
    for scaling in SCALINGS:
        scaled, tuned = at[f"rope+{scaling}"][far], at[f"rope+{scaling}, fine-tuned"][FINETUNE_LENGTH]
        held = None if rope["held"] else scaled < 0.95 * plain_far
        claims.append({"claim": f"{scaling} scaling extends the RoPE model's window",
                       "held": held,
                       "evidence": ("plain RoPE did not degrade here, so there was nothing to "
                                    "repair; " if held is None else "")
                                   + f"at {far} tokens {scaled:.2f} against {plain_far:.2f} "
                                   f"unscaled (held: 5% lower); fine-tuned at {FINETUNE_LENGTH}: "
                                   f"{tuned:.2f} there, plain RoPE fine-tuned alike {tuned_plain:.2f}"})
    return claims


def _draw(fig, lines: dict[str, list]) -> None:
    from matplotlib import colormaps

    ax, colors = fig.subplots(), colormaps["tab20"]
    for i, (name, values) in enumerate(lines.items()):
        points = [(n, v) for n, v in zip(LENGTHS, values, strict=True) if v is not None]
        style = "--" if "fine-tuned" in name else "-"
        ax.plot(*zip(*points, strict=True), style, marker="o", label=name, linewidth=1.2,
                color=colors(i % 20))
    ax.axvline(TRAIN_CONTEXT, color="grey", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("trained at context 64")

