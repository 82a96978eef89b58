"""Runs a benchmark matrix: builds each engine once, measures every config, survives failures, writes the
result file atomically after every config, and resumes an interrupted file."""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.bench.environment import environment_block, measure_ceilings
from opsd_rollout.bench.facts import ModelFacts
from opsd_rollout.bench.matrix import BenchConfig, BenchMatrix, BenchSettings, run_order
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.bench.report import SCHEMA_VERSION, ConfigResult, write_json_atomic
from opsd_rollout.distributed import rank_info
from opsd_rollout.models import load_model, parse_dtype


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


@dataclass
class _Engine:
    """The model built for one (dtype, ZeRO stage), with its tokenizer and facts."""

    engine: Any
    tokenizer: Any
    facts: ModelFacts
    rollouts: dict[tuple, HybridEngineRollout] = field(default_factory=dict)


class EnginePool:
    """Keeps one engine alive at a time: the one the current config needs (and, for OPSD steps, the teacher)."""

    def __init__(self, model: str, device: torch.device, *, lr: float = 1e-4, teacher: str | None = None):
        self.model, self.device, self.lr, self.teacher_name = model, device, lr, teacher
        self._key: tuple | None = None
        self._current: _Engine | None = None
        self._teacher: tuple[str, Any] | None = None

    def teacher(self, dtype: str) -> Any:
        """The frozen teacher in ``dtype``, loaded once per dtype."""
        if self._teacher is None or self._teacher[0] != dtype:
            model, _ = load_model(self.teacher_name, dtype=dtype, device=self.device)
            self._teacher = (dtype, model.requires_grad_(False))
        return self._teacher[1]

    def get(self, config: BenchConfig) -> _Engine:
        if self._key != config.engine_key:
            self.close()
            model, tokenizer = load_model(self.model, dtype=config.dtype, device=self.device)
            facts = ModelFacts.of(model)
            engine = model
            if config.zero_stage != "none":
                from opsd_rollout.deepspeed_engine import build_engine

                engine = build_engine(model, int(config.zero_stage), lr=self.lr)
            self._key, self._current = config.engine_key, _Engine(engine, tokenizer, facts)
        return self._current

    def rollout(self, config: BenchConfig, fixed_length: bool) -> tuple[HybridEngineRollout, _Engine]:
        built = self.get(config)
        key = (config.strategy, config.cache_policy, config.forward_timing)
        if key not in built.rollouts:
            cfg = HybridEngineRolloutConfig(enable_profiling=True, strategy=config.strategy,
                                            cache_policy=config.cache_policy, profile_forwards=config.forward_timing,
                                            ignore_eos=fixed_length)
            built.rollouts[key] = HybridEngineRollout(built.engine, built.tokenizer, cfg)
        return built.rollouts[key], built

    def close(self) -> None:
        if self._current is not None:
            for rollout in self._current.rollouts.values():
                rollout.shutdown()
        self._key = self._current = self._teacher = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def derived_figures(result: ConfigResult, facts: ModelFacts, ceilings: dict[str, Any] | None,
                    world_size: int = 1) -> dict[str, Any]:
    """TTFT, TPOT, prefill and decode tokens/s (medians) and utilisation against the measured ceilings."""
    c = result.config
    med = {name: (s.p50 if (s := result.metric(name)) else None) for name in (
        "ttft_ms", "tpot_ms", "prefill_ms", "prefill_tokens", "prefill_tokens_per_second",
        "decode_tokens_per_second", "response_length")}
    out: dict[str, Any] = {"time_to_first_token_ms": med["ttft_ms"], "time_per_output_token_ms": med["tpot_ms"],
                           "prefill_tokens_per_second": med["prefill_tokens_per_second"],
                           "decode_tokens_per_second": med["decode_tokens_per_second"],
                           "decode_bandwidth_utilisation": None, "prefill_compute_utilisation": None}
    if ceilings and med["tpot_ms"]:
        context = c.prompt_length + (med["response_length"] or c.response_length) / 2
        bytes_per_step = facts.decode_bytes_per_step(c.effective_batch_size, context)
        out["decode_bandwidth_utilisation"] = bytes_per_step / (med["tpot_ms"] / 1e3) / ceilings[
            "memory_bandwidth_bytes_per_s"]
    if ceilings and med["prefill_ms"] and med["prefill_tokens"]:
        # merged multi-rank iterations sum prefill tokens over ranks; the ceiling is one device's
        rows = med["prefill_tokens"] / c.prompt_length / world_size
        flops = facts.prefill_flops(round(rows), c.prompt_length)
        out["prefill_compute_utilisation"] = flops / (med["prefill_ms"] / 1e3) / ceilings["matmul_flops_per_s"]
    return out


