"""The benchmark matrix: a scenario's axes as the user gave them, validated all at once, expanded and ordered.

Configs share a built engine when they share ``engine_key`` (dtype, ZeRO stage); engines are built in the
order the user first names them, and within one engine the largest effective batch (then the longest
sequence) runs first, so workspaces are sized once. Results are always reported in the user's order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from opsd_rollout.bench.scenarios.base import Scenario


class Matrix:
    """Lists of values per axis of ``scenario``; the matrix is their product."""

    def __init__(self, scenario: type[Scenario], values: dict[str, list[Any]]):
        self.scenario = scenario
        self.values = values

    @classmethod
    def defaults(cls, scenario: type[Scenario]) -> "Matrix":
        return cls(scenario, {name: list(values) for name, values in scenario.defaults.items()})

    @classmethod
    def parse(cls, scenario: type[Scenario], raw: dict[str, Iterable[Any]], base: "Matrix | None" = None) -> "Matrix":
        """Axis values from strings or numbers (the CLI's comma lists, a config file's lists) over ``base``
        (default: the scenario's defaults). Every bad value is collected into one ``ValueError``."""
        axes = {axis.name: axis for axis in scenario.axes}
        values = dict((base or cls.defaults(scenario)).values)
        errors = []
        for name, items in raw.items():
            if name not in axes:
                errors.append(f"unknown axis {name!r} (axes: {', '.join(axes)})")
                continue
            items = list(items)
            if not items:
                errors.append(f"{name}: needs at least one value")
            parsed = []
            for item in items:
                try:
                    parsed.append(axes[name].parse(item))
                except (ValueError, TypeError):
                    errors.append(f"{name}: {item!r} is not {axes[name].expected}")
            values[name] = list(dict.fromkeys(parsed))  # drop repeats, keep order
        if errors:
            raise ValueError("invalid benchmark matrix:\n  " + "\n  ".join(errors))
        return cls(scenario, values)

    def __getitem__(self, axis: str) -> list[Any]:
        return self.values[axis]

    def check_positions(self, max_positions: int | None) -> None:
        """Refuse prompt + response lengths beyond the model's positions, listing every offending pair."""
        if max_positions is None:
            return
        bad = [f"prompt {p} + response {r} = {p + r}" for p in self["prompt_lengths"] for r in self["response_lengths"]
               if p + r > max_positions]
        if bad:
            raise ValueError(f"invalid benchmark matrix: beyond the model's {max_positions} positions: "
                             + "; ".join(bad))

    def expand(self) -> list[Any]:
        """Every config, in the user's order (the product of the axes, first axis slowest), repeats and the
        combinations the scenario has no config for (``make_config`` returns ``None``) dropped."""
        axes = self.scenario.axes
        configs = [self.scenario.make_config(**{axis.field: value for axis, value in zip(axes, combination)})
                   for combination in itertools.product(*(self[axis.name] for axis in axes))]
        return list({config.key: config for config in configs if config is not None}.values())

    def to_dict(self) -> dict[str, list[Any]]:
        return {axis.name: list(self[axis.name]) for axis in self.scenario.axes}


def run_order(configs: Sequence[Any]) -> list[Any]:
    """Engines in order of first appearance; within one engine, largest effective batch then longest
    sequence first (ties keep the user's order; a length a kernel does not read counts as 0)."""
    engines = list(dict.fromkeys(config.engine_key for config in configs))
    return sorted(configs, key=lambda c: (engines.index(c.engine_key), -c.effective_batch_size,
                                          -((c.prompt_length or 0) + (c.response_length or 0))))
