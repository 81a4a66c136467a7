"""torch.distributed for training: one process per device, started by torchrun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; without them training runs as a
single process. gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
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
