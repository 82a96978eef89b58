"""Benchmark config files (TOML, JSON or YAML): axis lists and settings, by the same names as the flags
with dashes or underscores (``batch_sizes`` or ``batch-sizes``)."""

from __future__ import annotations

import json
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from opsd_rollout.bench.scenarios.base import Scenario


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"--config {str(path)!r}: cannot read it ({error.strerror})") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError("--config: YAML files need PyYAML (pip install pyyaml)") from None
            data = yaml.safe_load(text) or {}
        else:
            raise ValueError(f"--config {str(path)!r}: use a .toml, .json, .yaml or .yml file")
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - every parser has its own error type
        raise ValueError(f"--config {str(path)!r} does not parse: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {str(path)!r} must hold a table/object of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def split_config(data: dict[str, Any], scenario: type[Scenario]) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """``(axes, settings)`` of ``scenario`` from a config file's contents; unknown keys are an error naming them."""
    axis_names = {axis.name for axis in scenario.axes}
    setting_names = {f.name for f in fields(scenario.settings_type)}
    unknown = sorted(k for k in data if k not in axis_names and k not in setting_names)
    if unknown:
        raise ValueError(f"--config: unknown keys {unknown}; axes are {sorted(axis_names)}, settings are "
                         f"{sorted(setting_names)}")
    axes = {k: _as_list(v) for k, v in data.items() if k in axis_names}
    settings = {k: v for k, v in data.items() if k in setting_names}
    return axes, settings


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        return [part for part in value.split(",") if part.strip()]
    return [value]
