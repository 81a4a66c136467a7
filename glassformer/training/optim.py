"""The optimizers: AdamW for every parameter, or Muon for the blocks' matrices with AdamW for
the rest.

AdamW (Loshchilov & Hutter, 2019) decays matrices and embeddings, not gains or biases.
Muon (Jordan et al., 2024; `torch.optim.Muon`) takes the momentum of each hidden weight
matrix and replaces it by about the nearest semi-orthogonal matrix (a few Newton–Schulz
iterations), so every direction of the update moves at the same rate; it applies to the
matrices inside the blocks only. Embeddings, the head, gains and biases stay with AdamW.
`StackedMuon` runs torch's update with the iterations of same-shaped matrices batched into
one product each (at this scale, most of Muon's time is the per-product cost), in bfloat16
as torch's where bfloat16 products measured faster on this CPU, else in float32 (the same
iterations, less rounded; accel/decisions.py). In
float32 on a CPU with the C++ kernels, `accel/csrc/newton_schulz.cpp` runs the whole step (the
momentum, the same iterations, the update) a matrix per thread at a time, its chain of small
products kept in that core's cache.
Each param group carries its own `initial_lr`; the schedule scales them all alike.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim._muon import _adjust_lr

from ..accel import kernels
from ..accel.decisions import bf16_products_pay
from ..errors import InputError
from ..model.transformer import Transformer
from .config import TrainConfig


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
            raise InputError(None, "the saved optimizer state has a different set of parameter groups")
        for opt in self.optimizers:
            mine, groups = groups[: len(opt.param_groups)], groups[len(opt.param_groups):]
            count = sum(len(g["params"]) for g in mine)
            opt.load_state_dict({
                "state": {i - offset: s for i, s in state_dict["state"].items()
                          if offset <= i < offset + count},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
            })
            offset += count


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bfloat16, as torch.optim.Muon iterates, except on a CPU where bfloat16 products do not
    pay (measured once, at the first call)."""
    if device.type == "cpu" and not bf16_products_pay():
        return torch.float32
    return torch.bfloat16


