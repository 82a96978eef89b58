"""``profile_model_time(module)`` / ``model_times()``: DeepSpeed inference engine's forward timer, for any module.

Works on a transformers model, a PEFT model, a DeepSpeed training or inference engine: the wrapper and the
modules it wraps are all hooked, so the forward that actually runs is timed (once) whether the caller
enters the wrapper or, as ``generate`` does, the model inside. On CUDA the times come from events
recorded in the hooks (no synchronization per forward; resolved when read); elsewhere from a
synchronized clock.

As DeepSpeed's ``InferenceEngine.model_times()``, a read returns the durations and clears them, so a read
with no forward since the last one returns ``[]``. DeepSpeed raises when CUDA graphs are on and the list is
empty, because graph replay runs no hooks; this timer raises (``HiddenForwardsError``) on the same evidence,
observed rather than configured: one of the timed forwards ran while its stream was being captured into a
CUDA graph, so the graph's replays cannot be seen and an empty list cannot mean "no forward ran".
"""

from __future__ import annotations

import weakref

import torch

from opsd_rollout.modeling import device_of, wrapped_modules
from opsd_rollout.profiling.clock import Clock
from opsd_rollout.profiling.forward import ForwardTimer


class HiddenForwardsError(RuntimeError, ValueError):
    """``model_times()`` found no forward, but the timed module was captured into a CUDA graph, whose replays
    run no hooks. A ``RuntimeError`` as before, and a ``ValueError`` as DeepSpeed's ``model_times`` raises."""


_ACTIVE: "weakref.WeakKeyDictionary[torch.nn.Module, ModelTimeProfiler]" = weakref.WeakKeyDictionary()


class ModelTimeProfiler:
    """The handle ``profile_model_time`` returns; also a context manager that removes itself on exit."""

    def __init__(self, module: torch.nn.Module, use_cuda_events: bool = True):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"profile_model_time needs a torch.nn.Module; got {type(module).__name__}")
        chain = wrapped_modules(module)
        for member in chain:
            if member in _ACTIVE:
                raise RuntimeError(f"forward timing is already enabled on {type(member).__name__}; call remove() "
                                   "on the existing handle first")
        self.module = module
        self.clock = Clock(device_of(module), use_device_events=use_cuda_events)
        self._timer = ForwardTimer(module, self.clock, also=tuple(chain[1:])).attach()
        self._chain = chain
        for member in chain:
            _ACTIVE[member] = self

    @property
    def active(self) -> bool:
        return bool(self._chain)

    def model_times(self, split: bool = False) -> list[float] | dict[str, list[float]]:
        """Forward durations in ms since the last read, then cleared. ``split=True`` returns
        ``{"prefill": [...], "decode": [...]}`` (chunked prefill counts as prefill).

        No forward since the last read gives ``[]`` (``{"prefill": [], "decode": []}``), unless a timed
        forward was captured into a CUDA graph: then ``HiddenForwardsError``, since replays are invisible."""
        if not self.active:
            raise RuntimeError("this forward timer was removed; enable a new one with profile_model_time()")
        self.clock.settle()  # the read's one wait on the device
        times = self._timer.read(clear=True)
        if not times and self._timer.captured:
            raise HiddenForwardsError(
                f"no forward pass of {type(self.module).__name__} (or the modules it wraps) was seen since the last "
                f"read, but {self._timer.captured} of its forwards ran inside a CUDA-graph capture, and replaying "
                "that graph runs no forward hooks: time the module whose call replays the graph (e.g. the "
                "DeepSpeed inference engine) instead.")
        if split:
            return {"prefill": [t.ms for t in times if t.kind == "prefill"],
                    "decode": [t.ms for t in times if t.kind == "decode"]}
        return [t.ms for t in times]

    def remove(self) -> None:
        """Remove every hook; the module is left exactly as it was."""
        self._timer.remove()
        for member in self._chain:
            if _ACTIVE.get(member) is self:
                del _ACTIVE[member]
        self._chain = []

    def __enter__(self) -> "ModelTimeProfiler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def profile_model_time(module: torch.nn.Module, use_cuda_events: bool = True) -> ModelTimeProfiler:
    """Start timing every forward pass of ``module``; read with ``handle.model_times()``."""
    return ModelTimeProfiler(module, use_cuda_events)
