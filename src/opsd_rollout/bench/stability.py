"""Numbers a user can trust: warm up until a config is steady, record what could have disturbed it, and when
its iterations still spread, say why (cold start, interference, or the work's own variance) and what helps.

``warm_up`` runs a config until two consecutive calls agree (within a budget of calls and seconds), as
pyperf's calibration and triton's ``do_bench`` warm up by measurement rather than by a fixed count. The
first call's time (compilation, allocation, kernel JIT) is kept as its own figure.

``Interference`` samples the machine around a config's measured calls: the load average, the CPU time of this
process and of those it started (a served teacher's server is the run's own work) against wall time, the CPU time every other process used (from ``/proc/stat``), the hypervisor's steal
time, and on CUDA the other processes on the device where they are visible.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from opsd_rollout.bench.stats import Stats, median

OTHER_CORES_LIMIT = 0.5
"""Other processes busy on more than this many cores, on average, during a config: disturbed."""
STEAL_LIMIT = 0.05
"""More than this fraction of the machine's CPU time stolen by the hypervisor: disturbed."""
RESOLUTION_TICKS = 3
"""``/proc/stat`` counts CPU time in clock ticks (10 ms at Linux's usual 100 a second): other processes' or the
hypervisor's time of no more than this many ticks is within the counters' resolution, not a disturbance. Without
it a config measured in under a second was judged disturbed by a single tick (the sampling kernel's 90 ms: one
tick of steal in 190 ms of the machine's CPU time read as 5%; the post-processing kernel's 8 ms: 50%)."""


@dataclass
class Warmup:
    """How a config was warmed up."""

    iterations: int = 0
    """Unrecorded calls made before measuring."""
    first_call_ms: float | None = None
    """The config's first call, wall time: what compiling, allocating and JIT cost once."""
    times_ms: list[float] = field(default_factory=list)
    """Wall time of every warm-up call."""
    steady: bool | None = None
    """Whether the last two warm-up calls agreed within the tolerance (``None``: a fixed count was asked for)."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def warm_up(call: Callable[[], Any], *, fixed: int | None, max_iterations: int, max_seconds: float,
            tolerance: float, clock: Callable[[], float] = time.perf_counter,
            all_ranks: Callable[[bool], bool] = lambda done: done) -> Warmup:
    """Call ``call`` until it is steady: two consecutive calls within ``tolerance`` of each other (relative),
    at most ``max_iterations`` calls and ``max_seconds``; or exactly ``fixed`` calls when given. With several
    ranks ``all_ranks(done)`` says whether every rank is done, so all make the same number of calls."""
    warmup, start = Warmup(), clock()
    while True:
        if fixed is not None:
            done = warmup.iterations >= fixed
        else:
            steady = warmup.iterations >= 2 and _agree(warmup.times_ms[-2], warmup.times_ms[-1], tolerance)
            warmup.steady = steady
            done = steady or warmup.iterations >= max_iterations or clock() - start >= max_seconds
            done = all_ranks(done)
        if done:
            break
        before = clock()
        call()
        warmup.times_ms.append((clock() - before) * 1e3)
        warmup.iterations += 1
    warmup.first_call_ms = warmup.times_ms[0] if warmup.times_ms else None
    warmup.seconds = clock() - start
    return warmup


def _agree(a: float, b: float, tolerance: float) -> bool:
    return abs(b - a) <= tolerance * max(a, b, 1e-9)


def _ticks_per_second() -> int:
    """Linux's clock ticks a second (``/proc/stat``'s unit); 100 where it cannot be read."""
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100


def _proc_stat() -> tuple[float, float, float] | None:
    """(busy, total, steal) CPU seconds of the whole machine since boot, from Linux's /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [float(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = _ticks_per_second()
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return (user + nice + system + irq + softirq) / ticks, total / ticks, steal / ticks


def _gpu_processes() -> list[str] | None:
    """Other processes on the current CUDA device, where the driver lets us see them; ``None`` without CUDA."""
    import torch  # heavy: only sampled when a benchmark runs

    if not torch.cuda.is_available():
        return None
    try:
        listing = torch.cuda.list_gpu_processes()
    except Exception:  # noqa: BLE001 - pynvml missing or no permission: not visible
        return None
    mine = str(os.getpid())
    return [line.strip() for line in listing.splitlines()[1:] if line.strip() and mine not in line.split()]


@dataclass
class Interference:
    """What the machine did around a config's measured calls (see the module docstring)."""

    host: str = ""
    load_average: tuple[float, float] | None = None
    """The 1-minute load average at the start and at the end."""
    cpu_count: int = 1
    wall_seconds: float = 0.0
    process_cpu_seconds: float = 0.0
    """CPU time this run's processes used (all threads, and the processes it started; all local ranks once
    merged)."""
    machine_busy_seconds: float | None = None
    """CPU time every process on the machine used (``/proc/stat``)."""
    machine_seconds: float | None = None
    """CPU time the machine had (cores x wall, as the kernel counts it)."""
    steal_seconds: float | None = None
    gpu_other_processes: list[str] | None = None
    other_busy_cores: float | None = None
    """Cores other processes kept busy, on average: the machine's busy time less this run's, over wall time."""
    steal_fraction: float | None = None
    """Share of the machine's CPU time the hypervisor gave to other guests."""
    reasons: list[str] = field(default_factory=list)
    """Why the config counts as disturbed; empty when it does not."""

    @property
    def disturbed(self) -> bool:
        return bool(self.reasons)

    def judge(self) -> "Interference":
        """Fill in the derived figures and the reasons from the raw ones."""
        self.reasons = []
        resolution = RESOLUTION_TICKS / _ticks_per_second()
        if self.machine_busy_seconds is not None and self.wall_seconds > 0:
            others = max(0.0, self.machine_busy_seconds - self.process_cpu_seconds)
            self.other_busy_cores = others / self.wall_seconds
            if self.other_busy_cores > OTHER_CORES_LIMIT and others > resolution:
                self.reasons.append(f"other processes kept {self.other_busy_cores:.1f} of {self.cpu_count} cores busy")
        if self.steal_seconds is not None and self.machine_seconds:
            self.steal_fraction = self.steal_seconds / self.machine_seconds
            if self.steal_fraction > STEAL_LIMIT and self.steal_seconds > resolution:
                self.reasons.append(f"the hypervisor stole {100 * self.steal_fraction:.0f}% of the CPU time")
        if self.gpu_other_processes:
            self.reasons.append(f"{len(self.gpu_other_processes)} other process(es) on the GPU")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "disturbed": self.disturbed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Interference":
        return cls(**{k: v for k, v in data.items() if k != "disturbed"})


