"""Every check that needs a CUDA GPU, in one call on a lent GPU machine, and its rehearsal on the CPU.

    python scripts/gpu_check.py [--model llama-small] [--dtype bf16]
    python scripts/gpu_check.py --cpu --model llama-tiny     # the rehearsal: every check, fp32, CPU stand-ins

Each row (status, time, figure, detail) is printed the moment its check ends, so a run cut off by a timeout
still says what ran; one failing check never hides the others, and the exit status is non-zero when any failed.
Each check asserts what it proves (a graph replayed, no host sync, equal tokens); timings are reported beside,
never asserted. The figure column is what a reader compares between the GPU run and the CPU rehearsal.

The rehearsal runs every check's own code on the CPU, so a check that reaches for a name the project or torch
no longer has fails here, in CI, and not on the GPU. Only the calls that exist on CUDA alone are replaced by the
stand-ins of ``CpuStandIns`` (CUDA-graph recording, ``torch.cuda.set_sync_debug_mode`` and the GPU trace's
synchronization callbacks, pinned memory, device events, DeepSpeed's inference kernels, inductor's kernels); a check that used one reports ``rehearsed``, not
``ok``. On the GPU machine, with the wheels of ``make gpu-bundle`` (see docs/GPU.md). Equality checks run in fp32
(near-ties in bf16 flip argmaxes for numeric reasons); speed in ``--dtype``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import opsd_rollout
from opsd_rollout import RolloutRequest, SamplingConfig
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.bench.workload import workload_rollout
from opsd_rollout.bench.timing import interleaved_medians
from opsd_rollout.models import load_model, parse_dtype
from opsd_rollout.rollout import compiled as compiled_module
from opsd_rollout.rollout import sampling as sampling_module
from opsd_rollout.rollout.compiled import compiled_graphs


@contextlib.contextmanager
def counting(owner: Any, name: str) -> Iterator[list[int]]:
    """Count calls of ``owner.name`` (a class or module attribute) for the block; the name must exist."""
    original, calls = getattr(owner, name), []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


# ---- the calls that exist on CUDA alone, and their CPU stand-ins -----------------------------------------------

class Cuda:
    """The CUDA-only calls the checks make, as they are on a GPU."""

    rehearsal = False
    timer, memory_source = "cuda_events", "cuda_max_allocated"
    """What a profile on this device says it timed with and where its peak memory came from."""

    def __init__(self) -> None:
        self.used = False
        """Whether the check running now used a stand-in (its status is then ``rehearsed``)."""

    def size(self, gpu: Any, cpu: Any) -> Any:
        """A shape or a round count: the GPU's, or the rehearsal's smallest."""
        return gpu

    @contextlib.contextmanager
    def strict_sync(self) -> Iterator[None]:
        """Any host synchronization inside the block raises."""
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def graph_recordings(self) -> contextlib.AbstractContextManager[list[int]]:
        """Counts the graphs recorded in the block: CUDA-graph recordings of inductor's graph trees."""
        from torch._inductor import cudagraph_trees

        return counting(cudagraph_trees.CUDAGraphNode, "_record")

    def pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    @contextlib.contextmanager
    def syncs(self) -> Iterator[collections.Counter]:
        """Every host synchronization in the block, counted by the line of ours that made it (``sync_site``): the
        waits torch's GPU trace reports, stream, event and device synchronizations. ``set_sync_debug_mode`` warns of
        the implicit ones only (a value read, a data-dependent shape); an explicit ``torch.cuda.synchronize()`` or
        event wait would pass it unseen. The trace, once on, stays on for the process: run this check last."""
        from torch.cuda import _gpu_trace

        if not SYNC_SINKS.traced:
            torch._C._activate_gpu_trace()
            for register in (_gpu_trace.register_callback_for_stream_synchronization,
                             _gpu_trace.register_callback_for_event_synchronization,
                             _gpu_trace.register_callback_for_device_synchronization):
                register(lambda *_: SYNC_SINKS.seen())
            SYNC_SINKS.traced = True
        with SYNC_SINKS.counting() as counts:
            yield counts

    def device_events(self) -> contextlib.AbstractContextManager[None]:
        """Clocks built in the block time with device events (``torch.cuda.Event`` on the current stream)."""
        return contextlib.nullcontext()

    def inference_kernels(self) -> contextlib.AbstractContextManager[None]:
        """DeepSpeed's inference kernels (built with the hybrid engine)."""
        return contextlib.nullcontext()

    def flex_kernel(self) -> contextlib.AbstractContextManager[None]:
        """Flex attention's kernel, which transformers compiles with inductor."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the whole run."""
        yield


class SyncSinks:
    """Where the host synchronizations seen go while ``Cuda.syncs`` counts: each to the innermost count, by site."""

    def __init__(self) -> None:
        self.stack: list[collections.Counter] = []
        self.traced = False

    @contextlib.contextmanager
    def counting(self) -> Iterator[collections.Counter]:
        counts: collections.Counter = collections.Counter()
        self.stack.append(counts)
        try:
            yield counts
        finally:
            self.stack.remove(counts)

    def seen(self) -> None:
        if self.stack:
            self.stack[-1][sync_site()] += 1


SYNC_SINKS = SyncSinks()
PACKAGE = Path(opsd_rollout.__file__).parent


def sync_site() -> str:
    """``module path:function`` of the innermost frame of the package on the stack (``profiling/clock.py:settle``),
    or ``elsewhere``."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            return f"{path.relative_to(PACKAGE).as_posix()}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"


class HostSyncDetector(TorchFunctionMode):
    """The CPU stand-in for ``set_sync_debug_mode("error")``: raises on every call that makes a CUDA host wait
    for the device (reading a value, a data-dependent shape), except inside ``CPU_ONLY``: functions that return
    before any host read on every other device, so that a GPU never runs their reads. With ``count``, tells
    ``SYNC_SINKS`` instead of raising (the stand-in for the GPU trace of ``Cuda.syncs``)."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.count = count

    CPU_ONLY = {sampling_module._top_k_candidates.__code__, sampling_module._tied_candidates.__code__}

    SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.numpy,
             torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique}

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        data_dependent = (func is torch.where and len(args) + len(kwargs) == 1) or (
            func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _bool_index(args[1])
            and not (func is torch.Tensor.__setitem__ and _mask_fill(*args)))
        copied = func is torch.Tensor.__setitem__ and _host_number_copied(*args)
        if (func in self.SYNCS or data_dependent or copied) and not _called_from(self.CPU_ONLY):
            if self.count:
                SYNC_SINKS.seen()
                return func(*args, **kwargs)
            raise RuntimeError(f"host synchronization: {getattr(func, '__name__', func)} (CPU stand-in for "
                               "torch.cuda.set_sync_debug_mode('error'))")
        return func(*args, **kwargs)


