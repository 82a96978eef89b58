"""One timer abstraction: device events where the device has them, a synchronized clock otherwise.

The choice is made once, when the clock is built for a device; every stage and every forward timer
uses the same clock, so a profile never mixes the two. Event marks are resolved only when read, so
recording a mark never synchronizes on CUDA.
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

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.uses_events:
            end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) * 1000.0
