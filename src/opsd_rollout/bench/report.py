"""The result document: JSON for machines (atomic writes, schema, versions), and the pieces every table for
people shares. Both read the same ``ConfigResult`` objects."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from rich.table import Table

from opsd_rollout.bench.stats import Stats, is_number

SCHEMA_VERSION = 2
"""2: a rollout config has only rollout axes (1 carried the OPSD step's as ``null``); a step's part starts are
``part_start_ms`` (1: ``phase_start_ms``). Version 1 files are read and upgraded in memory."""


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
        return {"key": self.config.key, "config": asdict(self.config), "status": self.status, "error": self.error,
                "iterations": self.iterations,
                "summary": {name: stats.to_dict() for name, stats in self.summary().items()},
                "derived": self.derived, "warnings": self.warnings, "per_rank": self.per_rank, "skew": self.skew}

    @classmethod
    def from_dict(cls, data: dict[str, Any], config_type: type) -> "ConfigResult":
        return cls(config=config_type(**data["config"]), status=data["status"], error=data.get("error"),
                   iterations=list(data.get("iterations", [])), derived=dict(data.get("derived", {})),
                   warnings=list(data.get("warnings", [])), per_rank=data.get("per_rank"), skew=data.get("skew"))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``: a reader (or a crash)
    sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the permissions open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, document: dict[str, Any]) -> None:
    """``document`` as JSON (NaN and infinities as null), written atomically."""
    write_text_atomic(path, json.dumps(_finite(document), indent=1, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    """NaN and infinities become null: JSON has no spelling for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def load_schema() -> dict[str, Any]:
    return json.loads(resources.files("opsd_rollout.bench").joinpath("schema.json").read_text())


STEP_ONLY_AXES = {"losses": "loss", "betas": "beta", "teacher_caches": "teacher_cache"}


def upgrade(document: dict[str, Any]) -> dict[str, Any]:
    """A version 1 document as version 2 (see ``SCHEMA_VERSION``)."""
    if document.get("schema_version") != 1:
        return document
    document = dict(document, schema_version=SCHEMA_VERSION)
    kind = document.setdefault("kind", "rollout")
    results = []
    for result in document.get("results", []):
        result = dict(result)
        if kind == "rollout":
            result["config"] = {k: v for k, v in result["config"].items() if k not in STEP_ONLY_AXES.values()}
        else:
            result["iterations"] = [{("part_start_ms" if k == "phase_start_ms" else k): v for k, v in it.items()}
                                    for it in result.get("iterations", [])]
        results.append(result)
    document["results"] = results
    if kind == "rollout":
        document["matrix"] = {k: v for k, v in document.get("matrix", {}).items() if k not in STEP_ONLY_AXES}
    return document


def load_document(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a result file (version 1 is upgraded); ``ValueError`` says what is wrong with it."""
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"result file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or document.get("schema_version") not in (1, SCHEMA_VERSION):
        raise ValueError(f"result file {str(path)!r} is not an opsd-rollout result (schema_version 1 or "
                         f"{SCHEMA_VERSION} expected)")
    return upgrade(document)


def results_of(document: dict[str, Any], config_type: type) -> list[ConfigResult]:
    return [ConfigResult.from_dict(result, config_type) for result in document.get("results", [])]


# ---- tables for people -------------------------------------------------------------------------------------

VARIANT_AXES = {"dtype": "", "decoding": "", "zero_stage": "zero", "strategy": "", "cache_policy": "",
                "forward_timing": "fwd "}
"""Axes outside a config's ``label`` that a display label adds when they vary, with their prefix."""


def display_labels(configs: Sequence[Any]) -> dict[str, str]:
    """Short labels per config key: ``config.label`` plus whichever other axes vary across ``configs``."""
    names = {f.name for config in configs for f in fields(config)}
    varying = [axis for axis in VARIANT_AXES if axis in names and len({getattr(c, axis) for c in configs}) > 1]

    def variant(config: Any) -> str:
        parts = []
        for axis in varying:
            value = getattr(config, axis)
            if axis == "forward_timing":
                value = "on" if value else "off"
            parts.append(f"{VARIANT_AXES[axis]}{value}")
        return (" " + "/".join(parts)) if parts else ""

    return {c.key: c.label + variant(c) for c in configs}


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def mib(value: float | None) -> str:
    return fmt(value / 2**20 if value is not None else None, 0)


def config_table(results: list[ConfigResult], title: str, columns: Sequence[str],
                 row: Callable[[ConfigResult], Sequence[str]], caption: str | None = None) -> Table:
    """One row per config: its display label, then ``row(result)`` for a measured config or its status and
    error for one that was not."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    table.add_column("config", justify="left")
    for column in columns:
        table.add_column(column, justify="right")
    labels = display_labels([r.config for r in results])
    for result in results:
        if result.status != "ok":
            table.add_row(labels[result.config.key], f"{result.status}: {(result.error or '')[:70]}", style="red")
        else:
            table.add_row(labels[result.config.key], *row(result))
    return table