def _called_from(codes: set) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _mask_fill(target: torch.Tensor, index: Any, value: Any) -> bool:
    """``target[mask] = number``, the mask the one tensor of the index: torch fills through it (``masked_fill_``),
    with no count of its rows to read (seen on an H200 with torch 2.11)."""
    items = index if isinstance(index, tuple) else (index,)
    tensors = [i for i in items if isinstance(i, torch.Tensor)]
    return (isinstance(value, (bool, int, float)) and len(tensors) == 1 and tensors[0].dtype == torch.bool)


def _host_number_copied(target: torch.Tensor, index: Any, value: Any) -> bool:
    """``target[index] = value`` with a Python number: on CUDA torch makes the number a host tensor and copies it
    to the device from pageable memory (a wait) unless it can fill a view with it: where the index holds an integer
    tensor (``index_put_``) or names one element (``copy_``). A lone mask (``_mask_fill``), ``index_fill_``,
    ``masked_fill_``, ``torch.where`` and a slice (``fill_``) take the number as it is."""
    if isinstance(value, torch.Tensor) or not isinstance(value, (bool, int, float)):
        return False
    items = index if isinstance(index, tuple) else (index,)
    element = len(items) == target.dim() and all(isinstance(i, int) for i in items)
    return element or (any(isinstance(i, torch.Tensor) for i in items) and not _mask_fill(target, index, value))


