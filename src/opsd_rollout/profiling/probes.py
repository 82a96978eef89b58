"""Phase probes: time named callables on live objects for the duration of one rollout, then put them back.

Nothing in DeepSpeed or transformers is edited: a probe replaces an attribute on an object (an instance,
a module such as ``gc``) with a timing wrapper while active, and restores it exactly on exit, exceptions
included (an attribute the object did not own is deleted again, so the class's one shows through).

Timed probes synchronize the device around each call, so asynchronous work is charged to the phase
that launched it; profiling is opt-in, and this is part of its cost. A timed call nested inside another
timed call is charged to the outer one only, so phases never double count. Counting probes (no timing)
record calls and bytes, e.g. ZeRO-3 all-gathers launched inside a timed fetch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from opsd_rollout.profiling.clock import Clock, synchronize

logger = logging.getLogger(__name__)


@dataclass
class PhaseTotal:
    ms: float = 0.0
    """Time of the phase's timed calls."""
    calls: int = 0
    """Timed calls charged to the phase."""
    events: int = 0
    """Calls seen by the phase's counting probes (e.g. all-gathers launched)."""
    bytes: int = 0
    """Bytes reported by the counting probes' ``measure``."""


@dataclass(frozen=True)
class _Probe:
    obj: Any
    name: str
    phase: str
    timed: bool
    measure: Callable[..., int] | None


@dataclass
class ProbeRecord:
    """One timed call: its phase, marks, and the forward it ran inside (index into the forwards), if any."""

    phase: str
    start: Any
    end: Any
    forward_index: int | None


@dataclass
class PhaseProbes:
    """A set of probes, installed by ``with probes:`` and removed on exit."""

    clock: Clock
    current_forward: Callable[[], int | None] = lambda: None
    """Tells which forward pass (if any) is running when a probed call starts."""
    records: list[ProbeRecord] = field(default_factory=list)
    counts: dict[str, PhaseTotal] = field(default_factory=dict)
    _probes: list[_Probe] = field(default_factory=list)
    _installed: list[tuple[Any, str, bool, Any]] = field(default_factory=list)
    _depth: int = 0

    def add(self, obj: Any, name: str, phase: str, *, timed: bool = True,
            measure: Callable[..., int] | None = None) -> bool:
        """Probe ``obj.name`` as ``phase``; ``measure(*args, **kwargs)`` returns bytes moved by a call.
        Returns False (and probes nothing) when ``obj`` has no such callable."""
        if obj is None or not callable(getattr(obj, name, None)):
            return False
        self._probes.append(_Probe(obj, name, phase, timed, measure))
        return True

    def __enter__(self) -> "PhaseProbes":
        try:
            for probe in self._probes:
                self._install(probe)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _install(self, probe: _Probe) -> None:
        owned = probe.name in getattr(probe.obj, "__dict__", {})
        original = getattr(probe.obj, probe.name)
        try:
            setattr(probe.obj, probe.name, self._wrap(probe, original))
        except (AttributeError, TypeError) as error:  # slots, builtins: cannot probe, say so and go on
            logger.info("cannot probe %s.%s: %s", type(probe.obj).__name__, probe.name, error)
            return
        self._installed.append((probe.obj, probe.name, owned, original))

    def _restore(self) -> None:
        while self._installed:
            obj, name, owned, original = self._installed.pop()
            if owned:
                setattr(obj, name, original)
            else:
                delattr(obj, name)

    def _wrap(self, probe: _Probe, original: Callable[..., Any]) -> Callable[..., Any]:
        totals = self.counts.setdefault(probe.phase, PhaseTotal())

        def counted(*args: Any, **kwargs: Any) -> Any:
            totals.events += 1
            if probe.measure is not None:
                totals.bytes += probe.measure(*args, **kwargs)
            return original(*args, **kwargs)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.timing(probe.phase):
                return original(*args, **kwargs)

        return timed if probe.timed else counted

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase`` (what a timed probe does around its call; the code that runs a phase can
        record it itself this way)."""
        totals = self.counts.setdefault(phase, PhaseTotal())
        if self._depth:  # inside another timed call: charged there
            yield
            return
        self._depth += 1
        totals.calls += 1
        synchronize(self.clock.device)
        start, forward = self.clock.mark(), self.current_forward()
        try:
            yield
        finally:
            synchronize(self.clock.device)
            self.records.append(ProbeRecord(phase, start, self.clock.mark(), forward))
            self._depth -= 1

    def totals(self) -> dict[str, PhaseTotal]:
        """Per phase: time of its timed calls, and calls/bytes of every call."""
        out = {phase: PhaseTotal(0.0, t.calls, t.events, t.bytes) for phase, t in self.counts.items()}
        for record in self.records:
            out[record.phase].ms += max(0.0, self.clock.elapsed_ms(record.start, record.end))
        return out


def add_housekeeping_probes(probes: PhaseProbes) -> None:
    """``gc.collect`` as ``gc`` and the accelerator's ``empty_cache`` (DeepSpeed's accelerator object and
    ``torch.cuda``) as ``empty_cache``: what the hybrid engine and trainers call on the hot path."""
    probes.add(gc, "collect", "gc")
    probes.add(get_accelerator(), "empty_cache", "empty_cache")
    if torch.cuda.is_available():
        probes.add(torch.cuda, "empty_cache", "empty_cache")
