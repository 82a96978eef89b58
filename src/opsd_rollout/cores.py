"""Sharing the cores: how torch's OpenMP threads wait, chosen before torch starts.

Between parallel regions OpenMP's threads spin for a while (the active wait): the fastest choice on cores of one's
own, and a costly one on shared cores, where the spinning takes time the other process's threads need and theirs
takes ours. Measured on this project's 2-core machine (the built-in teacher's SFT step, benchmarks/RESULTS.md
"Sharing the cores"): alone, 232 ms active and 282 ms passive; beside one other 2-thread torch process, 713 ms active
and 433 ms passive. So ``train`` picks the passive wait when the cores are shared (other processes busy when it
starts, or several ranks on this machine), and leaves torch's default otherwise; ``OMP_WAIT_POLICY`` set by you
always wins. This module imports no torch: it must run before torch is imported to take effect.
"""

from __future__ import annotations

import logging
import os

import psutil

logger = logging.getLogger(__name__)

BUSY_CORES = 0.5
"""Other processes using at least this many cores when a run starts make its cores shared."""


def wait_policy(environ: dict[str, str], busy_cores: float, local_ranks: int) -> str | None:
    """The ``OMP_WAIT_POLICY`` to set (``PASSIVE``), or ``None`` to leave things as they are: the user's setting,
    or torch's default on cores of one's own."""
    if "OMP_WAIT_POLICY" in environ:
        return None
    return "PASSIVE" if local_ranks > 1 or busy_cores >= BUSY_CORES else None


def share_cores_politely(sample_s: float = 0.2) -> str | None:
    """Measure how busy the other processes keep the cores for ``sample_s`` seconds and set ``OMP_WAIT_POLICY``
    for this process (and the ranks or servers it starts) when they are shared; returns what was set. Call it before
    torch is imported: OpenMP reads the variable once, when it starts."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    busy = psutil.cpu_percent(interval=sample_s) / 100 * (os.cpu_count() or 1)
    policy = wait_policy(dict(os.environ), busy, local_ranks)
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
        logger.info("the cores are shared (%.1f busy, %d local ranks): OpenMP threads wait passively", busy,
                    local_ranks)
    return policy