@contextlib.contextmanager
def recordings_by_shape(recordings: Any) -> Iterator[list[tuple[str, tuple, int]]]:
    """``(call, shape, graphs)`` for every call of a compiled decode step in the block: ``warm`` or ``step``, the
    shapes of its tensors (and of its cache), and how many of ``recordings`` (``graph_recordings``) it added."""
    calls: list[tuple[str, tuple, int]] = []
    originals = {name: getattr(compiled_module.CompiledStep, name) for name in ("warm", "__call__")}

    def attributed(name: str) -> Callable[..., Any]:
        def call(step: Any, *args: Any, **kwargs: Any) -> Any:
            before = len(recordings)
            try:
                return originals[name](step, *args, **kwargs)
            finally:
                shape = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else tuple(a.layers[0].keys.shape)
                              for a in args if isinstance(a, torch.Tensor) or hasattr(a, "layers"))
                calls.append(("warm" if name == "warm" else "step", shape, len(recordings) - before))
        return call

    for name in originals:
        setattr(compiled_module.CompiledStep, name, attributed(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(compiled_module.CompiledStep, name, original)


class GraphsSince:
    """``len()``: the graphs dynamo has compiled in this process since this object was made."""

    def __init__(self) -> None:
        self.start = compiled_graphs()

    def __len__(self) -> int:
        return compiled_graphs() - self.start


class CpuStandIns(Cuda):
    """The same calls rehearsed on the CPU, each CUDA-only call replaced by the closest thing a CPU has."""

    rehearsal = True
    timer, memory_source = "synchronized_clock", "process_rss"

    def size(self, gpu: Any, cpu: Any) -> Any:
        return cpu

    @contextlib.contextmanager
    def strict_sync(self) -> Iterator[None]:
        """The compiled step's graph is opaque here (dynamo cannot trace under a Python function mode); the eager
        pass checks the same step's code, and on a GPU a sync inside a graph fails its capture anyway."""
        assert callable(torch.cuda.set_sync_debug_mode)  # what the GPU run calls
        self.used = True
        detector, graph = HostSyncDetector(), compiled_module.CompiledStep.__call__

        def opaque(step: compiled_module.CompiledStep, *args: Any, **kwargs: Any) -> Any:
            detector.__exit__(None, None, None)
            try:
                return graph(step, *args, **kwargs)
            finally:
                detector.__enter__()

        compiled_module.CompiledStep.__call__ = opaque
        try:
            with detector:
                yield
        finally:
            compiled_module.CompiledStep.__call__ = graph

    def graph_recordings(self) -> contextlib.AbstractContextManager[GraphsSince]:
        """Graphs dynamo compiles stand in for CUDA-graph recordings: a step that records again on a GPU (a
        failing guard, a new shape) compiles again here."""
        from torch._inductor import cudagraph_trees

        assert callable(cudagraph_trees.CUDAGraphNode._record)  # what the GPU run counts
        self.used = True
        return contextlib.nullcontext(GraphsSince())

    def pinned(self, tensor: torch.Tensor) -> bool:
        """CPU memory cannot be pinned without CUDA: a cache is right to be unpinned here."""
        self.used = True
        return not tensor.is_pinned()

    @contextlib.contextmanager
    def syncs(self) -> Iterator[collections.Counter]:
        """The reads a CUDA host would wait for (``HostSyncDetector``, counting) and the waits on the stand-in events
        of ``device_events``, by site. A profile is built from the copies its rollout made to the host
        (``Clock.host_copy``), which on a GPU are host tensors already: its reads are no wait there."""
        from torch.cuda import _gpu_trace

        from opsd_rollout.profiling import profile

        assert callable(torch._C._activate_gpu_trace)  # what the GPU run calls
        assert callable(_gpu_trace.register_callback_for_event_synchronization)
        self.used = True
        detector = HostSyncDetector(count=True)
        detector.CPU_ONLY = HostSyncDetector.CPU_ONLY | {profile.build_profile.__code__}
        with SYNC_SINKS.counting() as counts, detector:
            yield counts

    @contextlib.contextmanager
    def device_events(self) -> Iterator[None]:
        """Host-clock events in place of ``torch.cuda.Event`` and its stream, and clocks that use them: the event
        path of ``profiling.clock.Clock`` runs as on a GPU."""
        from opsd_rollout.profiling import clock

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at: float | None = None

            def record(self, stream: Any = None) -> None:
                self.at = time.perf_counter()

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                assert self.at is not None, "an event read before it was recorded"
                SYNC_SINKS.seen()

            def elapsed_time(self, end: "Event") -> float:
                return (end.at - self.at) * 1e3

        self.used = True
        patched = {(torch.cuda, "Event"): Event, (torch.cuda, "current_stream"): lambda device=None: None}
        init = clock.Clock.__init__

        def with_events(instance: clock.Clock, *args: Any, **kwargs: Any) -> None:
            init(instance, *args, **kwargs)
            instance.uses_events = kwargs.get("use_device_events", True)  # keyword-only

        patched[(clock.Clock, "__init__")] = with_events
        originals = {key: getattr(*key) for key in patched}
        for (owner, name), value in patched.items():
            setattr(owner, name, value)
        try:
            yield
        finally:
            for (owner, name), value in originals.items():
                setattr(owner, name, value)

    @contextlib.contextmanager
    def inference_kernels(self) -> Iterator[None]:
        """Kernels that raise when called, so the hybrid engine builds as on a GPU and fails only if run."""
        from deepspeed.ops.op_builder.cpu.no_impl import NotImplementedBuilder

        class Kernels:
            def __getattr__(self, name: str) -> Callable:
                def missing(*args: Any, **kwargs: Any) -> Any:
                    raise RuntimeError(f"CPU stand-in: DeepSpeed's inference kernel {name} exists on CUDA only")
                return missing

        self.used = True
        original = NotImplementedBuilder.load
        NotImplementedBuilder.load = lambda builder, *args, **kwargs: Kernels()
        try:
            yield
        finally:
            NotImplementedBuilder.load = original

    @contextlib.contextmanager
    def flex_kernel(self) -> Iterator[None]:
        """Flex attention run eagerly: inductor's CPU flex kernel does not build in torch 2.13 (C++ errors)."""
        self.used = True
        with torch.compiler.set_stance("force_eager"):
            yield

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The compiled step compiles with dynamo's ``aot_eager`` backend, which stands in for inductor with CUDA
        graphs: the same tracing, guards and graph counts, without the minutes of C++ kernels per graph."""
        original = compiled_module.default_options

        def stand_in(device: torch.device) -> dict[str, Any]:
            self.used = True
            return {"backend": "aot_eager"}

        compiled_module.default_options = stand_in
        try:
            yield
        finally:
            compiled_module.default_options = original


# ---- what every check gets --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    figure: str
    """The one figure a reader compares between the GPU run and the rehearsal."""
    detail: str = ""


class Context:
    """What every check gets: the model in the speed dtype, an fp32 copy for equality, the tokenizer, the device
    and its CUDA-only calls (``gpu``: the real ones, or the CPU's stand-ins)."""

    def __init__(self, name: str, dtype: str, device: torch.device, gpu: Cuda):
        self.device, self.name, self.dtype_name, self.gpu = device, name, dtype, gpu
        self.model, self.tokenizer = load_model(name, dtype=dtype, device=device)
        self.fp32 = self.model if dtype == "fp32" else load_model(name, dtype="fp32", device=device)[0]
        self.dtype = parse_dtype(dtype)

    def request(self, batch: int = 2, length: int = 24, seed: int = 0, padded: bool = True) -> RolloutRequest:
        return synthetic_prompts(batch, length, vocab_size=self.model.config.vocab_size, seed=seed,
                                 pad_fraction=0.25 if padded else 0.0, device=self.device)

    def rollout(self, model: torch.nn.Module | None = None, *, lengths: str | None = None, whole_cache: bool = False,
                **config: Any) -> Any:
        """A rollout from flat config and option names; ``lengths``: a benchmark workload's response lengths,
        through the bench's hook; ``whole_cache``: the compiled step's cache layout, eagerly."""
        workload = workload_rollout(model if model is not None else self.fp32, self.tokenizer, lengths or "natural",
                                    **config)
        workload.rollout.strategy.whole_cache = whole_cache
        return workload if lengths else workload.rollout

    def medians(self, contenders: dict[str, Callable[[], Any]], rounds: int = 3, **kwargs: Any) -> dict[str, float]:
        """Interleaved medians; the rehearsal runs one round, for the code and not the figure."""
        return interleaved_medians(contenders, rounds=self.gpu.size(rounds, 1),
                                   **kwargs,
                                   device=self.device)


def greedy(max_new_tokens: int = 16, n: int = 1, **extra: Any) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n, temperature=0.0, **extra)


def sampled(max_new_tokens: int = 16, n: int = 2, **extra: Any) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n, temperature=1.0, top_k=50,
                          top_p=0.95, **extra)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return 0.0
    return (a == b).float().mean().item()


# ---- the checks -------------------------------------------------------------------------------------------------

def check_strategies(ctx: Context) -> Finding:
    """Greedy tokens of every static variant, compiled included, equal generate's (fp32); same seed, same samples,
    eager and compiled; speed."""
    request = ctx.request(batch=4, length=64)
    variants = {"static": dict(strategy="static"), "static, whole cache": dict(strategy="static", whole_cache=True),
                "static, compiled": dict(strategy="static", compile_decode=True)}
    expected = ctx.rollout(strategy="generate").generate(request, greedy(32, 2)).input_ids
    for name, config in variants.items():
        got = ctx.rollout(**config).generate(request, greedy(32, 2)).input_ids
        assert agreement(got, expected) > 0.99, f"{name}: greedy tokens agree with generate on " \
                                                f"{agreement(got, expected):.3f} of positions (fp32)"
    eager = [ctx.rollout(strategy="static", seed=7).generate(request, sampled(32)).input_ids for _ in range(2)]
    assert torch.equal(eager[0], eager[1]), "the same seed gave different samples"
    compiled = ctx.rollout(strategy="static", compile_decode=True, seed=7).generate(request, sampled(32)).input_ids
    same = agreement(compiled, eager[0])
    assert same > 0.95, f"compiled vs eager same-seed samples agree on {same:.3f}"
    fixed = dict(lengths="fixed", seed=0)
    shape = ctx.gpu.size((4, 64, 64, 4), (2, 16, 8, 2))  # B, P, R, n
    timed = ctx.request(batch=shape[0], length=shape[1])
    contenders = {name: (lambda r=ctx.rollout(ctx.model, **config, **fixed): r.generate(timed, sampled(*shape[2:])))
                  for name, config in {"generate": dict(strategy="generate"), **variants}.items()}
    medians = ctx.medians(contenders, warmup=2)
    return Finding(f"greedy tokens equal generate's; compiled samples agree {same:.3f}",
                   f"sampled B{shape[0]} n{shape[3]} P{shape[1]} R{shape[2]} ms: " + ", ".join(
                       f"{k} {v:.1f} ({medians['generate'] / v:.2f}x)" for k, v in medians.items()))


def check_profile_metadata(ctx: Context) -> Finding:
    """A profile says which timer and which memory counter it used, and they are the device's."""
    rollout = ctx.rollout(ctx.model, enable_profiling=True)
    rollout.generate(ctx.request(), greedy())
    p = rollout.get_last_profile()
    assert p.timer == ctx.gpu.timer and p.peak_memory_source.startswith(ctx.gpu.memory_source), \
        (p.timer, p.peak_memory_source)
    assert p.peak_memory_bytes > 0 and p.decode_steps == 15 and p.decode_ms > 0, p
    return Finding(f"timer {p.timer}, memory {p.peak_memory_source}", f"{p.peak_memory_bytes / 2**20:.0f} MiB peak")


def check_long_tail(ctx: Context) -> Finding:
    """Row compaction and continuous batching on a long-tailed sampled workload: the same tokens for every
    ``continuous_batch_size`` and without compaction (scheduling-independent random numbers), utilisation exact;
    the compiled step too, its graphs one per batch bucket, none recorded again on a second call."""
    request = ctx.request(batch=6, length=24)
    lengths = dict(lengths="geometric:mean=6", seed=3)
    runs = {}
    for name, config, slots in (("plain", dict(compact_rows=False), None), ("compacted", {}, None),
                                ("continuous 4", {}, 4), ("continuous 1", {}, 1)):
        rollout = ctx.rollout(ctx.fp32, enable_profiling=True, **lengths, **config)
        batch = rollout.generate(request, sampled(48, 2, continuous_batch_size=slots))
        profile = rollout.get_last_profile()
        real = int(batch.attention_mask[:, int(batch.response_start_idx[0]):].sum())
        assert profile.live_row_utilisation == real / profile.row_steps, (name, profile.live_row_utilisation)
        runs[name] = (batch.input_ids, profile)
    for name, (ids, _) in runs.items():
        assert torch.equal(ids, runs["plain"][0]), f"{name}: other tokens than without compaction"
    # a seeded rollout's k-th call draws the k-th call's numbers: the eager reference makes the same calls
    # a shape's graph is compiled and its CUDA graph recorded in warm-up calls, never in a decode step; a second
    # call records only for a shape the first did not meet (sampled lengths differ between calls). A shape may
    # record twice: a later graph (dynamo tries its newest first) can take it over, and it is warmed again
    from torch._dynamo.utils import counters

    compiled, eager = (ctx.rollout(ctx.fp32, compile_decode=on, **lengths) for on in (True, False))
    skipped = counters["inductor"]["cudagraph_skips"]
    with ctx.gpu.graph_recordings() as recordings, recordings_by_shape(recordings) as calls:
        for slots in (None, 4):
            got, expected = (r.generate(request, sampled(48, 2, continuous_batch_size=slots)) for r in (compiled, eager))
            same = agreement(got.input_ids, expected.input_ids)
            assert same > 0.95, f"compiled long-tail tokens agree with eager on {same:.3f} (slots {slots})"
        first, seen = len(recordings), {shape for _, shape, _ in calls}
        for slots in (None, 4):
            compiled.generate(request, sampled(48, 2, continuous_batch_size=slots))
        again = len(recordings) - first
    skipped = counters["inductor"]["cudagraph_skips"] - skipped
    in_steps = sum(graphs for call, _, graphs in calls if call == "step")
    recorded = collections.Counter(shape for _, shape, graphs in calls for _ in range(graphs))
    new = {shape for _, shape, _ in calls} - seen
    twice = sum(graphs > 1 for graphs in recorded.values())
    assert first > 0 and in_steps == 0 and (again == 0 or new), (
        f"{first} graphs recorded on the first calls for {len(seen)} shapes, {again} on the second ({len(new)} new "
        f"shapes); {in_steps} in decode steps; {twice} shapes recorded twice; {skipped} CUDA-graph skips")
    batch, n, cap = ctx.gpu.size((16, 4, 128), (4, 2, 32))
    wide = ctx.request(batch=batch, length=64)
    fast = ctx.rollout(ctx.model, lengths="lognormal:median=12,sigma=1.0", seed=0)
    plain = ctx.rollout(ctx.model, lengths="lognormal:median=12,sigma=1.0", seed=0, compact_rows=False)
    medians = ctx.medians({"compacted": lambda: fast.generate(wide, sampled(cap, n)),
                           "plain": lambda: plain.generate(wide, sampled(cap, n))})
    utilisation = ", ".join(f"{name} {profile.live_row_utilisation:.2f}" for name, (_, profile) in runs.items())
    return Finding(f"same tokens for {len(runs)} schedules; compiled: {first} graphs recorded for {len(seen)} shapes, "
                   f"{again} for {len(new)} new shapes on second calls, 0 in decode steps, {twice} shapes twice, "
                   f"{skipped} skips",
                   f"utilisation {utilisation}; {runs['compacted'][1].compactions} compactions; lognormal B{batch} "
                   f"n{n} P64 R<={cap}: compacted {medians['compacted']:.0f} ms vs {medians['plain']:.0f} ms "
                   f"({medians['plain'] / medians['compacted']:.2f}x)")


def check_cuda_graphs(ctx: Context) -> Finding:
    """The compiled step replays its graphs: none skipped, and no new recording once every bucket was seen,
    across prompt lengths within a bucket, training steps between rollouts and profiled calls."""
    from torch._dynamo.utils import counters

    model = copy.deepcopy(ctx.model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    rollout = ctx.rollout(model, compile_decode=True, lengths="fixed")
    lengths = (20, 33, 41)  # + 16 new tokens: cache lengths 36..57, one bucket (64)
    counters["inductor"].clear()
    with ctx.gpu.graph_recordings() as recordings:
        for length in lengths:  # every shape once (n = 2 samples: 4 rows): the recordings happen here
            model.eval()
            rollout.generate(ctx.request(length=length), sampled())
        first = len(recordings)
        for round_ in range(2):
            for length in lengths:
                model.eval()
                rollout.generate(ctx.request(length=length, seed=round_), sampled())
                model.train()  # a training step between rollouts updates parameters in place
                model(input_ids=ctx.request().prompt_ids).logits.float().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        again = len(recordings) - first
    skips = counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"{skips} CUDA-graph skips"
    assert first > 0 and again == 0, f"{first} recordings, then {again} more"
    release = ctx.rollout(ctx.model, compile_decode=True, lengths="fixed", cache_policy="release")
    with ctx.gpu.graph_recordings() as release_recordings:
        for _ in range(3):
            release.generate(ctx.request(), greedy())
    return Finding(f"{first} graphs recorded, {again} again after 6 calls with training steps, {skips} skips",
                   f"{len(lengths)} prompt lengths; cache_policy=release: {len(release_recordings)} recordings in 3 "
                   f"calls ({rollout.strategy.compiled.graphs} compiled shapes in this process)")


def check_no_host_sync(ctx: Context) -> Finding:
    """The decode loop never waits on the device (``set_sync_debug_mode('error')`` raises on a sync), eager and
    compiled, greedy and sampled, when no early exit is asked for. What is wrapped is the decode loop's own step,
    ``DecodeLoop.step``, and it must run once per decode step: a loop that stops calling it fails here. Each rollout runs
    once unwrapped first: compiling (and recording CUDA graphs) may wait on the device; the steady loop may not."""
    from opsd_rollout.rollout.decode.loop import DecodeLoop

    steps, ran = [], []
    original = DecodeLoop.step

    def strict(run: DecodeLoop) -> None:
        steps.append(1)
        with ctx.gpu.strict_sync():
            original(run)

    for compiled in (False, True):
        rollout = ctx.rollout(ctx.model, compile_decode=compiled, lengths="fixed", seed=0, enable_profiling=True)
        for sampling in (greedy(), sampled()):
            rollout.generate(ctx.request(), sampling)  # first calls: compiles, allocations
            DecodeLoop.step = strict
            try:
                before = len(steps)
                rollout.generate(ctx.request(), sampling)
            finally:
                DecodeLoop.step = original
            decode_steps = rollout.get_last_profile().decode_steps
            assert len(steps) - before == decode_steps > 0, (len(steps) - before, decode_steps)
            ran.append(f"{'compiled' if compiled else 'eager'}/{'greedy' if sampling.temperature <= 0 else 'sampled'}")
    return Finding(f"0 syncs in {len(steps)} decode steps", "strict in " + ", ".join(ran))


SYNC_FORMS: dict[str, tuple[bool, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]]] = {
    "x[ints] = 5.0": (True, lambda x, ints, mask: x.__setitem__(ints, 5.0)),
    "x[1, 2] = 5.0": (True, lambda x, ints, mask: x.__setitem__((1, 2), 5.0)),
    "x[bools] = 5.0": (False, lambda x, ints, mask: x.__setitem__(mask, 5.0)),
    "x[0].item()": (True, lambda x, ints, mask: x[0, 0].item()),
    "x[:, 0] = 5.0": (False, lambda x, ints, mask: x.__setitem__((slice(None), 0), 5.0)),
    "x[ints] = device scalar": (False, lambda x, ints, mask: x.__setitem__(ints, x.new_ones(()))),
    "x.index_fill_(0, ints, 5.0)": (False, lambda x, ints, mask: x.index_fill_(0, ints, 5.0)),
    "x.masked_fill(bools, 5.0)": (False, lambda x, ints, mask: x.masked_fill(mask, 5.0)),
    "torch.where(bools, 5.0, x)": (False, lambda x, ints, mask: torch.where(mask, 5.0, x)),
}
"""Tensor writes and reads, and whether each makes a CUDA host wait (set_sync_debug_mode raises on it), as read on
an H200 with torch 2.11 on 2026-12-04."""


def check_sync_rules(ctx: Context) -> Finding:
    """The CPU stand-in for the sync debug mode (``HostSyncDetector``) calls a write or read a host sync where
    CUDA does: every form of ``SYNC_FORMS`` as it expects, on the CPU, and on a GPU under the real debug mode."""

    def syncs(device: torch.device, strict: Callable[[], contextlib.AbstractContextManager[Any]],
              form: Callable[..., Any]) -> bool:
        x = torch.randn(8, 8, device=device)
        ints, mask = torch.arange(1, 3, device=device), x > 0
        try:
            with strict():
                form(x, ints, mask)
        except RuntimeError:
            return True
        return False

    wrong = []
    for name, (expected, form) in SYNC_FORMS.items():
        stand_in = syncs(torch.device("cpu"), HostSyncDetector, form)
        device = stand_in if ctx.gpu.rehearsal else syncs(ctx.device, ctx.gpu.strict_sync, form)
        if not stand_in == device == expected:
            wrong.append(f"{name}: expected {expected}, stand-in {stand_in}, {ctx.device.type} {device}")
    assert not wrong, "; ".join(wrong)
    ctx.gpu.used = ctx.gpu.rehearsal
    waits = [name for name, (expected, _) in SYNC_FORMS.items() if expected]
    return Finding(f"{len(SYNC_FORMS)} forms as expected", "syncs: " + ", ".join(waits))


def check_forward_timer(ctx: Context) -> Finding:
    """profile_model_time on the device's timer (CUDA events): one time per forward that ran, prefill/decode
    split."""
    from opsd_rollout.profiling import profile_model_time

    calls = []
    handle = ctx.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with ctx.gpu.device_events(), profile_model_time(ctx.model, use_cuda_events=True) as timer:
            ctx.rollout(ctx.model).generate(ctx.request(), greedy())
            split = timer.model_times(split=True)
    finally:
        handle.remove()
    assert timer.clock.kind == "cuda_events", timer.clock.kind
    n = len(split["prefill"]) + len(split["decode"])
    assert n == len(calls) and len(split["prefill"]) == 1, (n, len(calls), len(split["prefill"]))
    assert all(t > 0 for t in split["prefill"] + split["decode"])
    median = sorted(split["decode"])[len(split["decode"]) // 2]
    return Finding(f"{n} forwards timed on {timer.clock.kind}", f"median decode forward {median:.2f} ms")


def check_compiled_speed(ctx: Context) -> Finding:
    """The ``compile`` kernel's per-token comparison (``python scripts/bench_kernels.py --kernels compile``): eager vs
    compiled (CUDA graphs) at B = 1, 4, 16, 32, equal tokens asserted (fp32), the speed-up, the bytes a step reads
    (weights + KV) and each side's achieved bandwidth and share of the roofline (the device's copy bandwidth, measured
    here)."""
    from kernel_bench.compile import compiled_speed  # beside this script

    model, tokenizer = load_model(ctx.name, dtype=ctx.dtype_name, device=ctx.device)  # a fresh model: no other check's
    rows = compiled_speed(model, tokenizer, ctx.gpu.size([1, 4, 16, 32], [1]), prompt_length=ctx.gpu.size(64, 8),
                          rounds=ctx.gpu.size(5, 1), device=ctx.device)
    assert all(row["equal_tokens"] for row in rows) or ctx.dtype_name != "fp32", "compiled tokens differ"
    return Finding(", ".join(f"B{row['batch_size']} {row['eager_ms_per_token']:.2f} -> "
                             f"{row['compiled_ms_per_token']:.2f} ms/token" for row in rows),
                   f"copy bandwidth {rows[0]['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (read + write); "
                   + "; ".join(f"B{row['batch_size']}: {row['speedup']:.2f}x, {row['decode_bytes_per_step'] / 1e6:.1f} "
                               f"MB/step at {row['eager_bandwidth_bytes_per_s'] / 1e9:.1f} -> "
                               f"{row['compiled_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, roofline "
                               f"{row['eager_bandwidth_utilisation']:.0%} -> {row['compiled_bandwidth_utilisation']:.0%}, "
                               f"tokens {'equal' if row['equal_tokens'] else 'differ'}" for row in rows))


def check_opsd_step(ctx: Context) -> Finding:
    """A whole OPSD step on the device: teacher cache pinned on the host, loss finite, parameters move."""
    from opsd_rollout.deepspeed_engine import build_engine
    from opsd_rollout.opsd import DivergenceConfig, StepState, TeacherCacheConfig, opsd_step

    student, _ = load_model("qwen2-tiny", device=ctx.device)  # not the teacher: something to learn
    engine = build_engine(student.train(), 0, lr=1e-3)
    rollout = ctx.rollout(engine, enable_profiling=True)
    before = [p.detach().clone() for p in engine.module.parameters()]
    state = StepState()  # the steps' teacher-cache buffers, reused across them
    profiles = [opsd_step(engine, ctx.fp32, rollout, ctx.request(), sampled(16),
                          divergence=DivergenceConfig(loss="jsd", beta=0.5),
                          teacher_cache=TeacherCacheConfig(mode=mode, top_k=64), state=state)
                for mode in ("full", "topk", "topk")]
    assert all(0 < p.loss < float("inf") for p in profiles), [p.loss for p in profiles]
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters())), "no parameter moved"
    buffers = state.buffers.tensors
    assert buffers and all(ctx.gpu.pinned(t) for t in buffers.values()), "teacher cache not pinned"
    p = profiles[-1]
    return Finding(f"loss {p.loss:.3f}, {len(buffers)} host buffers pinned as the device wants",
                   f"step {p.total_ms:.1f} ms (rollout {p.rollout_ms:.1f}, teacher {p.teacher_forward_ms:.1f}, "
                   f"cache write {p.cache_write_ms:.1f}, backward {p.backward_ms:.1f})")


