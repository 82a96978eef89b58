"""The compiled one-token decode step: inductor on every device (CUDA graphs on CUDA), shapes bucketed so a
training run compiles a bounded number of graphs, every graph counted, and the time spent compiling kept out of
the decode figures.

Shapes: the cache length rounds up to a power of two (``bucket``) and the batch moves through row compaction's
buckets (``scheduler.batch_buckets``). torch's automatic dynamic shapes compile the first batch size as it is
and, when a second one comes, one graph with a symbolic batch that serves every later size; on CUDA each size
still gets its own recorded CUDA graph (cheap: a recording, not a compile). Running past torch's recompile
limit (after which torch silently runs the step eagerly for the rest of the process) is a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)

LENGTH_BUCKET_MIN = 64
"""The smallest compiled cache length; lengths round up to powers of two from here."""


def bucket(value: int, minimum: int = 1) -> int:
    """The power of two at or above ``value`` (and ``minimum``)."""
    return max(minimum, 1 << max(0, value - 1).bit_length())


def recompile_limit() -> int:
    """How many graphs torch compiles for one function before it stops compiling and runs it eagerly."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def default_options(device: torch.device) -> dict[str, Any]:
    """``torch.compile`` options of the decode step on ``device``: inductor with CUDA graphs on CUDA
    (``reduce-overhead``), inductor's default mode elsewhere (CPU: C++/OpenMP kernels, no graphs to replay)."""
    return {"mode": "reduce-overhead"} if device.type == "cuda" else {}


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (all functions)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _forgotten_by_dynamo(fn: Callable) -> bool:
    """Whether dynamo holds nothing compiled for ``fn`` (``torch._dynamo.reset()`` clears it all, as in a fresh
    process); False where this torch does not say."""
    try:
        from torch._dynamo.convert_frame import input_codes
        return fn.__code__ not in input_codes
    except (ImportError, AttributeError, TypeError):
        return False


class CompiledStep:
    """``torch.compile(fn)``, compiled with ``options`` (or ``default_options`` of the device it first runs on),
    plus a count of the shapes it has been called with and of the graphs compiling them took.

    torch keeps compiled graphs per code object, so every instance compiling the same function shares one
    budget of ``recompile_limit()`` graphs; the counts are shared the same way (per process)."""

    _shapes: ClassVar[dict[Callable, set[Hashable]]] = {}
    _graphs: ClassVar[dict[Callable, int]] = {}
    _ran: ClassVar[dict[Callable, bool]] = {}
    """Whether the function has run compiled since dynamo last forgot it (shapes noted before are then stale)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None):
        self.fn = fn
        self.options = options
        self._compiled: Callable[..., Any] | None = None
        self._warned = self._warned_loop = False

    def prepare(self, device: torch.device) -> None:
        """Compile lazily for ``device`` (the options depend on it) unless options were given."""
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, **(self.options if self.options is not None
                                                       else default_options(device)))

    @property
    def graphs(self) -> int:
        """Graphs compiled for this function in this process (a shape that reuses a dynamic graph adds none)."""
        return self._graphs.get(self.fn, 0)

    @property
    def shapes(self) -> int:
        """Distinct shapes this function has been called with in this process."""
        return len(self._shapes.get(self.fn, ()))

    def note_shape(self, key: Hashable) -> bool:
        """Record that the next calls use shape ``key``; True when it is new (a compile may follow)."""
        if self._ran.get(self.fn) and _forgotten_by_dynamo(self.fn):  # torch._dynamo.reset() since: all new
            self._shapes[self.fn], self._graphs[self.fn], self._ran[self.fn] = set(), 0, False
        seen = self._shapes.setdefault(self.fn, set())
        if key in seen:
            return False
        seen.add(key)
        return True

    def first_call(self, *args: Any, **kwargs: Any) -> int:
        """Run the step once for a new shape (compiling it if torch must) and return the graphs compiled. The
        decode loop calls it before the step it is about to take, with the same inputs: a decode step only
        writes the keys/values of the columns it is given, so the real call that follows does the same again."""
        # dynamo does not guard on module hooks by default: a step compiled unprofiled would then never run the
        # forward timer's hooks added later (its decode forwards invisible). Compiled with hook guards, a call with
        # other hooks misses this graph (the shape key includes the hooks, so that call is a first call too)
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            _, added = self._counted(*args, **kwargs)
        # whether dynamo now holds the step (not when it never compiles: TORCHDYNAMO_DISABLE, a forced eager stance)
        self._ran[self.fn] = not _forgotten_by_dynamo(self.fn)
        self._graphs[self.fn] = self.graphs + added
        if self.graphs >= recompile_limit() and not self._warned:
            self._warned = True
            logger.warning("the compiled decode step has now compiled %d graphs, torch's recompile limit of %d: torch "
                           "runs any new shape eagerly for the rest of the process. Keep prompt + max_new_tokens "
                           "within fewer length buckets (powers of two), or raise "
                           "torch._dynamo.config.recompile_limit.", self.graphs, recompile_limit())
        return added

    def loop_call(self, *args: Any, **kwargs: Any) -> tuple[Any, int]:
        """A decode step on a shape seen before: its result, and the graphs it compiled (0 unless a guard failed,
        counted by ``note_loop_graphs``)."""
        result, added = self._counted(*args, **kwargs)
        return result, self.note_loop_graphs(added)

    def _counted(self, *args: Any, **kwargs: Any) -> tuple[Any, int]:
        """The step's result and the graphs dynamo compiled during it."""
        before = compiled_graphs()
        result = self(*args, **kwargs)
        return result, compiled_graphs() - before

    def note_loop_graphs(self, added: int) -> int:
        """Count ``added`` graphs compiled inside a decode loop, outside the first calls: a guard failed where the
        shape key saw nothing new, so the compile ran in a decode step (its time in ``decode_ms``). Warned once,
        since it means recompiling where nothing should; returns what it counted."""
        added = max(0, added)  # dynamo's counters may have been reset meanwhile
        if added > 0:
            self._graphs[self.fn] = self.graphs + added
            if not self._warned_loop:
                self._warned_loop = True
                logger.warning("the compiled decode step compiled %d graph(s) inside the decode loop, on a shape it "
                               "had seen: a guard failed (TORCH_LOGS=recompiles says which); those decode steps "
                               "include the compile", added)
        return added

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            raise RuntimeError("CompiledStep.prepare(device) must run before the compiled step is called")
        return self._compiled(*args, **kwargs)
