"""Stage recording for one rollout: named spans on one clock, plus the model's forward passes.

Recording waits for nothing: marks are events on the stream on CUDA (the host's clock on the CPU), read once, by
``resolve()``. ``NULL_RECORDER`` is what an unprofiled rollout uses: every method is a no-op that touches no device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from opsd_rollout.profiling.clock import Clock
from opsd_rollout.profiling.forward import ForwardTime, ForwardTimer
from opsd_rollout.profiling.probes import PhaseProbes, PhaseTotal

ROOT = "total"
OWN_FORWARDS = ("compile",)
"""Phases whose forwards are theirs (a compiled step's first call for a shape), not prefill or decode steps."""


@dataclass(frozen=True)
class Span:
    """One timed interval of a rollout, relative to the start of the call."""

    name: str
    start_ms: float
    duration_ms: float
    parent: str | None
    """The enclosing stage, for nesting (``None`` for the whole call)."""


class StageRecorder:
    """Records nested ``stage(name)`` spans and the forwards of one module; resolved once by ``resolve()``.

    Marks are only recorded while the work runs (device events on CUDA: no synchronization) and read once at
    the end. A stage entered several times (a chunk loop) sums its spans."""

    enabled = True

    def __init__(self, clock: Clock, *, time_forwards: bool = True):
        self.clock = clock
        self.time_forwards = time_forwards
        self._marks: list[tuple[str, Any, Any, str | None]] = []
        self._stack: list[str] = []
        self._forward_timer: ForwardTimer | None = None
        self._forward_parent: str | None = None
        self._probes: PhaseProbes | None = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        parent = self._stack[-1] if self._stack else None
        self._stack.append(name)
        start = self.clock.mark()
        try:
            yield
        finally:
            self._stack.pop()
        self._marks.append((name, start, self.clock.mark(), parent))

    @contextlib.contextmanager
    def forwards(self, module: torch.nn.Module) -> Iterator[None]:
        if not self.time_forwards:
            yield
            return
        self._forward_parent = self._stack[-1] if self._stack else None
        self._forward_timer = ForwardTimer(module, self.clock)
        with self._forward_timer:
            yield

    @contextlib.contextmanager
    def probes(self, probes: PhaseProbes) -> Iterator[None]:
        """Install ``probes`` for the block; their calls are attributed to the forward they ran in, if any."""
        timer = self._forward_timer
        probes.current_forward = (lambda: timer.open_index()) if timer is not None else (lambda: None)
        self._probes = probes
        with probes:
            yield

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """Time the block as the attributed phase ``name`` (``compaction_ms``, ``compile_ms``, ...), as the
        probes time the calls they wrap; nothing outside ``probes(...)``."""
        return self._probes.timing(name) if self._probes is not None else contextlib.nullcontext()

    def count(self, name: str, launches: int, nbytes: int) -> None:
        """Charge ``launches`` moving ``nbytes`` to the attributed phase ``name`` (our own all-gather); nothing
        outside ``probes(...)``."""
        if self._probes is not None:
            self._probes.count(name, launches, nbytes)

    def resolve(self) -> "Resolved":
        """Read every mark once (the clock's one wait, ``Clock.settle``) into stage times, forwards, phases and
        spans; offsets count from the ``total`` stage's start (or the first mark's, without one)."""
        self.clock.settle()
        origin = next((start for name, start, _end, _parent in self._marks if name == ROOT), self._marks[0][1])
        stages: dict[str, float] = {}
        spans = []
        for name, start, end, parent in self._marks:
            ms = max(0.0, self.clock.elapsed_ms(start, end))
            stages[name] = stages.get(name, 0.0) + ms
            spans.append(Span(name, max(0.0, self.clock.elapsed_ms(origin, start)), ms, parent))
        phases: dict[str, PhaseTotal] = self._probes.totals() if self._probes is not None else {}
        inside: dict[int, float] = {}
        owned: list[tuple[float, float]] = []
        for record in self._probes.records if self._probes is not None else []:
            ms = max(0.0, self.clock.elapsed_ms(record.start, record.end))
            start_ms = max(0.0, self.clock.elapsed_ms(origin, record.start))
            spans.append(Span(record.phase, start_ms, ms, "generation"))
            if record.forward_index is not None:
                inside[record.forward_index] = inside.get(record.forward_index, 0.0) + ms
            if record.phase in OWN_FORWARDS:
                owned.append((start_ms, start_ms + ms))
        forwards = None
        if self._forward_timer is not None:
            forwards = [dataclasses.replace(f, attributed_ms=inside.get(i, 0.0))
                        for i, f in enumerate(self._forward_timer.read(origin=origin))]
            forwards = [f for f in forwards if not any(start <= f.offset_ms <= end for start, end in owned)]
            spans += [Span(f"{f.kind} forward", max(0.0, f.offset_ms), f.ms, self._forward_parent) for f in forwards]
        elif self.time_forwards:
            forwards = []
        spans.sort(key=lambda span: span.start_ms)
        return Resolved(stages, forwards, phases, spans)


@dataclass(frozen=True)
class Resolved:
    """A recorder's marks, read."""

    stages: dict[str, float]
    forwards: list[ForwardTime] | None
    """``None`` when forward timing was off."""
    phases: dict[str, PhaseTotal]
    spans: list[Span]


class _NullRecorder:
    enabled = False

    def stage(self, _name: str) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def forwards(self, _module: torch.nn.Module) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def probes(self, _probes: PhaseProbes | None) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def phase(self, _name: str) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def count(self, _name: str, _launches: int, _nbytes: int) -> None:
        pass


NULL_RECORDER = _NullRecorder()
"""A recorder that records nothing: what a function takes when its caller times no stage."""
Recorder: TypeAlias = "StageRecorder | _NullRecorder"
"""What a timed function takes: a ``StageRecorder``, or ``NULL_RECORDER``."""

Recorder: TypeAlias = "StageRecorder | _NullRecorder"
"""What a profiled call records its stages on: a ``StageRecorder``, or ``NULL_RECORDER`` when it is not profiled."""