def check_teacher_placement(ctx: Context) -> Finding:
    """``train``'s teachers beside their student: with the run's defaults on a GPU (``--dtype auto``, ``--device
    auto``) the student's engine is on the device in bf16, and every teacher follows it, on that device in that dtype:
    two in-process teachers, the self-teacher's frozen copy of the student, a ZeRO-3 teacher (each partition).
    The rehearsal asks for bf16 (auto is fp32 on the CPU)."""
    from opsd_rollout.train import TrainConfig
    from opsd_rollout.train.precision import place_teachers
    from opsd_rollout.train.setup import build_student_engine, load_models

    placed = []
    for teachers in (dict(teacher=["a=qwen2-tiny", "b=gpt2-tiny"]), dict(teacher="self"),
                     dict(teacher="qwen2-tiny", teacher_zero_stage=3)):
        config = TrainConfig.from_flat(dict(output_dir="unused", student="llama-tiny", prompts_per_micro_batch=2,
                                            dtype=ctx.gpu.size("auto", "bf16"), **teachers))
        models = load_models(config)
        engine = build_student_engine(config, models.student)
        student = next(engine.module.parameters())
        assert (student.device.type, student.dtype) == (ctx.device.type, torch.bfloat16), (student.device,
                                                                                           student.dtype)
        teacher = place_teachers(models.teacher, {spec.name: spec.zero_stage for spec in config.teachers}, engine)
        for name, each in (teacher.items() if isinstance(teacher, dict) else [(teachers["teacher"], teacher)]):
            module = getattr(each, "module", each)  # a self-teacher's copy, a ZeRO-3 engine's model
            where = {(t.device, t.dtype) for t in (getattr(p, "ds_tensor", p) for p in module.parameters())}
            assert where == {(student.device, student.dtype)}, f"teacher {name}: {where}, student {student.device}"
            placed.append(f"{name} ({type(each).__name__})")
    return Finding(f"{len(placed)} teachers on {student.device} in {student.dtype}, as the student",
                   ", ".join(placed))


