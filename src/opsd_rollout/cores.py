"""Sharing the cores: how torch's OpenMP threads wait, chosen before torch starts.

Between parallel regions OpenMP's threads spin for a while (the active wait): the fastest choice on cores of one's
own, and a costly one on shared cores, where the spinning takes time the other process's threads need and theirs
takes ours. Measured on this project's 2-core machine (the built-in teacher's SFT step, benchmarks/RESULTS.md
"Sharing the cores"): alone, 232 ms active and 282 ms passive; beside one other 2-thread torch process, 713 ms active
and 433 ms passive. So ``train`` picks the passive wait when the cores are shared (other processes busy when it
starts), and leaves torch's default otherwise; ``OMP_WAIT_POLICY`` set by you always wins, and a launcher's ranks
are left as they are. This module imports no torch: it must run before torch is imported to take effect.
"""

from __future__ import annotations

import logging
import os

import psutil

logger = logging.getLogger(__name__)

BUSY_CORES = 0.5
"""Other processes using at least this many cores when a run starts make its cores shared."""


def wait_policy(environ: dict[str, str], busy_cores: float) -> str | None:
    """The ``OMP_WAIT_POLICY`` to set (``PASSIVE``), or ``None`` to leave things as they are: the user's setting,
    a launcher's rank (its ranks start together and would each see the others as load; left to the user, see
    docs/MULTIRANK.md), or torch's default on cores of one's own."""
    if "OMP_WAIT_POLICY" in environ or "LOCAL_RANK" in environ:
        return None
    return "PASSIVE" if busy_cores >= BUSY_CORES else None


def share_cores_politely(sample_s: float = 0.2) -> str | None:
    """Measure how busy the other processes keep the cores for ``sample_s`` seconds and set ``OMP_WAIT_POLICY``
    for this process (and the ranks or servers it starts) when they are shared; returns what was set. Call it before
    torch is imported: OpenMP reads the variable once, when it starts."""
    if "OMP_WAIT_POLICY" in os.environ or "LOCAL_RANK" in os.environ:
        return None
    busy = psutil.cpu_percent(interval=sample_s) / 100 * (os.cpu_count() or 1)
    policy = wait_policy(dict(os.environ), busy)
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
        logger.info("the cores are shared (%.1f of them busy): OpenMP threads wait passively", busy)
    return policy
