"""ablation: one base recipe (shakespeare-char), then one architectural change at a time.

Every run trains for the same wall-clock time (so a slower variant takes fewer steps), with
a short warmup and then a constant learning rate (the step count is not known in advance, so
no cosine can end on time), at two or more seeds. The attention kernels are the exception:
they compute the same function, so each trains exactly as many steps as the base run of the
same seed and should land on the same loss at a different speed.

On a machine shared with other work, wall-clock time is not the same for every run; with
`equal="steps"` every run trains as many steps as the base run of its seed made in its time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..errors import InputError
from ..formats.checkpoint import Checkpoint
from ..interpret.params import count_parameters
from ..model.config import ModelConfig
from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from ..training.metrics import read_metrics
from .report import save_figure
from .runner import Cell, Context, Summary
from .stats import lower_is_better, mean_spread
from .timed import base_model, train_config, train_timed

NEEDS_DATA = True
TITLE = "Ablation: one change at a time on shakespeare-char"
GATED_D_FF = 341  # 3 · 128 · 341 ≈ 2 · 128 · 512: a gated feed-forward with the MLP's weights

VARIANTS: dict[str, tuple[str, dict]] = {  # name -> (what changes, ModelConfig overrides)
    "base": ("base", {}),
    "sinusoidal": ("position", {"position": "sinusoidal"}),
    "rope": ("position", {"position": "rope"}),
    "alibi": ("position", {"position": "alibi"}),
    "no positions": ("position", {"position": "none"}),
    "post-norm": ("norm placement", {"norm_placement": "post"}),
    "rmsnorm": ("norm", {"norm": "rmsnorm"}),
    "swiglu": ("feed-forward", {"activation": "silu", "gated": True, "d_ff": GATED_D_FF}),
    "geglu": ("feed-forward", {"activation": "gelu", "gated": True, "d_ff": GATED_D_FF}),
    "gqa-2": ("heads", {"n_kv_heads": 2}),
    "mqa": ("heads", {"n_kv_heads": 1}),
    "reference kernel": ("attention kernel", {"attention_kernel": "reference"}),
    "flash kernel": ("attention kernel", {"attention_kernel": "flash"}),
}
KERNEL_VARIANTS = ("reference kernel", "flash kernel")
BASE_DESCRIPTION = "learned positions, pre-norm, LayerNorm, GELU MLP, MHA, sdpa kernel"
OVERHEAD_SECONDS = 2.0  # per run: tokenizing the corpus, the final evaluation, the checkpoint


def settings(budget: float, data: Path, seeds: int = 2, variants=tuple(VARIANTS),
             equal: str = "time") -> dict:
    """The plan: seconds per run from the budget. `variants` (base included) narrows the
    comparison, e.g. for a quick check; `equal` is "time" or "steps"."""
    if equal not in ("time", "steps"):
        raise InputError("equal", f"choose time or steps, got {equal!r}")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "base" not in variants:
        raise InputError("variants", f"need 'base' among {', '.join(VARIANTS)}; got {unknown}")
    if seeds < 2:
        raise InputError("seeds", f"need at least 2 to show a spread, got {seeds}")
    n_runs = len(variants) * seeds
    return {"budget": budget, "data": str(data), "seeds": seeds, "variants": list(variants),
            "equal": equal,
            "train_seconds": round(max(budget / n_runs - OVERHEAD_SECONDS, 0.5), 2)}


def model_config(variant: str) -> ModelConfig:
    return base_model().replace(**VARIANTS[variant][1])


def cells(config: dict) -> list[Cell]:
    chosen = config["variants"]
    order = [v for v in chosen if v not in KERNEL_VARIANTS] + [v for v in chosen if v in KERNEL_VARIANTS]
    order.remove("base")  # first: the others may need its step counts
    return [Cell(f"{variant}/seed{seed}", _train_cell(variant, seed), f"{variant}, seed {seed}")
            for variant in ["base", *order] for seed in range(config["seeds"])]


def _train_cell(variant: str, seed: int):
    def run(ctx: Context) -> dict:
        config = train_config(ctx.settings["train_seconds"], seed)
        if variant != "base" and (variant in KERNEL_VARIANTS or ctx.settings["equal"] == "steps"):
            config = train_config(None, seed, iters=ctx.results[f"base/seed{seed}"]["iters"])
        folder = ctx.folder(f"{variant}/seed{seed}")
        summary = train_timed(ctx.settings["data"], folder, model_config(variant), config)
        model = Transformer(Checkpoint.open(folder).config)
        result = {"variant": variant, "seed": seed, "iters": summary["iters"],
                  "val_loss": summary["val_loss"], "tokens_per_second": summary["tokens_per_second"],
                  "parameters": count_parameters(model)["total"],
                  "kv_bytes_per_token": kv_bytes_per_token(model.config)}
        for path in folder.iterdir():  # keep the metrics; checkpoints are not needed again
            if path.name != "metrics.jsonl":
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        return result

    return run


def kv_bytes_per_token(config: ModelConfig) -> int:
    """Bytes a float32 KVCache allocates per cached position (all layers, keys and values)."""
    cache = KVCache(config, batch_size=1)
    cache.allocate(torch.device("cpu"), torch.float32)
    total = sum(t.nbytes for t in cache.keys + cache.values)
    return total // cache.max_length


def summarize(config: dict, results: dict[str, dict], out: Path) -> Summary:
    by_variant: dict[str, list[dict]] = {}
    for result in results.values():
        by_variant.setdefault(result["variant"], []).append(result)
    losses = {v: [r["val_loss"] for r in rs] for v, rs in by_variant.items()}
    rows = []
    for variant in config["variants"]:
        group, runs = VARIANTS[variant][0], by_variant[variant]
        mean, spread = mean_spread(losses[variant])
        rows.append([variant, group, mean, spread, mean_spread([r["iters"] for r in runs])[0],
                     mean_spread([r["tokens_per_second"] for r in runs])[0],
                     runs[0]["kv_bytes_per_token"], runs[0]["parameters"]])
    equal = "equal training time" if config["equal"] == "time" else "equal steps"
    table = {"title": f"Validation loss after {equal}",
             "columns": ["variant", "change", "val loss (mean)", "± spread", "steps",
                         "tokens/s", "KV bytes/token", "parameters"],
             "rows": rows,
             "note": f"base: {BASE_DESCRIPTION}; {config['train_seconds']} s of training per "
                     + ("run, " if config["equal"] == "time" else "base run, the others as many steps, ")
                     + f"{config['seeds']} seeds (spread = half the range). Gated feed-forwards use "
                     f"d_ff {GATED_D_FF} for the MLP's weight count; GQA / MQA have fewer attention "
                     "weights and learned positions 64·128 more, as the parameter column shows. "
                     "The kernels train as many steps as the base run, not as long."}
    by_steps = config["equal"] == "steps"
    figure = save_figure(out, "ablation_curves.png",
                         lambda fig: _draw_curves(fig, out, results, by_steps))
    return Summary(tables=[table],
                   figures=[{"file": figure, "caption": "Training loss against training "
                             f"{'steps' if by_steps else 'time'} (mean over seeds), every variant"}],
                   claims=_claims(by_variant, losses))


def _claims(by_variant, losses) -> list[dict]:
    def compare(name: str, better: str, worse: str) -> dict:
        held = lower_is_better(losses[better], losses[worse])
        return {"claim": name, "held": held,
                "evidence": f"{better} {mean_spread(losses[better])[0]:.4f} vs {worse} "
                            f"{mean_spread(losses[worse])[0]:.4f} (seeds "
                            f"{'overlap' if held is None else 'do not overlap'})"}

    claims = [compare(name, better, worse) for name, better, worse in (
        ("pre-norm trains better than post-norm", "base", "post-norm"),
        ("SwiGLU beats a GELU MLP at equal parameters", "swiglu", "base"),
    ) if better in losses and worse in losses]
    base = mean_spread(losses["base"])[0]
    for variant in [v for v in ("gqa-2", "mqa") if v in losses]:
        cost = mean_spread(losses[variant])[0] - base
        shrink = by_variant["base"][0]["kv_bytes_per_token"] / by_variant[variant][0]["kv_bytes_per_token"]
        claims.append({"claim": f"{variant} shrinks the KV cache at little cost in quality",
                       "held": cost < 0.02 * base,
                       "evidence": f"cache {shrink:.0f}x smaller; loss {cost:+.4f} nats against "
                                   f"MHA (little: under 2% of {base:.3f})"})
    for variant in [v for v in KERNEL_VARIANTS if v in losses]:
        gaps = [abs(r["val_loss"] - by_variant["base"][r["seed"]]["val_loss"])
                for r in sorted(by_variant[variant], key=lambda r: r["seed"])]
        speed = (mean_spread([r["tokens_per_second"] for r in by_variant[variant]])[0]
                 / mean_spread([r["tokens_per_second"] for r in by_variant["base"]])[0])
        claims.append({"claim": f"the {variant} gives the same loss as sdpa, at a different speed",
                       "held": max(gaps) < 0.01,
                       "evidence": f"largest loss gap {max(gaps):.5f} after equal steps (same: "
                                   f"under 0.01); {speed:.2f}x the sdpa kernel's tokens/s"})
    return claims


def _draw_curves(fig, out: Path, results: dict[str, dict], by_steps: bool) -> None:
    from matplotlib import colormaps

    ax = fig.subplots()
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for key, result in results.items():
        records = [r for r in read_metrics(out / "cells" / key.replace("/", "_") / "metrics.jsonl")
                   if "lr" in r]
        curves.setdefault(result["variant"], []).append(
            [(r["iter"] if by_steps else r["tokens_seen"] / r["tokens_per_second"], r["train_loss"])
             for r in records])
    colors = colormaps["tab20"]
    for i, (variant, runs) in enumerate(curves.items()):
        n = min(len(run) for run in runs)
        if n:
            x = [sum(run[j][0] for run in runs) / len(runs) for j in range(n)]
            loss = [sum(run[j][1] for run in runs) / len(runs) for j in range(n)]
            ax.plot(x, loss, label=variant, linewidth=1.2, color=colors(i % 20),
                    linestyle="--" if variant in KERNEL_VARIANTS else "-")
    ax.set_xlabel("step" if by_steps else "training seconds")
    ax.set_ylabel("training loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
