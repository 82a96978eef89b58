"""The result document: JSON for machines (atomic writes, schema, versions) and ``ConfigResult``, which the
tables for people (``bench/tables.py``) read too."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from opsd_rollout.bench.stats import Stats, is_number, median

SCHEMA_VERSION = 5
"""The version of the document ``bench/schema.json`` describes, the one this release writes."""
READS = (4, 5)
"""The versions this release reads: a version-4 file is version 5 without ``processes`` (each config measured in one
process, the run's own); a file of another version is refused, not read."""


@dataclass(frozen=True)
class RecordedConfig:
    """A config as a result file holds it, for a kind of benchmark that has no scenario in this package (the
    developers' kernels, ``scripts/kernel_bench``): its key and its fields, as written. ``compare`` needs no more."""

    key: str
    values: dict[str, Any]

    @property
    def label(self) -> str:
        return self.key


def config_values(config: Any) -> dict[str, Any]:
    """A config's fields by name, a scenario's or a recorded one."""
    return dict(config.values) if isinstance(config, RecordedConfig) else asdict(config)


@dataclass(kw_only=True)
class ConfigResult:
    """One config's outcome: raw per-iteration figures and their summary."""

    config: Any
    """The scenario's config dataclass."""
    status: str = "pending"
    """``ok``, ``failed``, ``skipped`` or ``pending``."""
    error: str | None = None
    iterations: list[dict[str, Any]] = field(default_factory=list)
    derived: dict[str, float | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    per_rank: list[dict[str, Any]] | None = None
    """Multi-rank runs: each rank's status and raw iterations (``iterations`` is then the merged view)."""
    skew: dict[str, Any] | None = None
    """Multi-rank runs: per stage, the slowest rank and max/median of the ranks' median times."""
    warmup: dict[str, Any] | None = None
    """How the config was warmed up (``stability.Warmup``: calls, first call's ms, steady or not)."""
    interference: dict[str, Any] | None = None
    """What could have disturbed the measured calls (``stability.Interference``), and whether it did."""
    baseline: dict[str, Any] | None = None
    """With several contenders: this config against its baseline's (``bench/contenders.py``): the baseline's
    ``strategy`` and ``key``, the ``confidence``, and per metric the Hodges-Lehmann ``ratio`` (this / baseline)
    with its ``low`` and ``high`` bounds (``high`` null: too few iterations to bound it)."""
    processes: list[dict[str, Any]] | None = None
    """Measured in several fresh processes (``--processes``, ``bench/processes.py``): each process's own record, in
    the order they ran: its ``pid``, ``iterations``, ``warmup``, ``interference``, ``derived`` figures and ``warnings``;
    ``iterations`` above is then every process's, one after the other, and the other fields their merged view.
    ``None``: one process (the run's own, or a version-4 file), whose iterations are ``iterations``."""

    def metric(self, name: str) -> Stats | None:
        return Stats.from_values(it.get(name) for it in self.iterations)

    def summary(self) -> dict[str, Stats]:
        """A ``Stats`` for every numeric field that was recorded."""
        names = dict.fromkeys(k for it in self.iterations for k, v in it.items() if is_number(v))
        return {name: stats for name in names if (stats := self.metric(name)) is not None}

    def p50(self, name: str) -> float | None:
        stats = self.metric(name)
        return stats.p50 if stats is not None else None

    @property
    def process_count(self) -> int:
        return len(self.processes) if self.processes else 1

    def per_process(self) -> list[list[dict[str, Any]]]:
        """Each process's iterations (one list for a config measured in one process)."""
        return [p["iterations"] for p in self.processes] if self.processes else [self.iterations]

    def _per_process_stats(self, name: str) -> list[Stats]:
        stats = (Stats.from_values(it.get(name) for it in iterations) for iterations in self.per_process())
        return [s for s in stats if s is not None]

    def process_medians(self, name: str) -> list[float]:
        """The median of ``name`` in each process that recorded it, in the order the processes ran."""
        return [s.p50 for s in self._per_process_stats(name)]

    def within_spread(self, name: str) -> float | None:
        """How much ``name`` spreads inside a process: the median over the processes of each one's IQR/median."""
        spreads = [s.spread for s in self._per_process_stats(name)]
        return median(spreads) if spreads else None

    def between_spread(self, name: str) -> float | None:
        """How much ``name`` spreads between processes: the IQR/median of the processes' medians; ``None`` with
        fewer than two (one process says nothing of it)."""
        medians = self.process_medians(name)
        return Stats.from_values(medians).spread if len(medians) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.config.key, "config": config_values(self.config), "status": self.status,
                "error": self.error,
                "iterations": self.iterations,
                "summary": {name: stats.to_dict() for name, stats in self.summary().items()},
                "derived": self.derived, "warnings": self.warnings, "per_rank": self.per_rank, "skew": self.skew,
                "warmup": self.warmup, "interference": self.interference, "baseline": self.baseline,
                "processes": self.processes}

    @classmethod
    def from_dict(cls, data: dict[str, Any], config_type: type) -> "ConfigResult":
        """The result of ``data`` (``to_dict``'s), its lists and dicts copied: a resumed run appends to its own.
        ``config_type`` ``RecordedConfig`` keeps the config as written, with its key."""
        given = {f.name: copy.copy(data[f.name]) for f in fields(cls) if f.name != "config" and f.name in data}
        config = (RecordedConfig(data["key"], dict(data["config"])) if config_type is RecordedConfig
                  else config_type(**data["config"]))
        return cls(config=config, **given)

    @property
    def disturbed(self) -> bool:
        return bool(self.interference and self.interference.get("disturbed"))

    @property
    def spread_flag(self) -> str:
        """``*`` when a spread warning was given (the table marks it; the warning says why)."""
        return "*" if any("total_ms spread" in w for w in self.warnings) else ""


def load_schema() -> dict[str, Any]:
    return json.loads(resources.files("opsd_rollout.bench").joinpath("schema.json").read_text())


def load_document(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a result file of a version this release reads (``READS``); ``ValueError`` says what is wrong
    with it."""
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"result file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or "schema_version" not in document:
        raise ValueError(f"result file {str(path)!r} is not an opsd-rollout result (it has no schema_version)")
    if document["schema_version"] not in READS:
        version = document["schema_version"]
        older = "an older" if isinstance(version, int) and version < min(READS) else "another"
        raise ValueError(f"result file {str(path)!r} is schema_version {version!r}, from {older} release; this "
                         f"release reads versions {' and '.join(map(str, READS))}: run the benchmark again with this "
                         "release (or read the file with the one that wrote it)")
    return document


def results_of(document: dict[str, Any], config_type: type) -> list[ConfigResult]:
    return [ConfigResult.from_dict(result, config_type) for result in document.get("results", [])]


def run_document(runner: Any, order: list[Any]) -> dict[str, Any]:
    """A run's result file as it stands: ``runner`` (one process's ``BenchRunner`` or the ``ProcessRunner`` over
    several) gives the kind, environment, matrix, settings, configs and their results; ``order`` is the configs in
    the order they run."""
    return {"schema_version": SCHEMA_VERSION, "kind": runner.kind, "environment": runner.environment,
            "matrix": runner.matrix.to_dict(), "settings": vars(runner.settings).copy(),
            "run_order": [c.key for c in order], "results": [runner.results[c.key].to_dict() for c in runner.configs]}


# ---- tables for people -------------------------------------------------------------------------------------
