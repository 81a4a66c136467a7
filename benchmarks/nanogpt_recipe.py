"""The baseline: nanoGPT's published shakespeare-char CPU recipe, re-expressed in plain PyTorch.

nanoGPT is not installable from PyPI, so this module writes its documented design from the
public description (GPT-2 style: learned positions, pre-LayerNorm, no biases (bias=False),
fused c_attn, GELU MLP, tied head, N(0, 0.02) init with scaled residual projections; AdamW with decay on
matrices only, non-fused on CPU; warmup + cosine learning rate; a fresh np.memmap and a
per-window torch.stack for every batch; train and val loss estimated every eval_interval).
It is a faithful formulation of the recipe, not nanoGPT's own code.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# `python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
#  --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
#  --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`
RECIPE = dict(
    n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, dropout=0.0,
    learning_rate=1e-3, min_lr=1e-4, max_iters=2000, lr_decay_iters=2000, warmup_iters=100,
    weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0, eval_interval=250, eval_iters=20,
)


class _Attention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = _Attention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab_size, n_layer, n_head, n_embd, block_size, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def _lr(it, r):
    if it < r["warmup_iters"]:
        return r["learning_rate"] * (it + 1) / (r["warmup_iters"] + 1)
    if it > r["lr_decay_iters"]:
        return r["min_lr"]
    ratio = (it - r["warmup_iters"]) / (r["lr_decay_iters"] - r["warmup_iters"])
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return r["min_lr"] + coeff * (r["learning_rate"] - r["min_lr"])


def run(train_bin, val_bin, vocab_size, max_iters=None, target_loss=None, seed=1337,
        full_val=False, **changes):
    """Train with the recipe on uint16 token files; returns per-phase timings and losses.

    Stops early once the validation loss reaches `target_loss` (checked at each evaluation).
    full_val: also report, untimed, the final model's loss over every non-overlapping window of
    the whole validation split (`full_val_loss`), free of the sampling noise of eval_iters.
    """
    r = {**RECIPE, **changes}
    max_iters = r["max_iters"] if max_iters is None else max_iters
    torch.manual_seed(seed)
    start = time.perf_counter()
    model = GPT(vocab_size, r["n_layer"], r["n_head"], r["n_embd"], r["block_size"], r["dropout"])
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": r["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=r["learning_rate"], betas=(r["beta1"], r["beta2"]))

    def get_batch(split):
        data = np.memmap(train_bin if split == "train" else val_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - r["block_size"], (r["batch_size"],))
        x = torch.stack([torch.from_numpy(data[i:i + r["block_size"]].astype(np.int64)) for i in ix])
        y = torch.stack(
            [torch.from_numpy(data[i + 1:i + 1 + r["block_size"]].astype(np.int64)) for i in ix]
        )
        return x, y

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split in ("train", "val"):
            losses = torch.zeros(r["eval_iters"])
            for k in range(r["eval_iters"]):
                losses[k] = model(*get_batch(split))[1].item()
            out[split] = losses.mean().item()
        model.train()
        return out

    x, y = get_batch("train")
    train_seconds, evals, it = 0.0, [], 0
    while True:
        lr = _lr(it, r)
        for group in opt.param_groups:
            group["lr"] = lr
        if it % r["eval_interval"] == 0 or it == max_iters:
            losses = estimate_loss()
            evals.append({"iter": it, "val_loss": losses["val"], "train_loss": losses["train"],
                          "wall_seconds": time.perf_counter() - start})
            if target_loss is not None and losses["val"] <= target_loss:
                break
        if it == max_iters:
            break
        t0 = time.perf_counter()
        _, loss = model(x, y)
        x, y = get_batch("train")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        train_seconds += time.perf_counter() - t0
        it += 1
    result = {"iters": it, "train_seconds": train_seconds, "evals": evals,
              "wall_seconds": time.perf_counter() - start,
              "tokens_per_iter": r["batch_size"] * r["block_size"]}
    if full_val:
        result["full_val_loss"] = whole_split_loss(model, val_bin, r["block_size"])
    return result


@torch.no_grad()
def whole_split_loss(model, path, block_size: int, rows: int = 256) -> float:
    """Mean loss over every non-overlapping (block_size + 1)-token window of a uint16 file."""
    model.eval()
    data = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    starts = torch.arange(0, len(data) - block_size, block_size)  # (n,)
    total = 0.0
    for chunk in starts.split(rows):
        idx = chunk[:, None] + torch.arange(block_size + 1)  # (rows, T + 1)
        window = data[idx]
        total += model(window[:, :-1], window[:, 1:].contiguous())[1].item() * len(chunk)
    return total / len(starts)


def main() -> None:
    """`python benchmarks/nanogpt_recipe.py TRAIN.bin VAL.bin VOCAB [key=value ...]`: one
    run of the recipe as its own process; prints a JSON summary (evaluation times included)."""
    import json
    import sys

    start = time.perf_counter()
    train_bin, val_bin, vocab = sys.argv[1:4]
    changes = {k: float(v) if "." in v or "e" in v else int(v)
               for k, v in (a.split("=", 1) for a in sys.argv[4:])}
    result = run(train_bin, val_bin, int(vocab), **changes)
    result["process_seconds"] = time.perf_counter() - start
    print(json.dumps(result))


if __name__ == "__main__":
    main()