def merge_interference(views: list[Interference]) -> Interference:
    """One run's ranks on one machine: their processes are the run's own, so their CPU time adds up before
    what is left is charged to other processes (ranks on other hosts: the first host's view)."""
    host = [view for view in views if view.host == views[0].host]
    merged = Interference(**{**asdict(host[0]), "process_cpu_seconds": sum(v.process_cpu_seconds for v in host),
                             "gpu_other_processes": None})
    return merged.judge()


def merge_sequential(views: list[Interference]) -> Interference:
    """One config's processes, one after another: their times add up, the load is the first's at its start and the
    last's at its end, and the config is disturbed when any process was (``process k:`` before each reason), however
    quiet the others kept the totals."""
    first, last = views[0], views[-1]

    def total(name: str) -> float | None:
        values = [getattr(view, name) for view in views]
        return None if any(v is None for v in values) else sum(values)

    load = (first.load_average[0], last.load_average[1]) if first.load_average and last.load_average else None
    merged = Interference(host=first.host, load_average=load, cpu_count=first.cpu_count,
                          wall_seconds=total("wall_seconds"), process_cpu_seconds=total("process_cpu_seconds"),
                          machine_busy_seconds=total("machine_busy_seconds"), machine_seconds=total("machine_seconds"),
                          steal_seconds=total("steal_seconds"),
                          gpu_other_processes=[p for view in views for p in view.gpu_other_processes or []] or None)
    merged.judge()
    merged.reasons = [f"process {index}: {reason}" for index, view in enumerate(views, start=1)
                      for reason in view.reasons]
    return merged


def between_warning(medians: list[float]) -> str | None:
    """When the medians of a config's processes spread (IQR/median over 10%): what that means and what helps."""
    between = Stats.from_values(medians)
    if between is None or not between.noisy:
        return None
    return (f"total_ms spread between processes (IQR/median of their medians) is {100 * between.spread:.0f}%, over "
            "10%: fresh processes of the same code differ (memory layout, thread placement, clock state); compare "
            "judges by processes, and more --processes narrow its interval")


def run_cpu_seconds() -> float:
    """CPU time of this process and of the processes it started that are still running (a served teacher's
    server, compile workers): the run's own work, not interference."""
    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # it ended meanwhile
            continue
        total += times.user + times.system
    return total


class InterferenceMonitor:
    """``start()`` before a config's measured calls, ``stop()`` after: returns the ``Interference``. The readers
    are attributes so tests can plant a disturbance."""

    def __init__(self) -> None:
        self.read_stat: Callable[[], tuple[float, float, float] | None] = _proc_stat
        self.read_load: Callable[[], float | None] = lambda: os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self.read_process_cpu: Callable[[], float] = run_cpu_seconds
        self.read_gpu: Callable[[], list[str] | None] = _gpu_processes
        self.clock: Callable[[], float] = time.perf_counter
        self._start: tuple | None = None

    def start(self) -> None:
        self._start = (self.clock(), self.read_process_cpu(), self.read_stat(), self.read_load())

    def stop(self) -> Interference:
        wall0, cpu0, stat0, load0 = self._start
        wall, cpu, stat, load = self.clock() - wall0, self.read_process_cpu() - cpu0, self.read_stat(), self.read_load()
        result = Interference(host=socket.gethostname(), cpu_count=os.cpu_count() or 1, wall_seconds=wall,
                              process_cpu_seconds=cpu, gpu_other_processes=self.read_gpu(),
                              load_average=(load0, load) if load0 is not None and load is not None else None)
        if stat0 is not None and stat is not None:
            result.machine_busy_seconds, result.machine_seconds, result.steal_seconds = (
                b - a for a, b in zip(stat0, stat))
        return result.judge()


def spread_warning(total: Stats | None, warmup: Warmup | None, interference: Interference | None,
                   tolerance: float) -> str | None:
    """When a config's times spread (IQR/median over 10%): the likely cause and the remedy that fits it."""
    if total is None or not total.noisy:
        return None
    head = f"total_ms spread (IQR/median) is {100 * total.spread:.0f}%, over 10%: "
    if interference is not None and interference.disturbed:
        return head + f"interference ({'; '.join(interference.reasons)}); rerun when the machine is quiet"
    values = list(total.values)
    half = len(values) // 2
    if half and median(values[:half]) > (1 + tolerance) * median(values[-half:]):
        still = "" if warmup is None or warmup.steady is not False else " (warm-up ran out of budget before steady)"
        return head + (f"cold start: the first measured iterations were slower than the last{still}; warm up "
                       "longer (--warmup auto, --warmup-max-iterations, --warmup-max-seconds)")
    return head + "real variance of the work itself (no interference, no trend); add --iterations to narrow the median"