PROFILE_READ = "profiling/clock.py:settle"
"""Where profiling waits for the device: reading a record's marks, once each (docs/PROFILING.md)."""
STEP_RECORD_WAITS = collections.Counter({PROFILE_READ: 2})
"""An OPSD step's own record, profiled rollout or not: its parts and its eval/train switches, read at its end."""
ROLLOUT_PROFILE_WAITS = collections.Counter({PROFILE_READ: 1})
"""What profiling the rollout may add to a training step: its profile's one read."""


def check_profiled_step_syncs(ctx: Context) -> Finding:
    """A profiled training step waits for the device only where the design names: every host sync of an OPSD step
    as ``train`` runs it (profiled rollout, the gradient norm) counted by the line of ours that made it, against the
    same step with the rollout unprofiled. Profiling may add ``ROLLOUT_PROFILE_WAITS`` and nothing else, and the
    profiling code waits nowhere but in reading its records. Steps interleaved, each kind's first a warm-up."""
    from opsd_rollout.deepspeed_engine import build_engine
    from opsd_rollout.opsd import StepState, opsd_step

    student, _ = load_model("qwen2-tiny", device=ctx.device)
    engine = build_engine(student.train(), 0, lr=1e-3)
    state, counts, totals = StepState(), {}, {}
    with ctx.gpu.device_events():
        rollouts = {on: ctx.rollout(engine, enable_profiling=on, lengths="fixed", seed=0) for on in (False, True)}
        for profiled in (False, True, False, True):
            with ctx.gpu.syncs() as seen:
                step = opsd_step(engine, ctx.fp32, rollouts[profiled], ctx.request(), sampled(16), state=state,
                                 grad_norm=True)
                record = step.to_dict()  # what the training record reads
            counts[profiled], totals[profiled] = seen, record["total_ms"]
    added, removed = counts[True] - counts[False], counts[False] - counts[True]
    ours = {on: collections.Counter({site: n for site, n in counts[on].items() if site.startswith("profiling/")})
            for on in (False, True)}
    assert added == ROLLOUT_PROFILE_WAITS and not removed, f"profiling added {dict(added)}, removed {dict(removed)}"
    assert ours[False] == STEP_RECORD_WAITS and ours[True] == STEP_RECORD_WAITS + ROLLOUT_PROFILE_WAITS, ours
    assert (step.rollout is not None) and step.rollout.decode_steps == 15, step.rollout
    return Finding(f"{sum(counts[True].values())} host syncs profiled, {sum(counts[False].values())} unprofiled; "
                   f"profiling adds {sum(added.values())} ({PROFILE_READ})",
                   f"step {totals[True]:.1f} ms profiled, {totals[False]:.1f} unprofiled (one each); syncs by site: "
                   + ", ".join(f"{site} {n}" for site, n in sorted(counts[True].items())))


