"""The optimizers: AdamW for every parameter, or Muon for the blocks' matrices with AdamW for
the rest.

AdamW (Loshchilov & Hutter, 2019) decays matrices and embeddings, not gains or biases.
Muon (Jordan et al., 2024; `torch.optim.Muon`) takes the momentum of each hidden weight
matrix and replaces it by the nearest semi-orthogonal matrix (a few Newton–Schulz
iterations), so every direction of the update moves at the same rate; it applies to the
matrices inside the blocks only. Embeddings, the head, gains and biases stay with AdamW.
Each param group carries its own `initial_lr`; the schedule scales them all alike.
"""

from __future__ import annotations

import torch
from torch import nn

from .training_config import TrainConfig


class Optimizers:
    """Several optimizers over disjoint parameters, stepped, zeroed and saved as one.

    state_dict() has the layout of a single optimizer's (parameters numbered across all), so
    checkpoints store it the same way."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups, offset = list(state_dict["param_groups"]), 0
        if len(groups) != len(self.param_groups):
            raise ValueError("the saved optimizer state has a different set of parameter groups")
        for opt in self.optimizers:
            mine, groups = groups[: len(opt.param_groups)], groups[len(opt.param_groups):]
            count = sum(len(g["params"]) for g in mine)
            opt.load_state_dict({
                "state": {i - offset: s for i, s in state_dict["state"].items()
                          if offset <= i < offset + count},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
            })
            offset += count


def _adamw_groups(params: list[nn.Parameter], config: TrainConfig) -> list[dict]:
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay,
         "initial_lr": config.lr},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0,
         "initial_lr": config.lr},
    ]


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW | Optimizers:
    """config.optimizer "adamw": fused AdamW, weight decay on ≥ 2-D parameters (matrices,
    embeddings) only. "muon": Muon for the weights of the blocks' linear layers, at
    config.muon_lr, and that AdamW for every other parameter."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    adamw = dict(betas=(config.beta1, config.beta2), fused=True)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(_adamw_groups(params, config), lr=config.lr, **adamw)
    hidden = {id(m.weight): m.weight for block in model.blocks for m in block.modules()
              if isinstance(m, nn.Linear) and m.weight.requires_grad}
    rest = [p for p in params if id(p) not in hidden]
    muon = torch.optim.Muon(
        [{"params": list(hidden.values()), "initial_lr": config.muon_lr}], lr=config.muon_lr,
        weight_decay=config.weight_decay, momentum=config.muon_momentum,
    )
    return Optimizers([muon, torch.optim.AdamW(_adamw_groups(rest, config), lr=config.lr, **adamw)])


def set_learning_rate(optimizer, lr: float, config: TrainConfig) -> None:
    """Scale every group's initial rate by lr / config.lr (the schedule's factor)."""
    factor = lr / config.lr if config.lr else 0.0
    for group in optimizer.param_groups:
        group["lr"] = factor * group.get("initial_lr", config.lr)
