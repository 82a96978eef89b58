"""Stage recording for one rollout: named spans on one clock, plus the model's forward passes.

``NULL_RECORDER`` is what an unprofiled rollout uses: every method is a no-op that touches no device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from opsd_rollout.profiling.clock import Clock
from opsd_rollout.profiling.forward import ForwardTime, ForwardTimer


class StageRecorder:
    """Records ``stage(name)`` spans and the forwards of one module; resolved once by ``read()``."""

    enabled = True

    def __init__(self, clock: Clock):
        self.clock = clock
        self._spans: dict[str, tuple[Any, Any]] = {}
        self._forward_timer: ForwardTimer | None = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = self.clock.mark()
        yield
        self._spans[name] = (start, self.clock.mark())

    @contextlib.contextmanager
    def forwards(self, module: torch.nn.Module) -> Iterator[None]:
        self._forward_timer = ForwardTimer(module, self.clock)
        with self._forward_timer:
            yield

    def stage_ms(self) -> dict[str, float]:
        return {name: max(0.0, self.clock.elapsed_ms(*span)) for name, span in self._spans.items()}

    def forward_times(self) -> list[ForwardTime]:
        return self._forward_timer.read() if self._forward_timer is not None else []


class _NullRecorder:
    enabled = False

    def stage(self, _name: str) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def forwards(self, _module: torch.nn.Module) -> contextlib.nullcontext:
        return contextlib.nullcontext()


NULL_RECORDER = _NullRecorder()
