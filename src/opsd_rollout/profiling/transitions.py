"""Timing the ``engine.eval()`` / ``engine.train()`` switches around a rollout (the hybrid engine does real
work there: swapping in inference containers, gathering, ``gc.collect`` and ``empty_cache``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from opsd_rollout.modeling import device_of
from opsd_rollout.profiling.clock import Clock
from opsd_rollout.profiling.probes import GC, PhaseProbes
from opsd_rollout.profiling.recorder import StageRecorder


class ModeSwitchTimes:
    """What ``timed_eval`` measured, read (one wait for the device, on CUDA) the first time a figure is asked for:
    recording the switches waits for nothing."""

    def __init__(self, clock: Clock):
        self._recorder = StageRecorder(clock, time_forwards=False)
        self._probes = PhaseProbes(clock)
        self._probes.watch_gc()
        self._read: dict[str, float | None] | None = None

    def switch(self, engine: torch.nn.Module, method: str) -> None:
        """``engine.<method>()`` (``eval`` or ``train``), timed."""
        with self._recorder.stage(method), self._recorder.probes(self._probes):
            getattr(engine, method)()
        self._read = None

    def to_dict(self) -> dict[str, float | None]:
        """``eval_ms``, ``train_ms`` (``None`` until ``engine.train()`` ran) and ``gc_ms``: the full garbage
        collections inside either switch."""
        if self._read is None:
            resolved = self._recorder.resolve()
            self._read = {"eval_ms": resolved.stages.get("eval"), "train_ms": resolved.stages.get("train"),
                          "gc_ms": resolved.phases[GC].ms if GC in resolved.phases else 0.0}
        return dict(self._read)

    @property
    def eval_ms(self) -> float | None:
        return self.to_dict()["eval_ms"]

    @property
    def train_ms(self) -> float | None:
        return self.to_dict()["train_ms"]

    @property
    def gc_ms(self) -> float:
        return self.to_dict()["gc_ms"] or 0.0


@contextlib.contextmanager
def timed_eval(engine: torch.nn.Module, device: torch.device | str | None = None, *,
               train_after: bool | None = None) -> Iterator[ModeSwitchTimes]:
    """``with timed_eval(engine) as times: rollout.generate(...)``: ``engine.eval()`` on entry and
    ``engine.train()`` on exit, both timed (on the device's clock, read when ``times`` is). ``train_after=None``
    switches back only if the engine was training; ``True`` always does (a training step follows)."""
    times = ModeSwitchTimes(Clock(torch.device(device) if device is not None else device_of(engine)))
    # a DeepSpeed engine switches its module's mode, not its own flag
    was_training = bool(getattr(getattr(engine, "module", engine), "training", True))
    times.switch(engine, "eval")
    try:
        yield times
    finally:
        if train_after or (train_after is None and was_training):
            times.switch(engine, "train")
