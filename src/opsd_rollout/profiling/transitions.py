"""Timing the ``engine.eval()`` / ``engine.train()`` switches around a rollout (the hybrid engine does real
work there: swapping in inference containers, gathering, ``gc.collect`` and ``empty_cache``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from opsd_rollout.modeling import device_of
from opsd_rollout.profiling.clock import Clock, synchronize
from opsd_rollout.profiling.probes import PhaseProbes, add_housekeeping_probes


@dataclass
class ModeSwitchTimes:
    """Filled in by ``timed_eval``: how long the switches took (ms) and what ran inside them."""

    eval_ms: float | None = None
    train_ms: float | None = None
    gc_ms: float = 0.0
    """``gc.collect`` inside either switch."""
    empty_cache_ms: float = 0.0
    """Accelerator ``empty_cache`` inside either switch."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed_switch(engine: Any, method: str, clock: Clock, times: ModeSwitchTimes) -> float:
    probes = PhaseProbes(clock)
    add_housekeeping_probes(probes)
    synchronize(clock.device)
    start = clock.mark()
    with probes:
        getattr(engine, method)()
    synchronize(clock.device)
    elapsed = clock.elapsed_ms(start, clock.mark())
    totals = probes.totals()
    times.gc_ms += totals["gc"].ms if "gc" in totals else 0.0
    times.empty_cache_ms += totals["empty_cache"].ms if "empty_cache" in totals else 0.0
    return elapsed


@contextlib.contextmanager
def timed_eval(engine: Any, device: torch.device | str | None = None, *,
               train_after: bool | None = None) -> Iterator[ModeSwitchTimes]:
    """``with timed_eval(engine) as times: rollout.generate(...)``: ``engine.eval()`` on entry and
    ``engine.train()`` on exit, both timed (device synchronized around each). ``train_after=None`` switches
    back only if the engine was training; ``True`` always does (a training step follows)."""
    clock = Clock(torch.device(device) if device is not None else device_of(engine))
    times = ModeSwitchTimes()
    # a DeepSpeed engine switches its module's mode, not its own flag
    was_training = bool(getattr(getattr(engine, "module", engine), "training", True))
    times.eval_ms = _timed_switch(engine, "eval", clock, times)
    try:
        yield times
    finally:
        if train_after or (train_after is None and was_training):
            times.train_ms = _timed_switch(engine, "train", clock, times)
