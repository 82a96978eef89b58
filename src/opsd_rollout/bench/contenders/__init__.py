"""The contenders (the ``strategies`` axis) and putting them side by side.

Each contender is a module here with one ``build(built, config)``: the rollout it measures on a built engine
(``ours``: our ``HybridEngineRollout``, one contender per strategy of the engine's ``STRATEGIES``; ``deepspeed``:
DeepSpeed's own), and for ``opsd-rollout step`` its ``step`` and ``skip_reason``. ``CONTENDERS`` names them; this
module is light (the command line reads it), ``module`` imports one when it runs.

Side by side: which configs measure the same work, which ones run round by round (``--interleave``),
and each config's ratio to its baseline's (``--baseline``).

A config's *workload* is its values on the axes every contender has (shapes, dtype, decoding, ZeRO stage,
response lengths; for a step also the loss and the teacher cache): configs of one workload differ only in the
contender and the contender's own knobs. With ``interleave`` they run in one process round by round, one
iteration of each per round, the order reversed every other round, so drift and a busy neighbour hit all alike.

A config's *baseline* is the first config, in the user's order, of its workload whose contender is the baseline
and that agrees with it on every knob both contenders have (so ``static`` without compaction is against
``static`` without compaction, and ``deepspeed``, which has no such knob, against the first ``static``). The
ratio is this config's over the baseline's (``bench/ratio_test.py``: the Hodges-Lehmann estimate over every pair of
their iterations, with its Moses interval, as ``compare`` judges); the baseline's own is 1.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from opsd_rollout.bench.report import ConfigResult
from opsd_rollout.rollout.config import STRATEGIES


@dataclass(frozen=True)
class Contender:
    name: str
    module: str
    """Its module here (``build``, and ``step``, ``skip_reason`` for the OPSD step)."""
    engine_axes: bool
    """Whether it is our engine: the engine's axes apply to it (``Axis.applies_to``)."""
    needs_deepspeed: bool
    """Whether it runs only on a DeepSpeed engine (``--zero-stages none`` is refused up front)."""


CONTENDERS: dict[str, Contender] = {**{s: Contender(s, "ours", True, False) for s in STRATEGIES},
                                    "deepspeed": Contender("deepspeed", "deepspeed", False, True)}
OURS = tuple(name for name, contender in CONTENDERS.items() if contender.engine_axes)


def module(strategy: str) -> ModuleType:
    """The contender's module, imported now (torch, and DeepSpeed for ``deepspeed``)."""
    return importlib.import_module(f"opsd_rollout.bench.contenders.{CONTENDERS[strategy].module}")

RATIO_METRICS = ("total_ms", "tokens_per_second")
"""The figures each contender is set against its baseline on: the time of one iteration and its throughput (the
one to read where sampled rows' lengths differ between contenders)."""
CONFIDENCE = 0.95
"""The confidence of every Hodges-Lehmann interval: a config's against its baseline's, and ``compare``'s."""


def workload_key(config: Any, axes: Sequence[Any]) -> tuple:
    """The config's values on the axes every contender has (the strategy excepted)."""
    return tuple(getattr(config, axis.field) for axis in axes
                 if axis.field != "strategy" and set(CONTENDERS) <= set(axis.applies_to))


def workload_groups(configs: Sequence[Any], axes: Sequence[Any]) -> list[list[Any]]:
    """``configs`` grouped by workload, groups in order of first appearance, configs in their order."""
    groups: dict[tuple, list[Any]] = {}
    for config in configs:
        groups.setdefault(workload_key(config, axes), []).append(config)
    return list(groups.values())


def agrees(config: Any, other: Any, axes: Sequence[Any]) -> bool:
    """Same value on every knob both configs' contenders have."""
    both = [axis for axis in axes if config.strategy in axis.applies_to and other.strategy in axis.applies_to]
    return all(getattr(config, axis.field) == getattr(other, axis.field) for axis in both if axis.field != "strategy")


