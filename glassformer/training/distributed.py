"""torch.distributed for training: one process per device, started by torchrun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; without them training runs as a
single process. gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InputError


@dataclass(frozen=True)
class Process:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # whether setup() started the process group (and ends it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """The device `name` names, refused with ValueError where this machine has none such."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise InputError("device", f"unknown device {name!r} (cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device", f"{name!r} asked for, but CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise InputError("device", f"{name!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise InputError("device", f"{name!r} asked for, but MPS is not available here")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise InputError("device", f"{name!r} is not supported (cpu, cuda, cuda:N, mps)")
    return device


def setup(device_name: str = "auto") -> Process:
    """This process's rank and device; joins the process group when run under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name, local_rank)
    if world_size == 1 and not dist.is_initialized():
        return Process(device=device)
    owns = not dist.is_initialized()
    if owns:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Process(dist.get_rank(), dist.get_world_size(), device, owns)


def teardown(process: Process) -> None:
    if process.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(process: Process) -> None:
    if process.world_size > 1:
        dist.barrier()


def all_reduce_sum(process: Process, tensor: torch.Tensor) -> torch.Tensor:
    if process.world_size > 1:
        dist.all_reduce(tensor)
    return tensor
