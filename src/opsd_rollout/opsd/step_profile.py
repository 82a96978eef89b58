"""What one OPSD step reports: ``StepProfile`` (its parts' times, memory, the teacher's cache and latency, the
loss, per teacher with several), and ``StepParts``, the recorder its parts are timed with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from opsd_rollout.files import json_safe
from opsd_rollout.metrics import STEP_PARTS, STEP_STAGES, bytes_text, hidden_share, label
from opsd_rollout.profiling import PeakMemory, RolloutProfile, StageRecorder

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class StepProfile:
    """Where one OPSD step's time went (ms), with the rollout's own profile nested."""

    rollout: RolloutProfile | None
    """The rollout's full profile (``None`` if the rollout was not profiled)."""
    eval_ms: float
    """``engine.eval()`` before the rollout."""
    train_ms: float
    """``engine.train()`` after it."""
    rollout_ms: float
    """The rollout call (its profile's ``total_ms`` plus validation)."""
    teacher_forward_ms: float
    """The in-process teacher's forwards and LM-head chunks (0 with a served teacher: see ``teacher_wait_ms``)."""
    cache_write_ms: float
    """Copying teacher logits (or their top-k) to the host cache (the in-process teacher's)."""
    teacher_wait_ms: float = 0.0
    """A served teacher: the step blocked on its answer, after the student's forward (the latency not hidden)."""
    student_forward_ms: float
    loss_ms: float
    backward_ms: float
    optimizer_ms: float
    total_ms: float
    rollout_share: float
    """(eval + rollout + train) / total: what the step spends producing its samples."""
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    """Per step part: accelerator peak allocated on CUDA, process peak RSS on CPU."""
    part_start_ms: dict[str, float] = field(default_factory=dict)
    """Per step part: its start, from the start of the step (for traces)."""
    response_tokens: int = 0
    teacher_cache_bytes: int = 0
    teacher_cache_budget_bytes: int = 0
    """The host-memory budget the teacher cache was checked against."""
    teacher_cache_mode: str = "full"
    """The cache that was built: ``full`` or ``topk`` (also when ``over_budget="topk"`` switched to it)."""
    fused_loss: bool = False
    """Whether the loss ran fused with the student's LM head (``DivergenceConfig.fused``)."""
    teacher_parameter_bytes: int = 0
    """The teacher's parameter bytes held on this rank: all of them, or its partition under ZeRO-3."""
    loss: float = 0.0
    grad_norm: float | None = None
    """The 2-norm of the gradient the optimizer stepped on, before clipping, when asked for
    (``opsd_step(..., grad_norm=True)``) and the step was an accumulation boundary; else ``None``."""
    teacher_losses: dict[str, float] = field(default_factory=dict)
    """Several teachers: each one's loss, the mean over the response tokens routed to it (every rank's)."""
    teacher_tokens: dict[str, int] = field(default_factory=dict)
    """Several teachers: the response tokens routed to each (every rank's)."""
    nonfinite: str | None = None
    """Whether the loss (every rank's) was not finite, and what in this rank's step went first: ``teacher cache``,
    ``student forward``, ``loss``; ``None`` when it was finite, or when this rank's parts were (another rank's
    went). Such a step's optimizer step is skipped (``opsd.nonfinite``)."""
    teacher_latency_ms: float = 0.0
    """A served teacher: its requests, from sending to the cache written. In flight while the step works (the
    student's forward; in ``train`` with accumulation, the next micro-batches' rollouts too): not a part of
    ``total_ms``, whose parts hold only ``teacher_wait_ms``, the latency left exposed."""

    @property
    def teacher_hidden_share(self) -> float | None:
        """The share of a served teacher's latency the step's own work hid, ``1 - wait / latency``; ``None`` with
        an in-process teacher."""
        return hidden_share(self.teacher_wait_ms, self.teacher_latency_ms)

    @property
    def tokens_per_second(self) -> float:
        """Response tokens trained on per second of step."""
        return self.response_tokens / (self.total_ms / 1e3) if self.total_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """One flat, JSON-safe record with stable names, for a JSON line or a scalar logger: the step's fields,
        ``tokens_per_second``, ``peak_memory_bytes`` (the largest part's) and ``peak_<part>_bytes``,
        ``<part>_start_ms``, and the rollout profile's record under ``rollout/`` (absent when it was not profiled)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("rollout", "peak_memory_bytes", "part_start_ms", "teacher_losses", "teacher_tokens",
                                  "nonfinite")}
        if self.nonfinite is not None:
            data["nonfinite"] = self.nonfinite
        data["tokens_per_second"] = self.tokens_per_second
        data["teacher_hidden_share"] = self.teacher_hidden_share
        data["peak_memory_bytes"] = max(self.peak_memory_bytes.values(), default=0)
        data.update({f"peak_{part}_bytes": peak for part, peak in self.peak_memory_bytes.items()})
        data.update({f"{part}_start_ms": start for part, start in self.part_start_ms.items()})
        data.update({f"loss/{name}": value for name, value in self.teacher_losses.items()})
        data.update({f"response_tokens/{name}": value for name, value in self.teacher_tokens.items()})
        data = json_safe(data)
        if self.rollout is not None:
            data.update({f"rollout/{key}": value for key, value in self.rollout.to_dict().items()})
        return data

    def __str__(self) -> str:
        """A few lines for a person: loss, the parts in ms, throughput and memory, then the rollout's first line."""
        parts = ", ".join(f"{label(name)} {getattr(self, name):.1f}" for name in STEP_STAGES)
        peak = bytes_text(max(self.peak_memory_bytes.values(), default=0))
        lines = [f"StepProfile: loss {self.loss:.4f}, {self.total_ms:.1f} ms, rollout share {self.rollout_share:.0%}",
                 f"  parts ms: {parts}",
                 f"  {self.response_tokens} response tokens, {self.tokens_per_second:.1f} tok/s; peak memory {peak}; "
                 f"teacher cache {self.teacher_cache_mode} {bytes_text(self.teacher_cache_bytes)}; "
                 f"fused loss {'on' if self.fused_loss else 'off'}"]
        if self.rollout is not None:
            lines.append("  rollout: " + str(self.rollout).splitlines()[0].removeprefix("RolloutProfile: "))
        return "\n".join(lines)


class StepParts:
    """The step's parts as stages of one deferred recorder (marks read once, at the end), each with the peak
    memory it reached."""

    def __init__(self, recorder: StageRecorder, device: torch.device):
        self.recorder, self.device = recorder, device
        self.peaks: dict[str, int] = {}

    def run(self, name: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        memory = PeakMemory(self.device)
        memory.start()
        with self.recorder.stage(name):
            result = fn(*args, **kwargs)
        self.peaks[name] = memory.stop()[0]
        return result

    def times(self) -> tuple[dict[str, float], dict[str, float]]:
        """Once the step is over: each stage's ms, and each step part's start from the start of the step."""
        resolved = self.recorder.resolve()
        return resolved.stages, {span.name: span.start_ms for span in resolved.spans if span.name in STEP_PARTS}
