"""Attributed phases: the work that hides inside a rollout (a ZeRO-3 gather, LoRA fuse, a garbage collection),
timed on the rollout's clock while it runs.

What is timed never reaches past the rollout:

- calls our own code makes are timed where it makes them (``timing``; the recorder's ``phase``), and counted with
  what they moved (``count``);
- methods of objects the rollout owns or is handed (the DeepSpeed engine, its ZeRO-3 coordinator, a PEFT model, the
  KV workspace) are timed by a wrapper set on that instance for the call and removed after it, exceptions included
  (``add``). A module or a class is refused: a wrapper on ``gc.collect`` or ``torch.cuda.empty_cache`` would change
  them for every thread of the process;
- full garbage collections are seen through ``gc.callbacks``, the interpreter's own hook (``watch_gc``).

Only the thread that entered the probes is timed: another thread (a served teacher's sender) that calls a probed
method or collects garbage meanwhile runs as if nothing were installed, and is charged nothing.

Timing never waits for the device: a phase is two marks of the rollout's clock, CUDA events on the stream (read
once, when the profile resolves) or the host's clock on the CPU. On CUDA a phase is thus the device's time from the
phase's start to its end: the device work queued in it, and any time the device sat idle waiting for the host in
between; host work the device never waited for cost the rollout nothing and shows as nothing. A timed call nested
in another timed call is charged to the outer one only, so phases never double count.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from opsd_rollout.profiling.clock import Clock
from opsd_rollout.profiling.forward import stream_capturing

logger = logging.getLogger(__name__)

GC = "gc"
"""The phase of the full garbage collections (``watch_gc``)."""


@dataclass
class PhaseTotal:
    ms: float = 0.0
    """Time of the phase's timed calls."""
    calls: int = 0
    """Timed calls charged to the phase."""
    events: int = 0
    """What its counting probes and ``count`` saw launched (e.g. ZeRO-3 all-gathers)."""
    bytes: int = 0
    """Bytes those launches moved."""


@dataclass(frozen=True)
class _Probe:
    obj: Any
    name: str
    phase: str
    timed: bool
    measure: Callable[..., tuple[int, int]] | None


@dataclass
class ProbeRecord:
    """One timed call: its phase, marks, and the forward it ran inside (index into the forwards), if any."""

    phase: str
    start: Any
    end: Any
    forward_index: int | None


@dataclass(eq=False)
class PhaseProbes:
    """A set of probes, installed by ``with probes:`` (in the thread that times) and removed on exit."""

    clock: Clock
    current_forward: Callable[[], int | None] = lambda: None
    """Tells which forward pass (if any) is running when a probed call starts."""
    records: list[ProbeRecord] = field(default_factory=list)
    counts: dict[str, PhaseTotal] = field(default_factory=dict)
    _probes: list[_Probe] = field(default_factory=list)
    _installed: list[tuple[Any, str, bool, Any]] = field(default_factory=list)
    _gc: bool = False
    _gc_open: Any = None
    _depth: int = 0
    _thread: int | None = None

    def add(self, obj: Any, name: str, phase: str, *, timed: bool = True,
            measure: Callable[..., tuple[int, int]] | None = None) -> bool:
        """Probe ``obj.name`` as ``phase``: timed, or (``timed=False``) counted, ``measure(*args, **kwargs)`` giving
        a call's ``(launches, bytes)`` (default one launch, no bytes). Returns False (and probes nothing) when
        ``obj`` has no such callable; a module or a class is a ``TypeError``."""
        if isinstance(obj, (types.ModuleType, type)):
            raise TypeError(f"probes go on objects the rollout owns, not on {obj.__name__}.{name}: a wrapper there "
                            "would change it for the whole process")
        if obj is None or not callable(getattr(obj, name, None)):
            return False
        self._probes.append(_Probe(obj, name, phase, timed, measure))
        return True

    def watch_gc(self) -> None:
        """Time the full garbage collections (generation 2: every ``gc.collect()``, and the rare automatic one) that
        run in the timing thread, as ``gc``; the younger generations' automatic collections are left out."""
        self._gc = True

    def __enter__(self) -> "PhaseProbes":
        self._thread = threading.get_ident()
        try:
            for probe in self._probes:
                self._install(probe)
            if self._gc:
                gc.callbacks.append(self._on_gc)
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
        except (AttributeError, TypeError) as error:  # slots: cannot probe, say so and go on
            logger.info("cannot probe %s.%s: %s", type(probe.obj).__name__, probe.name, error)
            return
        self._installed.append((probe.obj, probe.name, owned, original))

    def _restore(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._gc_open = None
        while self._installed:
            obj, name, owned, original = self._installed.pop()
            if owned:
                setattr(obj, name, original)
            else:
                delattr(obj, name)

    def _wrap(self, probe: _Probe, original: Callable[..., Any]) -> Callable[..., Any]:
        totals = self.counts.setdefault(probe.phase, PhaseTotal())

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                launches, nbytes = probe.measure(*args, **kwargs) if probe.measure is not None else (1, 0)
                totals.events += launches
                totals.bytes += nbytes
            return original(*args, **kwargs)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            with self.timing(probe.phase):
                return original(*args, **kwargs)

        return timed if probe.timed else counted

    def count(self, phase: str, launches: int, nbytes: int) -> None:
        """Charge ``launches`` (e.g. all-gathers our code made) moving ``nbytes`` to ``phase``."""
        totals = self.counts.setdefault(phase, PhaseTotal())
        totals.events += launches
        totals.bytes += nbytes

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase`` (what a timed probe does around its call; the code that runs a phase records
        it itself this way). Two marks of the clock; no wait for the device."""
        opened = self._open(phase)
        try:
            yield
        finally:
            self._close(opened)

    def _open(self, phase: str) -> tuple[str, Any, int | None] | None:
        """The start of a timed span, or ``None`` inside another one (charged there)."""
        totals = self.counts.setdefault(phase, PhaseTotal())
        if self._depth:
            return None
        self._depth = 1  # before the mark: a collection the mark's allocation triggers is charged here
        totals.calls += 1
        return phase, self.clock.mark(), self.current_forward()

    def _close(self, opened: tuple[str, Any, int | None] | None) -> None:
        if opened is None:
            return
        phase, start, forward = opened
        self.records.append(ProbeRecord(phase, start, self.clock.mark(), forward))
        self._depth = 0

    # Called at every collection of every thread: the others return at once. Run eagerly (dynamo would otherwise
    # trace it when a collection starts inside a compiled region), and never inside a CUDA-graph capture, where a
    # mark would be recorded into the graph.
    @torch.compiler.disable
    def _on_gc(self, stage: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2 or threading.get_ident() != self._thread:
            return
        if stage == "start":
            self._gc_open = None if self.clock.uses_events and stream_capturing() else self._open(GC)
        else:
            opened, self._gc_open = self._gc_open, None
            self._close(opened)

    def totals(self) -> dict[str, PhaseTotal]:
        """Per phase: time of its timed calls, and what was launched (counting probes, ``count``)."""
        out = {phase: PhaseTotal(0.0, t.calls, t.events, t.bytes) for phase, t in self.counts.items()}
        for record in self.records:
            out[record.phase].ms += max(0.0, self.clock.elapsed_ms(record.start, record.end))
        return out
