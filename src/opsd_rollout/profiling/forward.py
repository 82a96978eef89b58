"""Times every forward pass of one module and tells prefill forwards from decode forwards.

The hooks go on the module whose ``forward`` really runs at each generation step (for a PEFT or
DeepSpeed wrapper, the transformers model inside), so wrappers cannot hide the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opsd_rollout.profiling.clock import Clock


@dataclass(frozen=True)
class ForwardTime:
    """One forward pass: its duration, its input shape, its kind and (when asked) its start offset."""

    ms: float
    rows: int
    query_tokens: int
    """Tokens per row fed to this forward (1 for a decode step)."""
    kind: str
    """``prefill`` or ``decode`` (a forward kind)."""
    offset_ms: float | None = None
    """Start, relative to the ``origin`` mark given to ``ForwardTimer.read``."""
    attributed_ms: float = 0.0
    """Time of attributed phases (e.g. ZeRO-3 gathers) that ran inside this forward."""

    @property
    def exclusive_ms(self) -> float:
        """The forward's own time: ``ms`` less the attributed phases inside it."""
        return max(0.0, self.ms - self.attributed_ms)


def stream_capturing() -> bool:
    """True while the current CUDA stream is being captured into a CUDA graph (never on a CPU-only torch,
    whose capture query would raise)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _input_shape(args: tuple, kwargs: dict) -> tuple[int, int]:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return 0, 0


class ForwardTimer:
    """Records ``(start, end, query tokens)`` for each outermost forward of ``module``.

    A forward that feeds several tokens per row is prefill (chunked prefill, and the prefills of prompts
    admitted while others decode, included); one that feeds a single token is decode, unless it is the
    first forward (a one-token prompt's prefill).

    A forward that runs while its stream is being captured into a CUDA graph is not timed (capture records
    work, it does not run it, and a clock mark inside a capture would become part of the graph); when it is
    outermost it is counted in ``captured`` instead, because every later replay of that graph runs the forward
    without any of the hooks.
    """

    def __init__(self, module: torch.nn.Module, clock: Clock, *, also: tuple[torch.nn.Module, ...] = ()):
        """``also``: modules that ``module`` wraps; a forward nested in another hooked forward counts once,
        so hooking a wrapper and what it wraps times whichever forward the caller actually enters."""
        self.module = module
        self.modules = tuple(dict.fromkeys((module, *also)))
        self.clock = clock
        self._records: list[tuple[Any, Any, tuple[int, int]]] = []
        self._open: list[tuple[Any, tuple[int, int]]] = []
        self._handles: list[Any] = []
        self.captured = 0
        """Outermost forwards seen while being captured into a CUDA graph: their replays are invisible."""

    def attach(self) -> "ForwardTimer":
        if self._handles:
            raise RuntimeError("ForwardTimer is already attached")
        for module in self.modules:
            self._handles += [module.register_forward_pre_hook(self._on_start, with_kwargs=True),
                              module.register_forward_hook(self._on_end, always_call=True)]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open = []

    def __enter__(self) -> "ForwardTimer":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # The hooks run eagerly even inside a compiled step (``compile_decode``): dynamo leaves them out of the
    # graph instead of tracing host clocks, and never recompiles for the values they hold.
    @torch.compiler.disable
    def _on_start(self, _module, args, kwargs) -> None:
        if stream_capturing():
            # Counted only when outermost: a capture inside a timed wrapper (DeepSpeed's inference engine
            # capturing its model) is replayed inside the wrapper's own forward, which the hooks do see.
            self.captured += not self._open
            self._open.append((None, (0, 0)))  # keeps the nesting balanced; never recorded
            return
        self._open.append((self.clock.mark(), _input_shape(args, kwargs)))

    @torch.compiler.disable
    def _on_end(self, _module, _args, _output) -> None:
        if not self._open:
            return
        start, shape = self._open.pop()
        if start is not None and not self._open:  # only outermost forwards that ran count
            self._records.append((start, self.clock.mark(), shape))

    def open_index(self) -> int | None:
        """Index (in ``read()``'s list) of the forward running now, or ``None`` between forwards."""
        return len(self._records) if self._open else None

    def read(self, clear: bool = True, origin: Any = None) -> list[ForwardTime]:
        """Resolve the recorded marks and classify each forward; with an ``origin`` mark, each forward's start
        offset from it too. Waits for the device only for marks not reached yet: ``clock.settle()`` first makes it
        one wait."""
        times = []
        for index, (start, end, (rows, tokens)) in enumerate(self._records):
            decoding = index > 0 and tokens == 1
            offset = None if origin is None else self.clock.elapsed_ms(origin, start)
            times.append(ForwardTime(self.clock.elapsed_ms(start, end), rows, tokens,
                                     "decode" if decoding else "prefill", offset))
        if clear:
            self._records = []
        return times
