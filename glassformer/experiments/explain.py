"""explain: which of SmolLM2's heads matter, by four measures, on a task with a known answer.

The input is random tokens repeated once: [<|endoftext|>, t_1 … t_R, t_1 … t_R]. In the second copy the
next token can be read off the first, and induction heads do that: from t_j's second
occurrence they attend to t_{j+1} in the first copy. Each head gets a score four ways:

- attention: its mean weight from each second-copy query to that key (the "induction score");
- rollout: the same entry of attention rollout (Abnar & Zuidema) through the layers below,
  composed with this head's weights;
- integrated gradients: every head's output moved from its mean to its real value together,
  by a gate per head from 0 to 1; a head's score is the loss reduction credited to its gate
  (completeness: the scores sum to loss(all mean-ablated) - loss(all real));
- ablation: the rise in loss when the head's output is replaced by its mean (mean-ablation).

Ablation measures what the loss does without the head, so the other three are judged by how
well they rank heads as ablation does (Spearman's rank correlation, overlap of the top 10).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from ..interpret.attribution import attention_rollout, quadrature
from ..interpret.trace import intervene, run_with_cache
from ..model.presets import get_preset
from .report import save_figure
from .runner import Cell, Context, Summary
from .stats import spearman, top_overlap

NEEDS_DATA = False
TITLE = "Explain: are attention weights explanations?"
MODEL = "smollm2-135m-instruct"
METHODS = ("attention", "rollout", "integrated gradients")
TOP_K = 10
# What SmolLM2 saw between pretraining documents; after its chat <|im_start|> it barely
# copies random tokens at all.
DOCUMENT_START = "<|endoftext|>"


def settings(budget: float, layers: int | None = None) -> dict:
    """The plan from the budget; `layers` ablates only the first few layers' heads (and
    compares the rankings on those), e.g. for a quick check."""
    n_layers = get_preset("smollm2-135m").n_layers
    if layers is not None and not 1 <= layers <= n_layers:
        raise InputError("layers", f"choose 1..{n_layers}, got {layers}")
    return {"budget": budget, "model": MODEL, "layers": layers or n_layers,
            "repeat": 10 if budget < 120 else 20, "sequences": int(min(max(budget // 150, 1), 8)),
            "ig_panels": 4 if budget < 120 else 10, "seed": 0}


def cells(config: dict) -> list[Cell]:
    state: dict = {}  # the model and the clean run, shared by the cells of one process
    return [Cell("clean", lambda ctx: _clean(ctx, state), "attention and rollout"),
            Cell("integrated_gradients", lambda ctx: _integrated_gradients(ctx, state), "IG"),
            *(Cell(f"ablation/{layer}", _ablation_cell(layer, state), f"ablate layer {layer}")
              for layer in range(config["layers"]))]


def _setup(state: dict, config: dict) -> dict:
    """Load the model and build the task once: ids (B, T), the known-answer positions."""
    if "model" not in state:
        from ..language_model import load

        language_model = load(config["model"], progress=False)
        model = language_model.model.eval().requires_grad_(False)
        tokenizer = language_model.tokenizer
        start = tokenizer.encode(DOCUMENT_START)
        if len(start) != 1:
            raise InputError(None, f"{config['model']}: {DOCUMENT_START!r} is not one token")
        R, B = config["repeat"], config["sequences"]
        generator = torch.Generator().manual_seed(config["seed"])
        half = torch.randint(1000, model.config.vocab_size - 1000, (B, R), generator=generator)
        ids = torch.cat([torch.full((B, 1), start[0]), half, half], dim=1)  # (B, 2R + 1)
        queries = torch.arange(R + 1, 2 * R)  # second-copy positions whose next token is known
        state.update(model=model, ids=ids, queries=queries, keys=queries - R + 1)
    return state


def task_loss(logits: torch.Tensor, ids: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the known next tokens (after each query position)."""
    predicted = logits[:, queries].float()  # (B, Q, vocab)
    return F.cross_entropy(predicted.flatten(0, 1), ids[:, queries + 1].flatten())


def _clean(ctx: Context, state: dict) -> dict:
    s = _setup(state, ctx.settings)
    model, ids, queries, keys = s["model"], s["ids"], s["queries"], s["keys"]
    L = model.config.n_layers
    logits, cache = run_with_cache(model, ids, lambda name: name.endswith("attn.pattern"))
    patterns = [cache[f"blocks.{layer}.attn.pattern"] for layer in range(L)]  # (B, H, T, T) each
    attention, rollout = [], []
    for layer, pattern in enumerate(patterns):
        attention.append(pattern[:, :, queries, keys].mean(dim=(0, 2)).tolist())  # (H,)
        rollout.append([attention_rollout(patterns[:layer] + [pattern[:, h : h + 1]])
                        [:, queries, keys].mean().item() for h in range(pattern.shape[1])])
    return {"loss": task_loss(logits, ids, queries).item(), "attention": attention,
            "rollout": rollout}


def _means(state: dict) -> list[torch.Tensor]:
    """Each layer's head outputs (contexts αV) averaged over sequences and positions:
    (1, H, 1, d_head) per layer, the value a mean-ablated head outputs."""
    if "means" not in state:
        model, ids = state["model"], state["ids"]
        _, cache = run_with_cache(model, ids, lambda name: name.endswith("attn.context"))
        state["means"] = [cache[f"blocks.{layer}.attn.context"].mean(dim=(0, 2), keepdim=True)
                          for layer in range(model.config.n_layers)]
    return state["means"]


