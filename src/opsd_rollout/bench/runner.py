"""Runs a benchmark matrix of any scenario: builds each engine once, measures every config, survives failures,
writes the result file atomically after every config, and resumes an interrupted file."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from opsd_rollout.bench.contenders import set_run_baselines, workload_groups
from opsd_rollout.bench.engines import EnginePool
from opsd_rollout.bench.environment import environment_block, measure_ceilings
from opsd_rollout.bench.matrix import Matrix, run_order
from opsd_rollout.bench.pace import REFERENCE_METRIC
from opsd_rollout.bench.ranks import merge_iterations, stage_skew
from opsd_rollout.bench.reference import ReferenceWorkload
from opsd_rollout.bench.report import ConfigResult, run_document
from opsd_rollout.bench.scenarios.base import Measurement
from opsd_rollout.bench.stability import (Interference, InterferenceMonitor, Warmup, merge_interference,
                                          spread_warning, warm_up)
from opsd_rollout.bench.threads import share_cores
from opsd_rollout.deepspeed_config import LEARNING_RATE
from opsd_rollout.deepspeed_engine import DEFAULT_COLLECTIVE_TIMEOUT_S, init_distributed
from opsd_rollout.distributed import agree_all, gather_objects, rank_info
from opsd_rollout.files import write_json_atomic
from opsd_rollout.modeling import ModelSpec
from opsd_rollout.models import parse_dtype


class RankFailure(RuntimeError):
    """A config failed on one rank of a multi-rank run: the run stops, on every rank."""

    def __init__(self, rank: int, key: str, error: BaseException):
        super().__init__(f"rank {rank} failed on config {key}: {type(error).__name__}: {error}")
        self.rank = rank


def dtype_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``dtype`` cannot run on ``device`` (a tiny matmul + softmax probe fails), or ``None``."""
    try:
        x = torch.randn(8, 8, device=device).to(dtype)
        torch.softmax(x @ x, dim=-1).sum().item()
    except (RuntimeError, TypeError) as error:
        return f"{dtype} is not supported on {device}: {error}"
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(device)} does not support bf16"
    return None


Progress = Callable[[str, Any, int], None]
"""``progress(event, config, iteration)`` with events ``config``, ``iteration``, ``done``."""