def baseline_of(config: Any, group: Sequence[Any], baseline: str, axes: Sequence[Any]) -> Any | None:
    """The config of ``group`` (``config``'s workload, in the user's order) that ``config`` is measured against."""
    return next((other for other in group if other.strategy == baseline and agrees(config, other, axes)), None)


def ratio_figures(result: ConfigResult, base: ConfigResult) -> dict[str, dict[str, float]]:
    """Per metric of ``RATIO_METRICS`` both have with positive values: ratio, low, high (result / base)."""
    from opsd_rollout.bench.ratio_test import ratio_interval  # numpy: only when a run has ratios to give

    out = {}
    for metric in RATIO_METRICS:
        mine, theirs = result.metric(metric), base.metric(metric)
        if mine is None or theirs is None or min(mine.values) <= 0 or min(theirs.values) <= 0:
            continue
        if result is base:  # by definition, not an estimate from the config's spread against itself
            out[metric] = {"ratio": 1.0, "low": 1.0, "high": 1.0}
            continue
        ratio, low, high = ratio_interval(list(theirs.values), list(mine.values), CONFIDENCE)
        out[metric] = {"ratio": ratio, "low": low, "high": high}
    return out


def set_baselines(results: Sequence[ConfigResult], axes: Sequence[Any], baseline: str) -> None:
    """Each measured result's ``baseline`` record (``ConfigResult.baseline``); ``None`` where the run has one
    contender, or where the config's baseline was not measured. ``results`` in the user's order."""
    several = len({r.config.strategy for r in results}) > 1
    by_key = {r.config.key: r for r in results}
    for group in workload_groups([r.config for r in results], axes):
        for config in group:
            result = by_key[config.key]
            result.baseline = None
            base_config = baseline_of(config, group, baseline, axes) if several else None
            base = by_key[base_config.key] if base_config is not None else None
            if result.status != "ok" or base is None or base.status != "ok":
                continue
            result.baseline = {"strategy": baseline, "key": base.config.key, "confidence": CONFIDENCE,
                               "metrics": ratio_figures(result, base)}


def set_run_baselines(results: Sequence[ConfigResult], matrix: Any, settings: Any) -> None:
    """``set_baselines`` for a run's results (in the user's order), against its ``--baseline`` (default: the first
    of its ``strategies``); nothing for a scenario without contenders (the kernels: each config its own)."""
    if has_contenders(matrix):
        set_baselines(results, matrix.scenario.axes, getattr(settings, "baseline", None) or matrix["strategies"][0])


def has_contenders(matrix: Any) -> bool:
    """Whether the matrix's scenario puts contenders side by side (a ``strategies`` axis)."""
    return any(axis.name == "strategies" for axis in matrix.scenario.axes)


def check_contenders(matrix: Any, baseline: str | None) -> None:
    """Refuse, before any work, a baseline that is not a contender of the run and DeepSpeed's rollout on a bare
    model (it needs a DeepSpeed engine)."""
    if not has_contenders(matrix):
        return
    strategies = matrix["strategies"]
    if baseline is not None and baseline not in strategies:
        raise ValueError(f"--baseline {baseline}: not among --strategies {','.join(strategies)}; name one of them "
                         "(default: the first)")
    for name in strategies:
        if CONTENDERS[name].needs_deepspeed and "none" in matrix["zero_stages"]:
            raise ValueError(f"--strategies {name} runs on a DeepSpeed engine: drop none from --zero-stages (ZeRO 0 "
                             f"wraps the same model, partitioning nothing) or {name} from --strategies")


def knob_notes(matrix: Any) -> list[str]:
    """For each knob the matrix varies or moves off its default: the contenders it does not apply to, which are
    measured once for it (the knob recorded as null in their configs)."""
    if not has_contenders(matrix):
        return []
    strategies = matrix["strategies"]
    notes = []
    for axis in matrix.scenario.axes:
        missing = [s for s in strategies if s not in axis.applies_to]
        if missing and matrix[axis.name] != matrix.scenario.defaults[axis.name]:
            notes.append(f"{axis.name} does not apply to {', '.join(missing)}: measured once there (recorded as "
                         "null)")
    return notes
