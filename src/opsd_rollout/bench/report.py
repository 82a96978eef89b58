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

from rich import box
from rich.table import Table

from opsd_rollout.bench.stats import Stats, is_number

SCHEMA_VERSION = 3
"""3: the response-length model is an axis (``length_models``, config ``lengths``) instead of the setting
``fixed_length`` (true: ``fixed``, false: ``natural``). 2: a rollout config has only rollout axes (1 carried the
OPSD step's as ``null``); a step's part starts are ``part_start_ms`` (1: ``phase_start_ms``). Older files are
read and upgraded in memory."""


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
                "derived": self.derived, "warnings": self.warnings, "per_rank": self.per_rank, "skew": self.skew,
                "warmup": self.warmup, "interference": self.interference}

    @classmethod
    def from_dict(cls, data: dict[str, Any], config_type: type) -> "ConfigResult":
        return cls(config=config_type(**data["config"]), status=data["status"], error=data.get("error"),
                   iterations=list(data.get("iterations", [])), derived=dict(data.get("derived", {})),
                   warnings=list(data.get("warnings", [])), per_rank=data.get("per_rank"), skew=data.get("skew"),
                   warmup=data.get("warmup"), interference=data.get("interference"))

    @property
    def disturbed(self) -> bool:
        return bool(self.interference and self.interference.get("disturbed"))

    @property
    def spread_flag(self) -> str:
        """``*`` when a spread warning was given (the table marks it; the warning says why)."""
        return "*" if any(w.startswith("total_ms spread") for w in self.warnings) else ""


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
    """An older document as the current version (see ``SCHEMA_VERSION``); keys are unchanged."""
    version = document.get("schema_version")
    if version == SCHEMA_VERSION:
        return document
    document = dict(document, schema_version=SCHEMA_VERSION)
    kind = document.setdefault("kind", "rollout")
    settings = dict(document.get("settings") or {})
    lengths = "fixed" if settings.pop("fixed_length", True) else "natural"
    document["settings"] = settings
    document["matrix"] = {**document.get("matrix", {}), "length_models": [lengths]}
    if version == 1 and kind == "rollout":
        document["matrix"] = {k: v for k, v in document["matrix"].items() if k not in STEP_ONLY_AXES}
    results = []
    for result in document.get("results", []):
        result = dict(result)
        config = {**result["config"], "lengths": lengths}
        if version == 1 and kind == "rollout":
            config = {k: v for k, v in config.items() if k not in STEP_ONLY_AXES.values()}
        if version == 1 and kind == "step":
            result["iterations"] = [{("part_start_ms" if k == "phase_start_ms" else k): v for k, v in it.items()}
                                    for it in result.get("iterations", [])]
        result["config"] = config
        results.append(result)
    document["results"] = results
    return document


def load_document(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a result file (older versions are upgraded); ``ValueError`` says what is wrong with it."""
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"result file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or document.get("schema_version") not in range(1, SCHEMA_VERSION + 1):
        raise ValueError(f"result file {str(path)!r} is not an opsd-rollout result (schema_version 1 to "
                         f"{SCHEMA_VERSION} expected)")
    return upgrade(document)


def results_of(document: dict[str, Any], config_type: type) -> list[ConfigResult]:
    return [ConfigResult.from_dict(result, config_type) for result in document.get("results", [])]


# ---- tables for people -------------------------------------------------------------------------------------

VARIANT_AXES = {"dtype": "", "decoding": "", "zero_stage": "zero", "strategy": "", "cache_policy": "",
                "forward_timing": "fwd ", "lengths": "", "compile_decode": ""}
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
            elif axis == "compile_decode":
                value = "compiled" if value else "eager"
            parts.append(f"{VARIANT_AXES[axis]}{value}")
        return (" " + "/".join(parts)) if parts else ""

    return {c.key: c.label + variant(c) for c in configs}


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def mib(value: float | None) -> str:
    return fmt(value / 2**20 if value is not None else None, 0)


def compact_table(title: str, columns: Sequence[str], rows: Sequence[tuple[Sequence[str], str | None]],
                  caption: str | None = None) -> Table:
    """A table that fits an 80-column terminal: the first column (a label) and the headers wrap, the other
    cells (numbers, verdicts) never wrap nor get cut. ``rows``: (cells, style)."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left", box=box.SIMPLE_HEAD,
                  padding=(0, 1), collapse_padding=True, pad_edge=False)
    table.add_column(columns[0], justify="left", overflow="fold", ratio=1)
    for column in columns[1:]:
        table.add_column(_two_lines(column), justify="right", no_wrap=True)
    for cells, style in rows:
        table.add_row(*cells, style=style)
    return table


def _two_lines(header: str) -> str:
    """A header of several words on two lines, split where the halves are most even: narrower columns."""
    words = header.split(" ")
    if len(words) < 2:
        return header
    split = min(range(1, len(words)), key=lambda i: abs(len(" ".join(words[:i])) - len(" ".join(words[i:]))))
    return " ".join(words[:split]) + "\n" + " ".join(words[split:])


def config_table(results: list[ConfigResult], title: str, columns: Sequence[str],
                 row: Callable[[ConfigResult], Sequence[str]], caption: str | None = None) -> Table:
    """One row per config: its display label, then ``row(result)`` for a measured config or its status for one
    that was not (its error is printed below the tables)."""
    labels = display_labels([r.config for r in results])
    rows = [([labels[r.config.key], *row(r)], None) if r.status == "ok"
            else ([labels[r.config.key], f"{r.status} (see below)"], "red") for r in results]
    return compact_table(title, ["config", *columns], rows, caption)


def stability_table(results: list[ConfigResult]) -> Table:
    """Per config: how it was warmed up, its first call, how much its measured iterations spread and whether
    anything disturbed them."""

    def row(result: ConfigResult) -> list[str]:
        warmup, total = result.warmup or {}, result.metric("total_ms")
        steady = {True: "", False: " (not steady)", None: ""}[warmup.get("steady")]
        return [f"{warmup.get('iterations', '-')}{steady}", fmt(warmup.get("first_call_ms")),
                f"{100 * total.spread:.0f}{result.spread_flag}", "yes" if result.disturbed else "no"]

    flagged = any(r.spread_flag for r in results if r.status == "ok")
    return config_table(results, "warm-up and noise", ["warm-up calls", "1st call ms", "spread %", "disturbed"], row,
                        caption="* spread (IQR/median) over 10%: see its warning below" if flagged else None)