class BenchRunner:
    """Measures every pending config of a matrix; the result document is rewritten after each one."""

    def __init__(self, matrix: Matrix, settings: Any, *, output: str | Path | None,
                 device: torch.device | None = None, measure_machine: bool = True,
                 existing: dict[str, Any] | None = None, collective_timeout_s: float | None = None,
                 only: Collection[str] | None = None):
        """``only``: the keys of the configs to measure (a worker of ``bench/processes.py``); ``None``: all."""
        self.matrix, self.settings, self.output = matrix, settings, output
        self.scenario = matrix.scenario(settings)
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.configs = [c for c in matrix.expand() if only is None or c.key in only]
        config_type = matrix.scenario.config_type
        previous = {r["key"]: ConfigResult.from_dict(r, config_type) for r in (existing or {}).get("results", [])}
        self.results = {c.key: previous.get(c.key) or ConfigResult(config=c) for c in self.configs}
        for result in self.results.values():
            if result.status == "failed":  # a resume retries failures
                result.status, result.error, result.iterations, result.warnings = "pending", None, [], []
        self.environment = (existing or {}).get("environment")
        self._measure_machine = measure_machine
        self.timelines: dict[str, list] = {}
        self._compile_ms: dict[str, float | None] = {}
        # under a launcher, the local ranks divide the cores; a served teacher may have some kept for its server
        self.threads = share_cores(self.scenario.cores_to_keep())
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun / the deepspeed launcher
            init_distributed(collective_timeout_s or DEFAULT_COLLECTIVE_TIMEOUT_S)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
        self.ranks = rank_info()
        self._spec: ModelSpec | None = None

    @functools.cached_property
    def reference(self) -> ReferenceWorkload:
        """Timed beside every iteration (``reference_ms``): the machine's pace, which ``compare`` notes (and
        ``--pace adjusted`` adjusts the times for); made when the first iteration is measured (a run with nothing
        pending makes none)."""
        return ReferenceWorkload(self.device)

    @property
    def kind(self) -> str:
        return self.matrix.scenario.kind

    @property
    def pending(self) -> list[Any]:
        return [c for c in run_order(self.configs) if self.results[c.key].status == "pending"]

    @property
    def runs_pending(self) -> int:
        """Config measurements still to make: one per pending config (in this process)."""
        return len(self.pending)

    def write_trace(self, path: str | Path) -> bool:
        """A Chrome/Perfetto trace of one measured iteration per config; whether there was one to write."""
        from opsd_rollout.profiling.trace import chrome_trace

        timelines = [(c.key, self.timelines[c.key]) for c in self.configs if c.key in self.timelines]
        write_json_atomic(Path(path), chrome_trace(timelines))
        return True

    def document(self) -> dict[str, Any]:
        return run_document(self, run_order(self.configs))

    def _save(self) -> None:
        if self.output is not None and self.ranks.is_main:  # only rank 0 writes
            write_json_atomic(self.output, self.document())

    def batches(self) -> list[list[Any]]:
        """The pending configs as they run: one at a time, or with ``interleave`` each workload's contenders
        together (``bench/contenders.py``), in run order."""
        if not getattr(self.settings, "interleave", False):
            return [[config] for config in self.pending]
        return workload_groups(self.pending, self.matrix.scenario.axes)

    def run(self, progress: Progress | None = None) -> list[ConfigResult]:
        progress = progress or (lambda *_: None)
        if self.environment is None:
            ceilings = measure_ceilings(self.device) if self._measure_machine else None
            self.environment = environment_block(self.device, ceilings, self.threads)
        self._save()
        pool = EnginePool(self.settings.model, self.device, lr=getattr(self.settings, "lr", LEARNING_RATE),
                          rank=self.ranks.rank, kept_cores=self.threads.kept)
        try:
            for batch in self.batches():
                self._run_batch(pool, batch, progress)
                for config in batch:
                    if self.ranks.world_size > 1:
                        self._merge_ranks(self.results[config.key])
                set_run_baselines([self.results[c.key] for c in self.configs], self.matrix, self.settings)
                self._save()
        finally:
            pool.shutdown()
        progress("done", None, 0)
        return [self.results[c.key] for c in self.configs]

    def _run_batch(self, pool: EnginePool, batch: list[Any], progress: Progress) -> None:
        """Warm up each config of ``batch``, then measure them round by round: one iteration of each per round,
        the order reversed every other round (one config: its iterations one after the other)."""
        reference = self.reference  # made (and warmed up) before the first config, not between its iterations
        started = {}
        for config in batch:
            measurement = self._start(pool, config, progress)
            if measurement is not None:
                started[config.key] = (config, measurement)
        monitor = InterferenceMonitor()
        monitor.start()
        for index in range(self.settings.iterations):
            order = list(started.values())
            for config, measurement in (order if index % 2 == 0 else order[::-1]):
                try:
                    figures = measurement.run()
                    self.results[config.key].iterations.append({**figures, REFERENCE_METRIC: reference.run()})
                except Exception as error:  # noqa: BLE001 - a failed config is recorded and the run goes on
                    self._fail(config, error)
                    del started[config.key]
                    continue
                progress("iteration", config, index + 1)
        interference = monitor.stop()  # the same machine for every config of the batch
        for config, measurement in started.values():
            result = self.results[config.key]
            try:
                self.timelines[config.key] = measurement.timeline()
            except Exception as error:  # noqa: BLE001 - a failed config is recorded and the run goes on
                self._fail(config, error)
                continue
            result.interference, result.status = interference.to_dict(), "ok"
            if self.ranks.world_size == 1:
                self._finish(result)

    def _start(self, pool: EnginePool, config: Any, progress: Progress) -> Measurement | None:
        """The config prepared and warmed up, or ``None`` (recorded as skipped or failed)."""
        progress("config", config, 0)
        result = self.results[config.key]
        reason = dtype_unsupported(self.device, parse_dtype(config.dtype)) or self.scenario.skip_reason(config)
        if reason:
            result.status, result.error = "skipped", reason
            return None
        try:
            measurement = self.scenario.prepare(pool, config)
            self._spec = pool.get(config).spec
            progress("first_call", config, 0)  # the engine is built: the first call (compiles, allocates) starts
            torch.manual_seed(self.settings.seed)
            s = self.settings

            def warmup_call() -> None:
                figures = measurement.run()
                progress("warmup", config, len(warmup_times) + 1)
                warmup_times.append(figures.get("compile_ms"))

            warmup_times: list[float | None] = []
            warmup = warm_up(warmup_call, fixed=s.warmup, max_iterations=s.warmup_max_iterations,
                             max_seconds=s.warmup_max_seconds, tolerance=s.steady_tolerance, all_ranks=self._all_ranks)
        except Exception as error:  # noqa: BLE001 - a failed config is recorded and the run goes on
            self._fail(config, error)
            return None
        result.warmup = warmup.to_dict()
        compiles = [ms for ms in warmup_times if ms is not None]
        self._compile_ms[config.key] = sum(compiles) if compiles else None
        return measurement

    def _fail(self, config: Any, error: Exception) -> None:
        if self.ranks.world_size > 1:  # the other ranks may be waiting in a collective: stop them all
            raise RankFailure(self.ranks.rank, config.key, error) from error
        result = self.results[config.key]
        result.status, result.iterations = "failed", []
        result.error = f"{type(error).__name__}: {error}"
        result.warnings.append(traceback.format_exception(error, limit=3)[-1].strip())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _all_ranks(self, done: bool) -> bool:
        """Whether every rank is done warming up (each rank's collectives must pair with the others')."""
        return agree_all(done, self.device)

    def _finish(self, result: ConfigResult) -> None:
        """Derived figures and the spread warning, from the config's final (for several ranks: merged)
        iterations, so the table's ``*`` and its warning always come together."""
        world_size = self.ranks.world_size if result.per_rank else 1
        result.derived = self.scenario.derive(result, self._spec, self.environment.get("ceilings"), world_size)
        result.derived.update(warmup_iterations=(result.warmup or {}).get("iterations"),
                              first_call_ms=(result.warmup or {}).get("first_call_ms"))
        if self._compile_ms.get(result.config.key) is not None:  # compile_decode: compiling, during warm-up
            result.derived["warmup_compile_ms"] = self._compile_ms[result.config.key]
        warmup = Warmup(**result.warmup) if result.warmup else None
        interference = Interference.from_dict(result.interference) if result.interference else None
        warning = spread_warning(result.metric("total_ms"), warmup, interference, self.settings.steady_tolerance)
        if warning:
            result.warnings.append(warning)
        elif interference is not None and interference.disturbed:
            result.warnings.append(f"disturbed: {'; '.join(interference.reasons)} (the times did not spread, "
                                   "but compare them with care)")

    def _merge_ranks(self, result: ConfigResult) -> None:
        """Gather every rank's outcome of this config; the result becomes the merged view plus ``per_rank``."""
        gathered = gather_objects({"rank": self.ranks.rank, "status": result.status, "error": result.error,
                                      "iterations": result.iterations, "interference": result.interference})
        result.per_rank = gathered
        if any(r["status"] != "ok" for r in gathered):
            bad = next(r for r in gathered if r["status"] != "ok")
            result.status, result.error = bad["status"], f"rank {bad['rank']}: {bad['error']}"
            return
        per_rank = [r["iterations"] for r in gathered]
        result.iterations = merge_iterations(per_rank)
        result.interference = merge_interference([Interference.from_dict(r["interference"]) for r in gathered]).to_dict()
        result.skew = stage_skew(per_rank)
        self._finish(result)
        result.warnings += [f"{stage}: rank {s['slowest_rank']} is {s['max_over_median']:.2f}x the median rank"
                            for stage, s in result.skew.items() if s["flagged"]]