def _integrated_gradients(ctx: Context, state: dict) -> dict:
    """Gates g (L, H) move every head from its mean output (g = 0) to its real one (g = 1):
    context = mean + g · (context - mean). IG_h = ∫₀¹ ∂loss/∂g_h da along g = a·1, by
    Gauss-Legendre on `ig_panels` panels, every node in one batch."""
    s = _setup(state, ctx.settings)
    model, ids, queries, means = s["model"], s["ids"], s["queries"], _means(state)
    B, L, H = ids.shape[0], model.config.n_layers, model.config.n_heads
    nodes, weights = quadrature(2, tuple(np.linspace(0.0, 1.0, ctx.settings["ig_panels"] + 1)))
    alphas = torch.cat([nodes, torch.tensor([0.0, 1.0], dtype=nodes.dtype)]).float()  # (n,)
    gates = alphas[:, None, None].expand(-1, L, H).clone().requires_grad_(True)  # (n, L, H)

    def mix(layer: int):
        def hook(context, site):  # (n·B, H, T, d_head)
            g = gates[:, layer].repeat_interleave(B, dim=0)[:, :, None, None]  # (n·B, H, 1, 1)
            return means[layer] + g * (context - means[layer])
        return hook

    hooks = {f"blocks.{layer}.attn.context": mix(layer) for layer in range(L)}
    with torch.enable_grad(), intervene(model, hooks):
        logits = model(ids.repeat(len(alphas), 1))  # (n·B, T, vocab)
        losses = torch.stack([task_loss(chunk, ids, queries) for chunk in logits.split(B)])  # (n,)
        weighted = (weights.float() * losses[: len(nodes)]).sum()
        (grad,) = torch.autograd.grad(weighted, gates)
    scores = -grad[: len(nodes)].sum(dim=0)  # (L, H): loss reduction credited to each head
    baseline, real = losses[-2].item(), losses[-1].item()
    return {"scores": scores.tolist(), "loss_all_mean": baseline, "loss_all_on": real,
            "completeness_gap": float(scores.sum()) - (baseline - real)}


def _ablation_cell(layer: int, state: dict):
    def run(ctx: Context) -> dict:
        s = _setup(state, ctx.settings)
        model, ids, queries = s["model"], s["ids"], s["queries"]
        mean, B, H = _means(state)[layer], ids.shape[0], model.config.n_heads

        def replace(context, site):  # (H·B, H, T, d_head): copy h has head h mean-ablated
            context = context.clone()
            for head in range(H):
                context[head * B : (head + 1) * B, head] = mean[0, head]
            return context

        with torch.no_grad():
            clean = task_loss(model(ids), ids, queries).item()
            with intervene(model, {f"blocks.{layer}.attn.context": replace}):
                logits = model(ids.repeat(H, 1))  # (H·B, T, vocab)
        rises = [task_loss(chunk, ids, queries).item() - clean for chunk in logits.split(B)]
        return {"layer": layer, "loss_rise": rises}

    return run


def summarize(config: dict, results: dict[str, dict], out: Path) -> Summary:
    L = config["layers"]
    grids = {"attention": np.array(results["clean"]["attention"][:L]),
             "rollout": np.array(results["clean"]["rollout"][:L]),
             "integrated gradients": np.array(results["integrated_gradients"]["scores"][:L]),
             "ablation": np.array([results[f"ablation/{layer}"]["loss_rise"] for layer in range(L)])}
    truth = grids["ablation"].ravel()
    heads = [f"{layer}.{h}" for layer in range(L) for h in range(grids["ablation"].shape[1])]
    rows = [[method, spearman(grids[method].ravel(), truth),
             top_overlap(grids[method].ravel(), truth, TOP_K),
             ", ".join(heads[i] for i in np.argsort(-grids[method].ravel(), kind="stable")[:5])]
            for method in (*METHODS, "ablation")]
    ig = results["integrated_gradients"]
    table = {"title": "Head rankings against mean-ablation", "rows": rows,
             "columns": ["ranking", "Spearman vs ablation", f"top-{TOP_K} overlap",
                         "top 5 heads (layer.head)"],
             "note": f"{config['sequences']} sequences of {config['repeat']} random tokens "
                     f"repeated; clean loss {results['clean']['loss']:.3f} nats on the known "
                     f"tokens; integrated gradients: loss {ig['loss_all_mean']:.3f} with every "
                     f"head mean-ablated, completeness gap {ig['completeness_gap']:+.4f}."}
    spear = {row[0]: row[1] for row in rows}
    claim = {"claim": "attention weights are not explanations (they rank heads less like "
                      "ablation does than integrated gradients)",
             "held": spear["attention"] < spear["integrated gradients"],
             "evidence": ", ".join(f"{m} ρ={spear[m]:.2f}" for m in METHODS)}
    heat = save_figure(out, "explain_heads.png", lambda fig: _draw_grids(fig, grids), size=(13, 5))
    scatter = save_figure(out, "explain_agreement.png", lambda fig: _draw_scatter(fig, grids),
                          size=(11, 3.6))
    return Summary(tables=[table], claims=[claim],
                   figures=[{"file": heat, "caption": "Each head's score, four ways (layers down, "
                             "heads across)"},
                            {"file": scatter, "caption": "Each method's score against the loss "
                             "rise under mean-ablation, one point per head"}])


def _draw_grids(fig, grids: dict[str, np.ndarray]) -> None:
    for ax, (name, grid) in zip(fig.subplots(1, len(grids)), grids.items(), strict=True):
        image = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax)


def _draw_scatter(fig, grids: dict[str, np.ndarray]) -> None:
    truth = grids["ablation"].ravel()
    for ax, method in zip(fig.subplots(1, len(METHODS)), METHODS, strict=True):
        ax.scatter(grids[method].ravel(), truth, s=8)
        ax.set_xlabel(method)
        ax.set_ylabel("loss rise when ablated")
        ax.grid(alpha=0.3)
