"""The compiled one-token decode step: inductor on every device (CUDA graphs on CUDA), shapes bucketed so a
training run compiles a bounded number of graphs, every graph counted, and the time spent compiling kept out of
the decode figures.

On torch's public compiler API: the decode loop runs the step under ``torch.compiler.set_stance(
"fail_on_recompile")``, so torch refuses to compile inside a decode step (``NeedsCompile``). Each bucket shape
(``rollout/decode/loop.py``) is compiled explicitly by a warm-up call (``warm``) the first time the loop reaches
it, apart from the decode steps and timed as ``compile_ms``; anything else that would make torch compile again
(other forward hooks, a dtype, ``torch._dynamo.reset()``) is refused the same way and warmed the same way.
Graphs are counted with dynamo's own counter.

Shapes: the cache length rounds up to a power of two (``bucket``) and the batch moves through row compaction's
buckets (``scheduler.batch_buckets``). torch's automatic dynamic shapes compile the first batch size as it is
and, when a second one comes, one graph with a symbolic batch that serves every later size; on CUDA each size
still gets its own recorded CUDA graph (a recording in its warm-up call, not a compile). Inductor's CUDA graph
trees run a new graph once eagerly and record it on its second call, so a warm-up call on CUDA graphs calls the
step twice: the recording falls in the warm-up, not in the first decode step. Reaching torch's recompile limit
(after which torch would run new shapes eagerly) is a warning.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from typing import Any

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


CPU_MATVEC = {"post_grad_fusion_options": {"decompose_mm_pass": {"cpu_max_other_dimension_decomposition": 2**31}}}
"""Inductor's options on the CPU: every matrix product of one row (a decode step at batch 1) becomes inductor's own
multiply-and-sum, a C++ kernel that streams the weight and fuses with what surrounds it, instead of a BLAS call of
one row (oneMKL's is several times slower than the memory allows on the AMD EPYC this project measures on:
benchmarks/RESULTS.md, issue 38). Inductor does this only up to 2,048 columns by default; here for any size (a
real model's MLP and LM head are wider). Two rows or more keep the BLAS call (no gain measured at 4 rows)."""


def default_options(device: torch.device) -> dict[str, Any]:
    """``torch.compile`` options of the decode step on ``device``: inductor with CUDA graphs on CUDA
    (``reduce-overhead``), inductor's default mode elsewhere (CPU: C++/OpenMP kernels, no graphs to replay) with
    one-row matrix products as inductor's own kernels (``CPU_MATVEC``)."""
    return {"mode": "reduce-overhead"} if device.type == "cuda" else {"options": copy.deepcopy(CPU_MATVEC)}


def records_cuda_graphs(options: dict[str, Any]) -> bool:
    """Whether ``torch.compile(**options)`` replays CUDA graphs on CUDA: its mode says so, or its options."""
    inductor = options.get("options") or {}
    if "triton.cudagraphs" in inductor:
        return bool(inductor["triton.cudagraphs"])
    return options.get("backend", "inductor") == "inductor" and options.get("mode") in ("reduce-overhead",
                                                                                         "max-autotune")


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (all functions): dynamo's own counter."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class WarmShapes:
    """The bucket shapes a compiled step has been warmed for (kept by its strategy across calls). On CUDA graphs
    they hold only while dynamo compiles nothing more: dynamo keeps one cache per function, shared by every
    ``torch.compile`` of it in the process, and tries its newest graph first, so a graph compiled since (a symbolic
    batch after a static one, seen on an H200) may serve a warmed shape with a CUDA graph it has not recorded yet,
    which its first call would record inside a decode step. ``current`` forgets them then, so each is warmed again
    when next met."""

    def __init__(self) -> None:
        self.shapes: set[tuple] = set()
        self.graphs = compiled_graphs()
        """dynamo's graph count when ``shapes`` were last known to hold."""

    def __contains__(self, shape: tuple) -> bool:
        return shape in self.shapes

    def add(self, shape: tuple) -> None:
        self.shapes.add(shape)

    def current(self, step: Any) -> None:
        """Forget every shape if ``step`` records CUDA graphs and dynamo compiled a graph since they were warmed.
        Called before every compiled decode step: without CUDA graphs it returns before reading dynamo's counter."""
        if not getattr(step, "records_graphs", False):
            return
        now = compiled_graphs()
        if now != self.graphs:
            self.shapes.clear()
            self.graphs = now


class NeedsCompile(RuntimeError):
    """torch would compile inside a decode step (a new shape, or a guard that failed): warm the step first."""


def _refused(error: RuntimeError) -> bool:
    return "fail_on_recompile" in str(error)


def _strict() -> Any:
    """``set_stance("fail_on_recompile")``, unless the caller chose a stance of their own (``force_eager``, ...)."""
    from torch._dynamo import eval_frame

    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    return torch.compiler.set_stance("fail_on_recompile") if stance == "default" else contextlib.nullcontext()


class CompiledStep:
    """``torch.compile(fn)`` with ``options`` (or ``default_options`` of the device it first runs on): ``warm``
    compiles a shape explicitly; a call runs a warmed shape and never compiles."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None):
        self.fn = fn
        self.options = options
        self._compiled: Callable[..., Any] | None = None
        self.graphs = 0
        """Graphs this step's warm-up calls compiled (a shape served by a dynamic graph adds none)."""
        self.exhausted = False
        """torch's recompile limit was reached: shapes it cannot compile any more run eagerly."""
        self.records_graphs = False
        """Whether the step replays CUDA graphs (inductor's graph trees), known once prepared."""

    def prepare(self, device: torch.device) -> None:
        """Compile lazily for ``device`` (the options depend on it) unless options were given."""
        if self._compiled is None:
            options = self.options if self.options is not None else default_options(device)
            self.records_graphs = device.type == "cuda" and records_cuda_graphs(options)
            self._compiled = torch.compile(self.fn, **options)

    def warm(self, *args: Any, **kwargs: Any) -> int:
        """Run the step once, compiling if torch must (twice on CUDA graphs: the second call records the graph);
        returns the graphs compiled.
        The decode loop calls it before the step it is about to take, with that step's inputs but the write columns
        at the cache's last one (which only finished rows write): nothing the step reads changes."""
        self._require_prepared()
        before = compiled_graphs()
        # dynamo does not guard on module hooks by default: a step compiled unprofiled would then never run the
        # forward timer's hooks added later (its decode forwards invisible); with hook guards, other hooks are
        # another graph (refused in the loop, then warmed)
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False, fail_on_recompile_limit_hit=True):
            try:
                self._compiled(*args, **kwargs)
                if self.records_graphs:  # the first call ran the new graph eagerly; the second records it
                    self._compiled(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                self._warn_exhausted()
                self.fn(*args, **kwargs)
        added = max(0, compiled_graphs() - before)  # dynamo's counters may have been reset meanwhile
        self.graphs += added
        return added

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A decode step on a warmed shape. Raises ``NeedsCompile`` where torch would compile."""
        self._require_prepared()
        try:
            with _strict():
                return self._compiled(*args, **kwargs)
        except RuntimeError as error:
            if not _refused(error):
                raise
            if self.exhausted:  # torch compiles no more: this shape runs eagerly, as torch would run it
                return self.fn(*args, **kwargs)
            raise NeedsCompile(str(error)) from None

    def _warn_exhausted(self) -> None:
        if not self.exhausted:
            self.exhausted = True
            logger.warning("the compiled decode step has reached torch's recompile limit of %d graphs: new shapes run "
                           "eagerly for the rest of the process. Keep prompt + max_new_tokens within fewer length "
                           "buckets (powers of two), or raise torch._dynamo.config.recompile_limit.",
                           recompile_limit())

    def _require_prepared(self) -> None:
        if self._compiled is None:
            raise RuntimeError("CompiledStep.prepare(device) must run before the compiled step is called")
