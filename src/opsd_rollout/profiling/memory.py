"""Peak memory of one rollout: accelerator peak allocated on CUDA, process peak RSS on CPU."""

from __future__ import annotations

import resource
import sys

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _read_hwm_bytes() -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    """Reset Linux's peak-RSS counter so the next read is the peak since now."""
    try:
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _lifetime_max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakMemory:
    """``start()`` then ``stop()`` returns ``(peak_bytes, source)`` for the span in between.

    Sources: ``cuda_max_allocated`` (torch's allocator peak), ``process_rss_peak`` (Linux VmHWM after a
    reset, so the span's own peak) or ``process_rss_lifetime_peak`` (where the reset is not allowed; then
    the figure may come from before the span).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._rss_reset = False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._rss_reset = _reset_hwm()

    def stop(self) -> tuple[int, str]:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device)), "cuda_max_allocated"
        if self._rss_reset:
            hwm = _read_hwm_bytes()
            if hwm is not None:
                return hwm, "process_rss_peak"
        return _lifetime_max_rss_bytes(), "process_rss_lifetime_peak"
