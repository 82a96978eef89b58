"""How many threads each rank computes with, and why.

Under a launcher the ranks of one machine share its cores: unless ``OMP_NUM_THREADS`` says otherwise, each
rank gets ``cores // local ranks`` threads. The DeepSpeed launcher leaves every rank torch's default (all the
cores, so two ranks on two cores run two threads each); torchrun sets ``OMP_NUM_THREADS=1`` for its ranks
when you did not set it, a launcher's default rather than a choice, so it is replaced the same way.

A run may keep its last cores for another process (the step benchmark's served teacher, ``--split-cores``): the
run then runs on the others, one thread a core, and the kept cores are the other process's alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class Threads:
    """The thread count a rank computes with and where it came from (the result's ``environment``)."""

    per_rank: int
    """torch's intra-op threads in this rank."""
    local_ranks: int
    """Ranks on this machine: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (DeepSpeed); 1
    without a launcher."""
    cores: int
    """The machine's logical cores (``os.cpu_count()``)."""
    source: str
    """``OMP_NUM_THREADS`` (set by you, or by a launcher on your behalf), ``shared`` (the cores divided among
    the local ranks), ``kept`` (the cores left after those kept for another process, divided among the local
    ranks) or ``torch`` (torch's own default, one rank)."""
    kept: tuple[int, ...] = ()
    """The cores kept for another process (``share_cores(keep=...)``), which this one does not run on."""


def local_ranks() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


def _parent_environment() -> bytes | None:
    """The environment this process's parent was started with (Linux), or ``None`` where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as environ:
            return environ.read()
    except OSError:
        return None


def torchrun_default_threads() -> bool:
    """Whether ``OMP_NUM_THREADS=1`` is torchrun's default: we are a torchrun worker, and torchrun itself was
    started without the variable (it sets 1 for its workers then). Where that cannot be read, the variable
    stands."""
    if os.environ.get("OMP_NUM_THREADS") != "1" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = _parent_environment()
    return parent is not None and not any(entry.startswith(b"OMP_NUM_THREADS=") for entry in parent.split(b"\0"))


def share_cores(keep: int = 0) -> Threads:
    """Give this rank its share of the machine's cores unless ``OMP_NUM_THREADS`` chose a count, and say which;
    ``keep``: first take this process off its last ``keep`` cores (Linux), kept for another process."""
    cores, local = os.cpu_count() or 1, local_ranks()
    kept = keep_cores(keep) if keep else ()
    if "OMP_NUM_THREADS" in os.environ and not torchrun_default_threads():
        source = "OMP_NUM_THREADS"
    elif kept:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
        source = "kept"
    elif local > 1:
        torch.set_num_threads(max(1, cores // local))
        source = "shared"
    else:
        source = "torch"
    return Threads(per_rank=torch.get_num_threads(), local_ranks=local, cores=cores, source=source, kept=kept)


def keep_cores(count: int) -> tuple[int, ...]:
    """Take this process off the last ``count`` of the cores it may run on, and return them; a ``ValueError`` where
    that would leave it none, or the platform cannot pin a process to cores."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("keeping cores for another process (--split-cores) needs Linux's CPU affinity")
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) <= count:
        raise ValueError(f"keeping {count} core(s) for another process (--split-cores) needs more than {count}: this "
                         f"process may run on {len(mine)}")
    os.sched_setaffinity(0, mine[:-count])
    return tuple(mine[-count:])
