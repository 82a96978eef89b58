"""Stage recording for one rollout: named spans on one clock, plus the model's forward passes.

``NULL_RECORDER`` is what an unprofiled rollout uses: every method is a no-op that touches no device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from opsd_rollout.profiling.clock import Clock
from opsd_rollout.profiling.forward import ForwardTime, ForwardTimer

ROOT = "total"


@dataclass(frozen=True)
class Span:
    """One timed interval of a rollout, relative to the start of the call."""

    name: str
    start_ms: float
    duration_ms: float
    parent: str | None
    """The enclosing stage, for nesting (``None`` for the whole call)."""


class StageRecorder:
    """Records nested ``stage(name)`` spans and the forwards of one module; resolved once by ``resolve()``."""

    enabled = True

    def __init__(self, clock: Clock, *, time_forwards: bool = True):
        self.clock = clock
        self.time_forwards = time_forwards
        self._marks: dict[str, tuple[Any, Any, str | None]] = {}
        self._stack: list[str] = []
        self._forward_timer: ForwardTimer | None = None
        self._forward_parent: str | None = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        parent = self._stack[-1] if self._stack else None
        self._stack.append(name)
        start = self.clock.mark()
        try:
            yield
        finally:
            self._stack.pop()
        self._marks[name] = (start, self.clock.mark(), parent)

    @contextlib.contextmanager
    def forwards(self, module: torch.nn.Module) -> Iterator[None]:
        if not self.time_forwards:
            yield
            return
        self._forward_parent = self._stack[-1] if self._stack else None
        self._forward_timer = ForwardTimer(module, self.clock)
        with self._forward_timer:
            yield

    def resolve(self) -> tuple[dict[str, float], list[ForwardTime] | None, list[Span]]:
        """``(stage ms by name, forward times or None when not timed, timeline spans)``."""
        origin = self._marks[ROOT][0]
        stages, spans = {}, []
        for name, (start, end, parent) in self._marks.items():
            stages[name] = max(0.0, self.clock.elapsed_ms(start, end))
            spans.append(Span(name, max(0.0, self.clock.elapsed_ms(origin, start)), stages[name], parent))
        forwards = None
        if self._forward_timer is not None:
            forwards = self._forward_timer.read(origin=origin)
            spans += [Span(f"{f.phase} forward", max(0.0, f.offset_ms), f.ms, self._forward_parent) for f in forwards]
        elif self.time_forwards:
            forwards = []
        spans.sort(key=lambda span: span.start_ms)
        return stages, forwards, spans


class _NullRecorder:
    enabled = False

    def stage(self, _name: str) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def forwards(self, _module: torch.nn.Module) -> contextlib.nullcontext:
        return contextlib.nullcontext()


NULL_RECORDER = _NullRecorder()
