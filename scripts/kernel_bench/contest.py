"""``Contest``: a kernel's measurement. Every iteration (``run()``) is one round: ours, the baseline and any extras,
each timed with the device synchronized around it (``bench/timing.py``), the order alternating from round to round
so drift and a busy neighbour hit every side alike; the runner warms rounds up and repeats them like any
iteration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from opsd_rollout.bench.timing import round_order, timed
from opsd_rollout.profiling.memory import PeakMemory
from opsd_rollout.profiling.recorder import Span


@dataclass(frozen=True)
class Timed:
    """One side's call in a round."""

    ms: float
    """Wall-clock ms per call."""
    result: Any
    """What the call returned (a profile, tokens, a per-token time)."""
    start_ms: float
    """When it started, from the round's start (for traces)."""
    peak_memory_bytes: int | None = None
    """Its peak (``measure_memory``): the accelerator's peak allocated, or the process's peak RSS on CPU."""


def rollout_inputs(config: Any, settings: Any, built: Any, device: torch.device) -> tuple[Any, Any]:
    """The rollout kernels' request (``rows / n`` synthetic prompts on ``device``) and greedy sampling config."""
    from opsd_rollout import SamplingConfig  # heavy: DeepSpeed's dataclasses
    from opsd_rollout.bench.prompts import synthetic_prompts

    n = config.samples_per_prompt
    request = synthetic_prompts(config.rows // n, config.prompt_length, vocab_size=built.spec.vocab_size,
                                seed=settings.seed, device=device)
    return request, SamplingConfig(max_new_tokens=config.response_length, n_samples_per_prompt=n, temperature=0.0)


class Contest:
    """Subclasses define ``ours`` and ``baseline`` (one call each), and may add ``extras`` (timed too, each
    reported as ``<name>_ms``), ``figures`` (when a side's figure is not its wall time) and ``same`` (whether the
    two produced the same output)."""

    repeats: ClassVar[int] = 1
    """Calls per timed sample of each side (overridden per instance for micro-kernels)."""
    measure_memory: ClassVar[bool] = False
    """Record each side's peak memory (``PeakMemory`` around its call)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._round = 0
        self._spans: list[Span] = []

    def ours(self) -> Any:
        raise NotImplementedError

    def baseline(self) -> Any:
        raise NotImplementedError

    def extras(self) -> dict[str, Any]:
        """name -> a call, timed in the same round (``sampling``'s greedy argmax)."""
        return {}

    def figures(self, sides: dict[str, Timed]) -> dict[str, Any]:
        """The round's figures: by default each side's wall time."""
        return {"kernel_ms": sides["ours"].ms, "baseline_ms": sides["baseline"].ms}

    def same(self, ours: Any, baseline: Any) -> bool | None:
        """Whether the two sides' outputs agree (``None``: not comparable, e.g. two random draws)."""
        return None

    def run(self) -> dict[str, Any]:
        calls = {"ours": self.ours, "baseline": self.baseline, **self.extras()}
        sides: dict[str, Timed] = {}
        elapsed = 0.0
        for name in round_order(list(calls), self._round):
            memory = PeakMemory(self.device) if self.measure_memory else None
            if memory is not None:
                memory.start()
            ms, result = timed(calls[name], self.device, self.repeats)
            peak = memory.stop()[0] if memory is not None else None
            sides[name] = Timed(ms, result, elapsed, peak)
            elapsed += ms * self.repeats
        self._round += 1
        out = {"total_ms": elapsed, **self.figures(sides)}
        out.update({f"{name}_ms": side.ms for name, side in sides.items() if name not in ("ours", "baseline")})
        out["speedup"] = out["baseline_ms"] / out["kernel_ms"] if out["kernel_ms"] > 0 else None
        if self.measure_memory:
            out["peak_memory_bytes"] = sides["ours"].peak_memory_bytes
            out["baseline_peak_memory_bytes"] = sides["baseline"].peak_memory_bytes
        equal = self.same(sides["ours"].result, sides["baseline"].result)
        if equal is not None:
            out["outputs_equal"] = equal
        self._spans = [Span("round", 0.0, elapsed, None)] + [
            Span(name, side.start_ms, side.ms * self.repeats, "round") for name, side in sides.items()]
        return out

    def timeline(self) -> list[Span]:
        """The last round: each side's calls inside it."""
        return self._spans