def check_peft_merge(ctx: Context) -> Finding:
    """PEFT adapters merged for the rollout: fuse/unfuse timed, greedy tokens equal unmerged (fp32)."""
    import peft

    lora = peft.get_peft_model(copy.deepcopy(ctx.fp32), peft.LoraConfig(
        r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    request = ctx.request()
    unmerged = ctx.rollout(lora).generate(request, greedy())
    rollout = ctx.rollout(lora, enable_profiling=True, merge_adapters=True)
    merged = rollout.generate(request, greedy())
    p = rollout.get_last_profile()
    assert p.lora_fuse_ms > 0 and p.lora_unfuse_ms > 0
    assert agreement(merged.input_ids, unmerged.input_ids) > 0.99, agreement(merged.input_ids, unmerged.input_ids)
    return Finding("tokens equal unmerged (fp32)", f"fuse {p.lora_fuse_ms:.2f} ms, unfuse {p.lora_unfuse_ms:.2f} ms")


def check_zero3(ctx: Context) -> Finding:
    """ZeRO-3: the gather attributed (time, count, bytes); gather-once against per-layer, timed unprofiled."""
    from opsd_rollout.deepspeed_engine import build_engine

    engine = build_engine(copy.deepcopy(ctx.model), 3)
    request = ctx.request()
    profiled = ctx.rollout(engine, enable_profiling=True)
    profiled.generate(request, greedy())
    p = profiled.get_last_profile()
    assert p.param_gather_ms > 0 and p.param_gather_count > 0 and p.param_gather_bytes > 0, p
    contenders = {gather: (lambda r=ctx.rollout(engine, zero3_gather=gather, lengths="fixed"):
                           r.generate(request, greedy(32)))
                  for gather in ("once", "per_layer")}
    medians = ctx.medians(contenders)
    return Finding(f"{p.param_gather_count} all-gathers, {p.param_gather_bytes / 2**20:.1f} MiB",
                   f"gather {p.param_gather_ms:.1f} ms; unprofiled B2 R32: once {medians['once']:.1f} ms, per layer "
                   f"{medians['per_layer']:.1f} ms ({medians['per_layer'] / medians['once']:.2f}x)")


def check_shared_prefix(ctx: Context) -> Finding:
    """Shared-prefix attention on the device: greedy tokens equal the copied layout's and generate's (fp32), also
    compacted, under continuous batching and compiled; same-seed samples agree in the speed dtype; decode speed
    (eager and compiled) and KV bytes side by side."""
    request, shared = ctx.request(length=160), dict(shared_prefix_min_prompt=1, enable_profiling=True)
    expected = ctx.rollout(strategy="generate").generate(request, greedy(16, 4)).input_ids
    for slots, compiled in ((None, False), (3, False), (None, True), (3, True)):
        rollout = ctx.rollout(compile_decode=compiled, **shared)
        got = rollout.generate(request, greedy(16, 4, continuous_batch_size=slots))
        assert rollout.get_last_profile().kv_layout == "shared_prefix"
        assert agreement(got.input_ids, expected) > 0.99, \
            f"slots {slots}, compiled {compiled}: {agreement(got.input_ids, expected):.3f}"
    samples = [ctx.rollout(ctx.model, seed=3, shared_prefix=on).generate(request, sampled(16, 4)).input_ids
               for on in (False, True)]
    assert agreement(*samples) > 0.9, f"{ctx.dtype} same-seed samples agree on {agreement(*samples):.3f}"
    long = ctx.request(length=ctx.gpu.size(1024, 64), padded=False)
    rollouts = {name: ctx.rollout(ctx.model, lengths="fixed", shared_prefix=on, compile_decode=compiled,
                                  shared_prefix_min_prompt=1, enable_profiling=True)
                for name, on, compiled in (("copied", False, False), ("shared", True, False),
                                           ("shared compiled", True, True))}
    medians = ctx.medians({name: (lambda r=r: r.generate(long, greedy(32, 8))) for name, r in rollouts.items()})
    kv = {name: r.get_last_profile().kv_workspace_bytes / 2**20 for name, r in rollouts.items()}
    return Finding(f"greedy tokens equal in 4 modes; samples agree {agreement(*samples):.3f}",
                   f"B2 n8 P{long.prompt_ids.shape[1]} R32 ms: copied {medians['copied']:.1f}, shared "
                   f"{medians['shared']:.1f} ({medians['copied'] / medians['shared']:.2f}x), shared compiled "
                   f"{medians['shared compiled']:.1f}; KV MiB {kv['copied']:.1f} vs {kv['shared']:.1f}")


def check_flex_attention(ctx: Context) -> Finding:
    """Flex attention: the static strategy keeps whole-cache shapes so its kernel compiles once."""
    flex = copy.deepcopy(ctx.fp32)
    flex.set_attn_implementation("flex_attention")
    request = ctx.request()
    with ctx.gpu.flex_kernel():
        expected = ctx.rollout(flex, strategy="generate").generate(request, greedy())
        got = ctx.rollout(flex).generate(request, greedy())
    assert agreement(got.input_ids, expected.input_ids) > 0.99, agreement(got.input_ids, expected.input_ids)
    return Finding("greedy tokens equal generate's (fp32)")


def arch_list_for_deepspeed() -> str:
    """DeepSpeed 0.19.8's JIT builder reads each ``TORCH_CUDA_ARCH_LIST`` entry as numbers, so an image's
    ``9.0a`` (Hopper's own instructions) fails it before any build: such a list is set, for this process, to the
    device's capability. Returns what was changed, for the finding."""
    entries = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if all(re.fullmatch(r"\d+\.\d+(\+PTX)?", entry) for entry in entries) or not torch.cuda.is_available():
        return ""
    major, minor = torch.cuda.get_device_capability()
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    return f" (TORCH_CUDA_ARCH_LIST {' '.join(entries)} read as {major}.{minor}: DeepSpeed cannot parse it)"


def check_hybrid_engine(ctx: Context) -> Finding:
    """DeepSpeed's hybrid engine with transformers 5: refused before generating, with the reason; DeepSpeed's
    own rollout on the same engine shows the reason is real. Builds DeepSpeed's inference kernels (minutes)."""
    import deepspeed
    from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedRollout

    from opsd_rollout.deepspeed_engine import deepspeed_config, init_distributed

    init_distributed()
    arch = arch_list_for_deepspeed()
    config = deepspeed_config(0, dtype=ctx.dtype)
    config["hybrid_engine"] = {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1,
                               "release_inference_cache": True, "pin_parameters": True, "tp_gather_partition_size": 8}
    model = copy.deepcopy(ctx.model)
    with ctx.gpu.inference_kernels():
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
        try:
            ctx.rollout(engine)
        except ValueError as error:
            refusal = str(error)
        else:
            raise AssertionError("the hybrid engine was accepted")
        engine.eval()
        try:
            DeepSpeedRollout(engine, ctx.tokenizer).generate(ctx.request(), greedy())
            upstream = "DeepSpeed's own rollout ran: the refusal may be too strict"
        except Exception as error:  # noqa: BLE001 - the failure is the finding
            upstream = f"DeepSpeed's own rollout fails too: {type(error).__name__}: {str(error)[:120]}"
        finally:
            engine.train()
    return Finding("refused before generating", f"{refusal[:80]}...; {upstream}{arch}")


CHECKS: list[tuple[str, Callable[[Context], Finding]]] = [
    ("strategies: equal tokens, seeds, speed", check_strategies),
    ("profile metadata", check_profile_metadata),
    ("long tail: compaction, continuous batching", check_long_tail),
    ("compiled step replays CUDA graphs", check_cuda_graphs),
    ("host-sync rules of the CPU stand-in", check_sync_rules),
    ("no host sync in the decode loop", check_no_host_sync),
    ("forward timer (CUDA events)", check_forward_timer),
    ("compiled step: speed and bandwidth per batch", check_compiled_speed),
    ("OPSD step and teacher cache", check_opsd_step),
    ("train's teachers on the student's device and dtype", check_teacher_placement),
    ("PEFT merge_adapters", check_peft_merge),
    ("ZeRO-3 gather: attribution, once vs per layer", check_zero3),
    ("shared-prefix attention: tokens, samples, speed", check_shared_prefix),
    ("flex attention", check_flex_attention),
    ("hybrid engine refused with its reason", check_hybrid_engine),
    ("host syncs of a profiled training step", check_profiled_step_syncs),  # last: it turns the GPU trace on
]


def run_check(check: Callable[[Context], Finding], ctx: Context | None, setup_error: str | None) -> tuple[str, Finding]:
    """(status, finding) of one check: ``ok``, ``rehearsed`` (it used a CPU stand-in) or ``FAILED``."""
    if ctx is None:
        return "FAILED", Finding("not run", f"setup failed: {setup_error}")
    ctx.gpu.used = False
    torch._dynamo.reset()  # every check compiles within a fresh recompile budget, as in its own process
    try:
        finding = check(ctx)
    except Exception as error:  # noqa: BLE001 - every check reports; the script goes on
        traceback.print_exc(file=sys.stderr)
        return "FAILED", Finding("-", f"{type(error).__name__}: {error}")
    return ("rehearsed" if ctx.gpu.used else "ok"), finding


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small", help="preset or local checkpoint (default llama-small)")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"], help="the speed dtype")
    parser.add_argument("--cpu", action="store_true",
                        help="rehearse every check on the CPU (fp32), CUDA-only calls replaced by stand-ins")
    parser.add_argument("--only", metavar="TEXT", help="run only the checks whose name contains TEXT")
    parser.add_argument("--skip", metavar="TEXT", action="append", default=[],
                        help="leave out the checks whose name contains TEXT (repeatable)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing checked (--cpu rehearses every check on the CPU)")
        return 0
    device, dtype = (torch.device("cpu"), "fp32") if args.cpu else (torch.device("cuda"), args.dtype)
    gpu = CpuStandIns() if args.cpu else Cuda()
    where = "CPU rehearsal" if args.cpu else torch.cuda.get_device_name(device)
    print(f"{where}, {args.model} {dtype}, torch {torch.__version__}\n| check | status | time | figure | detail |\n"
          "|---|---|---:|---|---|", flush=True)
    ctx, setup_error = None, None
    try:
        ctx = Context(args.model, dtype, device, gpu)
    except Exception as error:  # noqa: BLE001 - still print every row
        traceback.print_exc(file=sys.stderr)
        setup_error = f"{type(error).__name__}: {error}"
    failed = 0
    with gpu.running():
        for name, check in CHECKS:
            if (args.only and args.only not in name) or any(text in name for text in args.skip):
                continue
            start = time.perf_counter()
            status, finding = run_check(check, ctx, setup_error)
            failed += status == "FAILED"
            print(f"| {name} | {status} | {time.perf_counter() - start:.1f}s | {finding.figure} | {finding.detail} |",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