def step_figures(result: ConfigResult) -> dict[str, Any]:
    """Medians a step benchmark reader wants first."""
    med = {name: (s.p50 if (s := result.metric(name)) else None) for name in (
        "rollout_share", "loss", "total_ms", "rollout_ms", "teacher_cache_bytes", "tokens_per_second")}
    return {"rollout_share": med["rollout_share"], "loss": med["loss"], "step_ms": med["total_ms"],
            "rollout_ms": med["rollout_ms"], "teacher_cache_bytes": med["teacher_cache_bytes"],
            "trained_tokens_per_second": med["tokens_per_second"],
            "step_ms_without_rollout": (med["total_ms"] - med["rollout_ms"]) if med["total_ms"] else None}


Progress = Callable[[str, BenchConfig | None, int], None]
"""``progress(event, config, iteration)`` with events ``config``, ``iteration``, ``done``."""


class BenchRunner:
    """Measures every pending config of a matrix; the result document is rewritten after each one."""

    def __init__(self, matrix: BenchMatrix, settings: BenchSettings, *, output: str | Path | None,
                 device: torch.device | None = None, measure_machine: bool = True,
                 existing: dict[str, Any] | None = None, collective_timeout_s: float | None = None):
        self.matrix, self.settings, self.output = matrix, settings, output
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.configs = matrix.expand()
        self.kind = "step" if matrix.is_step else "rollout"
        previous = {r["key"]: ConfigResult.from_dict(r) for r in (existing or {}).get("results", [])}
        self.results = {c.key: previous.get(c.key) or ConfigResult(config=c) for c in self.configs}
        for result in self.results.values():
            if result.status == "failed":  # a resume retries failures
                result.status, result.error, result.iterations, result.warnings = "pending", None, [], []
        self.environment = (existing or {}).get("environment")
        self._measure_machine = measure_machine
        self.timelines: dict[str, list] = {}
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun / the deepspeed launcher
            from opsd_rollout.deepspeed_engine import DEFAULT_COLLECTIVE_TIMEOUT_S, init_distributed

            init_distributed(collective_timeout_s or DEFAULT_COLLECTIVE_TIMEOUT_S)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
        self.ranks = rank_info()

    @property
    def pending(self) -> list[BenchConfig]:
        return [c for c in run_order(self.configs) if self.results[c.key].status == "pending"]

    def document(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "kind": self.kind, "environment": self.environment,
                "matrix": self.matrix.to_dict(), "settings": self.settings.to_dict(),
                "run_order": [c.key for c in run_order(self.configs)],
                "results": [self.results[c.key].to_dict() for c in self.configs]}

    def _save(self) -> None:
        if self.output is not None and self.ranks.is_main:  # only rank 0 writes
            write_json_atomic(self.output, self.document())

    def run(self, progress: Progress | None = None) -> list[ConfigResult]:
        progress = progress or (lambda *_: None)
        if self.environment is None:
            ceilings = measure_ceilings(self.device) if self._measure_machine else None
            self.environment = environment_block(self.device, ceilings)
        self._save()
        pool = EnginePool(self.settings.model, self.device, lr=self.settings.lr, teacher=self.settings.teacher)
        try:
            for config in self.pending:
                progress("config", config, 0)
                self._run_config(pool, config, progress)
                if self.ranks.world_size > 1:
                    self._merge_ranks(self.results[config.key])
                self._save()
        finally:
            pool.close()
        progress("done", None, 0)
        return [self.results[c.key] for c in self.configs]

    def _run_config(self, pool: EnginePool, config: BenchConfig, progress: Progress) -> None:
        result = self.results[config.key]
        reason = dtype_unsupported(self.device, parse_dtype(config.dtype))
        if reason:
            result.status, result.error = "skipped", reason
            return
        try:
            rollout, built = pool.rollout(config, self.settings.fixed_length)
            request, sampling = self._inputs(config, built.tokenizer, built.facts)
            measure = self._step(pool, config, built, rollout) if self.kind == "step" else self._rollout(rollout)
            torch.manual_seed(self.settings.seed)
            for index in range(self.settings.warmup + self.settings.iterations):
                profile = measure(request, sampling)
                if index >= self.settings.warmup:
                    result.iterations.append(profile.to_dict())
                progress("iteration", config, index + 1)
            self.timelines[config.key] = self._timeline(profile, rollout)
            result.status = "ok"
            self._facts = built.facts
            result.derived = self._derive(result)
            total = result.metric("total_ms")
            if total is not None and total.noisy:
                result.warnings.append(f"total_ms spread (IQR/median) is {100 * total.spread:.1f}%, over 10%: "
                                       "the machine was busy or the run too short; add --iterations")
        except Exception as error:  # noqa: BLE001 - a failed config is recorded and the run goes on
            if self.ranks.world_size > 1:  # the other ranks may be waiting in a collective: stop them all
                raise RankFailure(self.ranks.rank, config.key, error) from error
            result.status, result.iterations = "failed", []
            result.error = f"{type(error).__name__}: {error}"
            result.warnings.append(traceback.format_exc(limit=3).splitlines()[-1])
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _derive(self, result: ConfigResult) -> dict[str, Any]:
        if self.kind == "step":
            return step_figures(result)
        world_size = self.ranks.world_size if result.per_rank else 1
        return derived_figures(result, self._facts, self.environment.get("ceilings"), world_size)

    def _merge_ranks(self, result: ConfigResult) -> None:
        """Gather every rank's outcome of this config; the result becomes the merged view plus ``per_rank``."""
        from opsd_rollout.bench.ranks import gather_from_ranks, merge_iterations, stage_skew

        gathered = gather_from_ranks({"rank": self.ranks.rank, "status": result.status, "error": result.error,
                                      "iterations": result.iterations})
        result.per_rank = gathered
        if any(r["status"] != "ok" for r in gathered):
            bad = next(r for r in gathered if r["status"] != "ok")
            result.status, result.error = bad["status"], f"rank {bad['rank']}: {bad['error']}"
            return
        per_rank = [r["iterations"] for r in gathered]
        result.iterations = merge_iterations(per_rank)
        result.derived = self._derive(result)
        result.skew = stage_skew(per_rank)
        result.warnings += [f"{stage}: rank {s['slowest_rank']} is {s['max_over_median']:.2f}x the median rank"
                            for stage, s in result.skew.items() if s["flagged"]]

    @staticmethod
    def _rollout(rollout: HybridEngineRollout):
        def measure(request: RolloutRequest, sampling: SamplingConfig):
            rollout.generate(request, sampling)
            return rollout.get_last_profile()

        return measure

    def _step(self, pool: EnginePool, config: BenchConfig, built: _Engine, rollout: HybridEngineRollout):
        from opsd_rollout.opsd import DivergenceConfig, TeacherCacheConfig, opsd_step

        if config.zero_stage == "none":
            raise ValueError("an OPSD step trains a DeepSpeed engine: use --zero-stages 0-3, not none")
        teacher = pool.teacher(config.dtype)
        divergence = DivergenceConfig(loss=config.loss, beta=config.beta if config.beta is not None else 0.5)
        cache = (TeacherCacheConfig(mode="full") if config.teacher_cache == "full"
                 else TeacherCacheConfig(mode="topk", top_k=int(config.teacher_cache[3:])))

        def measure(request: RolloutRequest, sampling: SamplingConfig):
            return opsd_step(built.engine, teacher, rollout, request, sampling, divergence=divergence,
                             teacher_cache=cache)

        return measure

    @staticmethod
    def _timeline(profile: Any, rollout: HybridEngineRollout) -> list:
        """Spans of the last measured iteration: the rollout's own, or a step's phases with the rollout inside."""
        from opsd_rollout.profiling import Span

        spans = rollout.get_last_timeline() or []
        if not hasattr(profile, "phase_start_ms"):
            return spans
        offset = profile.phase_start_ms.get("rollout", 0.0)
        durations = {"rollout": profile.rollout_ms, "teacher": profile.teacher_forward_ms + profile.cache_write_ms,
                     "student_forward": profile.student_forward_ms, "loss": profile.loss_ms,
                     "backward": profile.backward_ms, "optimizer": profile.optimizer_ms}
        step = [Span("step", 0.0, profile.total_ms, None)]
        step += [Span(name, start, durations[name], "step") for name, start in profile.phase_start_ms.items()]
        return step + [Span(s.name, offset + s.start_ms, s.duration_ms, s.parent or "rollout") for s in spans]

    def _inputs(self, config: BenchConfig, tokenizer: Any, facts: ModelFacts) -> tuple[RolloutRequest, SamplingConfig]:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        request = synthetic_prompts(  # each rank rolls out its own shard of prompts
            config.batch_size, config.prompt_length, vocab_size=facts.vocab_size,
            seed=self.settings.seed + 1000 * self.ranks.rank,
            pad_fraction=self.settings.pad_fraction if self.settings.prompts == "variable" else 0.0,
            pad_token_id=pad)
        greedy = config.decoding == "greedy"
        sampling = SamplingConfig(max_new_tokens=config.response_length, n_samples_per_prompt=config.samples_per_prompt,
                                  temperature=0.0 if greedy else self.settings.temperature,
                                  top_k=self.settings.top_k, top_p=self.settings.top_p)
        return RolloutRequest(request.prompt_ids.to(self.device), request.prompt_attention_mask.to(self.device)), sampling
