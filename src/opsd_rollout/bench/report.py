"""The result document: JSON for machines (atomic writes, schema), tables for people. Both read the same
``ConfigResult`` objects."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from rich.table import Table

from opsd_rollout.bench.matrix import BenchConfig
from opsd_rollout.bench.stats import Stats, is_number

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "skipped", "pending")


@dataclass(kw_only=True)
class ConfigResult:
    """One config's outcome: raw per-iteration profiles and their summary."""

    config: BenchConfig
    status: str = "pending"
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
        """A ``Stats`` for every numeric profile field that was recorded."""
        names = dict.fromkeys(k for it in self.iterations for k, v in it.items() if is_number(v))
        out = {}
        for name in names:
            stats = self.metric(name)
            if stats is not None:
                out[name] = stats
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.config.key, "config": self.config.to_dict(), "status": self.status, "error": self.error,
                "iterations": self.iterations,
                "summary": {name: stats.to_dict() for name, stats in self.summary().items()},
                "derived": self.derived, "warnings": self.warnings, "per_rank": self.per_rank, "skew": self.skew}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConfigResult":
        return cls(config=BenchConfig(**data["config"]), status=data["status"], error=data.get("error"),
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


VARIANT_AXES = {"dtype": "", "decoding": "", "zero_stage": "zero", "strategy": "", "cache_policy": "",
                "forward_timing": "fwd "}


def display_labels(configs: list[BenchConfig]) -> dict[str, str]:
    """Short labels per config key, plus the values of whichever other axes vary across ``configs``."""
    varying = [axis for axis in VARIANT_AXES if len({getattr(c, axis) for c in configs}) > 1]

    def variant(config: BenchConfig) -> str:
        parts = []
        for axis in varying:
            value = getattr(config, axis)
            if axis == "forward_timing":
                value = "on" if value else "off"
            parts.append(f"{VARIANT_AXES[axis]}{value}")
        return (" " + "/".join(parts)) if parts else ""

    return {c.key: c.label + variant(c) for c in configs}


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


def load_document(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a result file; ``ValueError`` says what is wrong with it."""
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"result file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or document.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"result file {str(path)!r} is not an opsd-rollout result (schema_version "
                         f"{SCHEMA_VERSION} expected)")
    return document


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def results_table(results: list[ConfigResult], title: str) -> Table:
    """The final table: one row per config; stage columns are shares of the median iteration's total."""
    shares = {r.config.key: median_shares(r) for r in results if r.status == "ok"}
    stage_columns = [k for k in SHARE_LABELS if any(s.get(k, 0) >= 0.005 for s in shares.values())]
    noisy = any(r.metric("total_ms").noisy for r in results if r.status == "ok")
    table = Table(title=title, title_justify="left", caption_justify="left",
                  caption="* spread (IQR/median) over 10%: noisy" if noisy else None)
    for column in ("config", "TTFT ms", "TPOT ms", "tok/s p50", "total ms p50", "p95", "peak MiB"):
        table.add_column(column, justify="left" if column == "config" else "right")
    for key in stage_columns:
        table.add_column(SHARE_LABELS[key] + " %", justify="right")
    labels = display_labels([r.config for r in results])
    for result in results:
        label = labels[result.config.key]
        if result.status != "ok":
            table.add_row(label, f"{result.status}: {(result.error or '')[:70]}", style="red")
            continue
        s = result.summary()
        total, peak = s["total_ms"], s.get("peak_memory_bytes")
        row_shares = shares[result.config.key]
        table.add_row(label, _fmt(_p50(s, "ttft_ms"), 2), _fmt(_p50(s, "tpot_ms"), 2),
                      _fmt(_p50(s, "tokens_per_second")), _fmt(total.p50) + ("*" if total.noisy else ""),
                      _fmt(total.p95), _fmt(peak.p50 / 2**20 if peak else None, 0),
                      *[f"{100 * row_shares.get(k, 0.0):.0f}" for k in stage_columns])
    return table


STEP_PHASES = {"eval_ms": "eval", "rollout_ms": "rollout", "train_ms": "train", "teacher_forward_ms": "teacher",
               "cache_write_ms": "cache write", "student_forward_ms": "student", "loss_ms": "loss",
               "backward_ms": "backward", "optimizer_ms": "optim"}
STEP_COLUMNS = ("rollout_ms", "teacher_forward_ms", "cache_write_ms", "student_forward_ms", "loss_ms", "backward_ms",
                "optimizer_ms")


def step_table(results: list[ConfigResult], title: str) -> Table:
    """One row per step config: medians of each phase, the rollout's share and the loss."""
    table = Table(title=title, title_justify="left", caption="phases: median ms (eval/train switches in the JSON); "
                  "rollout share = (eval + rollout + train) / step", caption_justify="left")
    for column in ("config", "step ms", "p95", "rollout %", *[STEP_PHASES[k] for k in STEP_COLUMNS], "loss",
                   "peak MiB", "cache MiB"):
        table.add_column(column, justify="left" if column == "config" else "right")
    labels = display_labels([r.config for r in results])
    for result in results:
        if result.status != "ok":
            table.add_row(labels[result.config.key], f"{result.status}: {(result.error or '')[:70]}", style="red")
            continue
        s = result.summary()
        total = s["total_ms"]
        table.add_row(labels[result.config.key], _fmt(total.p50) + ("*" if total.noisy else ""), _fmt(total.p95),
                      f"{100 * s['rollout_share'].p50:.0f}", *[_fmt(_p50(s, k)) for k in STEP_COLUMNS],
                      _fmt(_p50(s, "loss"), 4), _fmt(_p50(s, "peak_memory_bytes") / 2**20, 0),
                      _fmt(_p50(s, "teacher_cache_bytes") / 2**20, 2))
    return table


def _p50(summary: dict[str, Stats], name: str) -> float | None:
    return summary[name].p50 if name in summary else None


SHARE_LABELS = {"prompt_expansion_ms": "expand", "prefill_ms": "prefill", "decode_ms": "decode",
                "generation_overhead_ms": "gen-other", "post_processing_ms": "post",
                "param_gather_ms": "gather", "inference_cache_ms": "cache", "lora_fuse_ms": "fuse",
                "lora_unfuse_ms": "unfuse", "gc_ms": "gc", "empty_cache_ms": "empty_cache",
                "workspace_alloc_ms": "alloc"}


def median_shares(result: ConfigResult) -> dict[str, float]:
    """Stage shares of the iteration whose total is the median one."""
    from opsd_rollout.profiling import RolloutProfile

    if not result.iterations:
        return {}
    ordered = sorted(result.iterations, key=lambda it: it["total_ms"])
    return RolloutProfile(**ordered[len(ordered) // 2]).stage_shares()


