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

from opsd_rollout.bench.stats import Stats, is_number

SCHEMA_VERSION = 4
"""The version of the document ``bench/schema.json`` describes; a file of another version is refused, not read."""


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

    def metric(self, name: str) -> Stats | None:
        return Stats.from_values(it.get(name) for it in self.iterations)

    def summary(self) -> dict[str, Stats]:
        """A ``Stats`` for every numeric field that was recorded."""
        names = dict.fromkeys(k for it in self.iterations for k, v in it.items() if is_number(v))
        return {name: stats for name in names if (stats := self.metric(name)) is not None}

    def p50(self, name: str) -> float | None:
        stats = self.metric(name)
        return stats.p50 if stats is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.config.key, "config": config_values(self.config), "status": self.status,
                "error": self.error,
                "iterations": self.iterations,
                "summary": {name: stats.to_dict() for name, stats in self.summary().items()},
                "derived": self.derived, "warnings": self.warnings, "per_rank": self.per_rank, "skew": self.skew,
                "warmup": self.warmup, "interference": self.interference, "baseline": self.baseline}

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
        return "*" if any(w.startswith("total_ms spread") for w in self.warnings) else ""


def load_schema() -> dict[str, Any]:
    return json.loads(resources.files("opsd_rollout.bench").joinpath("schema.json").read_text())


def load_document(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a result file of this version; ``ValueError`` says what is wrong with it."""
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"result file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or "schema_version" not in document:
        raise ValueError(f"result file {str(path)!r} is not an opsd-rollout result (it has no schema_version)")
    if document["schema_version"] != SCHEMA_VERSION:
        version = document["schema_version"]
        older = "an older" if isinstance(version, int) and version < SCHEMA_VERSION else "another"
        raise ValueError(f"result file {str(path)!r} is schema_version {version!r}, from {older} release; this "
                         f"release reads version {SCHEMA_VERSION}: run the benchmark again with this release (or read "
                         "the file with the one that wrote it)")
    return document


def results_of(document: dict[str, Any], config_type: type) -> list[ConfigResult]:
    return [ConfigResult.from_dict(result, config_type) for result in document.get("results", [])]


# ---- tables for people -------------------------------------------------------------------------------------
