"""The ``environment`` block of a result file, and the machine ceilings measured at start."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from opsd_rollout.bench.threads import Threads
from opsd_rollout.bench.timing import interleaved_times
from opsd_rollout.distributed import rank_info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing optional package is just "not installed"
        return None


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up: a ceiling, so the best, not the median."""
    return min(interleaved_times({"fn": fn}, repeats, device=device)["fn"]) / 1e3


def measure_ceilings(device: torch.device, *, copy_mib: int = 256, matmul_n: int = 1024,
                     repeats: int = 3) -> dict[str, Any]:
    """What this machine can do at best, for utilisation figures: bytes/s of a large copy and FLOP/s of a
    large fp32 matmul (best of ``repeats``)."""
    elements = copy_mib * 2**20 // 4
    source = torch.ones(elements, device=device)
    target = torch.empty_like(source)
    copy_s = _best_seconds(lambda: target.copy_(source), device, repeats)
    a = torch.randn(matmul_n, matmul_n, device=device)
    b = torch.randn(matmul_n, matmul_n, device=device)
    matmul_s = _best_seconds(lambda: a @ b, device, repeats)
    return {
        "memory_bandwidth_bytes_per_s": 2 * elements * 4 / copy_s,
        "matmul_flops_per_s": 2 * matmul_n**3 / matmul_s,
        "method": (f"bandwidth: best of {repeats} copies of a {copy_mib} MiB fp32 tensor, read + write bytes "
                   f"over time; compute: best of {repeats} fp32 {matmul_n}x{matmul_n} matmuls, 2n^3 FLOP over "
                   "time; on the benchmark device"),
    }


def environment_block(device: torch.device, ceilings: dict[str, Any] | None, threads: Threads) -> dict[str, Any]:
    """The run's environment; ``threads`` is what ``share_cores()`` decided for this rank."""
    ranks = rank_info()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "deepspeed": _version("deepspeed"),
        "opsd_rollout": _version("opsd_rollout"),
        "git_revision": _git_revision(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": threads.per_rank,
        "threads_source": threads.source,
        "kept_cores": list(threads.kept),
        "local_ranks": threads.local_ranks,
        "world_size": ranks.world_size,
        "platform": platform.platform(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "ceilings": ceilings,
    }
