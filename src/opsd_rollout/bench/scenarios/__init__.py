"""Benchmark kinds. A scenario owns everything particular to what it measures: its axes and config type, its
settings (with their defaults), how one iteration is measured, the figures derived from a config's
iterations, its table and its time breakdown. The matrix, runner, statistics, JSON, plots, compare and
multi-rank merging are shared and know nothing of any kind.

Adding a kind: a module here with a ``Scenario`` subclass (and its config and settings dataclasses),
registered in ``SCENARIOS``; a CLI subcommand that names it (``COMMANDS`` in ``cli/bench.py``). See
docs/ARCHITECTURE.md. A scenario outside the package (the developers' kernels, ``scripts/kernel_bench``) runs
through the same pieces with a ``BenchCommand`` of its own; ``compare`` reads its results from the document alone.
"""

from __future__ import annotations

from opsd_rollout.bench.scenarios.base import Measurement, Scenario
from opsd_rollout.bench.scenarios.rollout import RolloutConfig, RolloutScenario, RolloutSettings
from opsd_rollout.bench.scenarios.step import StepConfig, StepScenario, StepSettings

SCENARIOS: dict[str, type[Scenario]] = {scenario.kind: scenario for scenario in (RolloutScenario, StepScenario)}


def scenario_class(kind: str) -> type[Scenario]:
    """The scenario of a result file's ``kind``."""
    if kind not in SCENARIOS:
        raise ValueError(f"unknown benchmark kind {kind!r}; kinds are {sorted(SCENARIOS)}")
    return SCENARIOS[kind]


__all__ = ["Measurement", "RolloutConfig", "RolloutScenario", "RolloutSettings", "SCENARIOS", "Scenario", "StepConfig",
           "StepScenario", "StepSettings", "scenario_class"]
