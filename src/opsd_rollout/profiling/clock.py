"""One timer abstraction: device events where the device has them, the host's clock otherwise.

The choice is made once, when the clock is built for a device; every stage and every forward timer
uses the same clock, so a profile never mixes the two. Recording a mark never waits for the device on CUDA
(an event on the stream) or on the CPU (where work is synchronous); reading marks waits once, in ``settle``.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work; a no-op on CPU, where work is synchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


class Clock:
    """Marks points in device time; ``elapsed_ms(start, end)`` reads the span between two marks."""

    def __init__(self, device: torch.device | str, *, use_device_events: bool = True):
        self.device = torch.device(device)
        self.uses_events = use_device_events and self.device.type == "cuda" and torch.cuda.is_available()

    @property
    def kind(self) -> str:
        return "cuda_events" if self.uses_events else "synchronized_clock"

    def mark(self) -> Any:
        """Never blocks on CPU (synchronous) or CUDA (events); synchronizes other accelerators. On CUDA the
        event goes on the clock's device's current stream, whichever device is current in the caller."""
        if self.uses_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        synchronize(self.device)
        return time.perf_counter()

    def settle(self) -> None:
        """Wait until every mark recorded so far on the current stream can be read (and every copy to the host queued
        before now has landed): one wait on a fresh event on CUDA; nothing elsewhere. The one device wait a set of
        marks costs, made once before they are read."""
        if self.uses_events:
            self.mark().synchronize()

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the host, for a figure read once the marks are: on CUDA a copy queued on the stream (pinned,
        no wait now) that ``settle()`` makes readable; elsewhere copied now (the CPU's own tensor is itself)."""
        if self.uses_events and tensor.is_cuda:
            return tensor.to("cpu", non_blocking=True)
        return tensor.to("cpu")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """The span between two marks; on CUDA it waits only for an ``end`` not reached yet (none after ``settle``,
        unless it was recorded on another stream)."""
        if self.uses_events:
            if not end.query():
                end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) * 1000.0