def orthogonalize(updates: torch.Tensor, coefficients, steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Newton–Schulz iterations X <- a X + (b A + c A²) X with A = X Xᵀ, on a stack of
    matrices (n, rows, cols) in `dtype`, each first scaled to Frobenius norm 1; they drive
    every singular value towards 1 (to about 0.7-1.2 with Muon's coefficients)."""
    a, b, c = coefficients
    x = updates.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the wide orientation: the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    if dtype == torch.float32 and x.device.type == "cpu" and kernels.available():
        # the same iterations, each matrix's chain on one thread
        x = kernels.newton_schulz(x, *coefficients, steps)
    elif dtype == torch.float32 and x.shape[-1] >= 2 * x.shape[-2]:
        x = _iterate_on_gram(x, coefficients, steps)
    else:
        for _ in range(steps):
            gram = x @ x.mT  # (n, short, short)
            polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, polynomial, x, beta=a)
    return x.mT if tall else x


def _iterate_on_gram(x: torch.Tensor, coefficients, steps: int) -> torch.Tensor:
    """The same iterations carried by the Gram matrix of a wide stack x (n, short, long): with
    P_k = a I + b A_k + c A_k², X_{k+1} = P_k X_k, so X_steps = P_{steps-1} ··· P_0 X_0 and, as
    P_k commutes with A_k, A_{k+1} = P_k A_k P_k. Two short × long products in all instead of
    three per step: about 35% fewer FLOPs once long ≥ 2 short. Float32 only: in bfloat16 the
    accumulated product rounds differently from torch's iteration."""
    a, b, c = coefficients
    gram = x @ x.mT  # (n, short, short)
    product = None  # P_k ··· P_0 (n, short, short)
    for k in range(steps):
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A²
        polynomial.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
        product = polynomial if product is None else polynomial @ product
        if k < steps - 1:
            gram = polynomial @ gram @ polynomial
    return x if product is None else product @ x


class StackedMuon(torch.optim.Muon):
    """torch.optim.Muon, same arguments, state and result, with each param group's matrices
    of one shape updated together; in float32 on the CPU, where the kernels are built, every
    matrix of a group in one C++ call instead. `ns_dtype`: the iterations' dtype (None: by the
    device, `newton_schulz_dtype`)."""

    def __init__(self, params, *args, ns_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and self._in_kernels(params):
                self._update_in_kernels(group, params)
                continue
            by_shape: dict[torch.Size, list[nn.Parameter]] = {}
            for p in params:
                by_shape.setdefault(p.shape, []).append(p)
            for shape, shaped in by_shape.items():
                self._update(group, shape, shaped)
        return loss

    def _in_kernels(self, params: list[nn.Parameter]) -> bool:
        """Whether the C++ step applies: float32 iterations of float32 CPU matrices."""
        dtype = self.ns_dtype or newton_schulz_dtype(params[0].device)
        return (dtype == torch.float32 and kernels.available()
                and all(p.device.type == "cpu" and p.dtype == torch.float32
                        and p.grad.dtype == torch.float32 and not p.grad.is_sparse for p in params))

    def _update_in_kernels(self, group: dict, params: list[nn.Parameter]) -> None:
        """`_update` for every matrix of the group in one C++ call, a matrix per thread at a
        time (each matrix's momentum, iterations and update stay in one core's cache)."""
        lr = group["lr"]
        buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
        rates = [_adjust_lr(lr, group["adjust_lr_fn"], p.shape) for p in params]
        kernels.muon_update(params, [p.grad for p in params], buffers, rates, group["momentum"],
                            group["nesterov"], *group["ns_coefficients"], group["ns_steps"],
                            group["eps"], 1 - lr * group["weight_decay"])

    def _update(self, group: dict, shape: torch.Size, params: list[nn.Parameter]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        grads = [p.grad for p in params]
        buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        if group["nesterov"]:
            updates = torch.stack(grads).lerp_(torch.stack(buffers), momentum)  # (n, rows, cols)
        else:
            updates = torch.stack(buffers)
        dtype = self.ns_dtype or newton_schulz_dtype(updates.device)
        ortho = orthogonalize(updates, group["ns_coefficients"], group["ns_steps"], group["eps"],
                              dtype)
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        step = _adjust_lr(lr, group["adjust_lr_fn"], shape)  # torch's own rule
        torch._foreach_add_(params, list(ortho.float().unbind(0)), alpha=-step)


def _adamw_groups(params: list[nn.Parameter], config: TrainConfig) -> list[dict]:
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay,
         "initial_lr": config.lr},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0,
         "initial_lr": config.lr},
    ]


def make_optimizer(model: Transformer, config: TrainConfig) -> torch.optim.AdamW | Optimizers:
    """config.optimizer "adamw": fused AdamW, weight decay on ≥ 2-D parameters (matrices,
    embeddings) only. "muon": Muon for the weights of the blocks' linear layers, at
    config.muon_lr, and that AdamW for every other parameter."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    adamw = dict(betas=(config.beta1, config.beta2), fused=True)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(_adamw_groups(params, config), lr=config.lr, **adamw)
    hidden = {id(m.weight): m.weight for m in model.linear_layers().values()
              if m is not model.lm_head and m.weight.requires_grad}
    rest = [p for p in params if id(p) not in hidden]
    device = next(iter(hidden.values())).device if hidden else torch.device("cpu")
    muon = StackedMuon(
        [{"params": list(hidden.values()), "initial_lr": config.muon_lr}], lr=config.muon_lr,
        weight_decay=config.weight_decay, momentum=config.muon_momentum,
        ns_dtype=newton_schulz_dtype(device),  # decided here, not inside the first step
    )
    return Optimizers([muon, torch.optim.AdamW(_adamw_groups(rest, config), lr=config.lr, **adamw)])


def set_learning_rate(optimizer, lr: float, config: TrainConfig) -> None:
    """Scale every group's initial rate by lr / config.lr (the schedule's factor)."""
    factor = lr / config.lr if config.lr else 0.0
    for group in optimizer.param_groups:
        group["lr"] = factor * group.get("initial_lr", config.lr)
