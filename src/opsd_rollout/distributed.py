"""Rank information without requiring torch.distributed to be initialized."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info() -> RankInfo:
    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size())
    return RankInfo(0, 1)


def several_ranks() -> bool:
    """Whether this process is one of several ranks of a process group: the one test before a collective that
    one rank (or no group at all) skips."""
    return rank_info().world_size > 1


def partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitions (gathered collectively in every forward)."""
    return any(hasattr(p, "ds_status") for p in module.parameters())


def agree_max(values: list[int], device: torch.device | str = "cpu") -> list[int]:
    """Every rank's largest of each of ``values`` (one all-reduce; as given with one rank): how ranks whose work
    differs agree on a number of collective calls."""
    if not several_ranks():
        return list(values)
    flags = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [int(v) for v in flags.tolist()]


def agree_all(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` holds on every rank (one all-reduce; as given with one rank): how ranks agree on a choice
    that decides their collective calls."""
    if not several_ranks():
        return flag
    value = torch.tensor(int(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def gather_objects(payload: Any) -> list[Any]:
    """Every rank's ``payload`` (picklable), in rank order, on every rank (``[payload]`` with one rank)."""
    if not several_ranks():
        return [payload]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    return gathered


LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE",
                "CROSS_RANK", "CROSS_SIZE")
"""What a launcher (torchrun, DeepSpeed's, or a one-process group made in this process) puts in the environment."""


def environment_without_ranks() -> dict[str, str]:
    """This process's environment minus ``LAUNCHER_ENV``, for child processes that start ranks of their own."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}


def free_port() -> int:
    """A free TCP port on loopback, for a new process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
