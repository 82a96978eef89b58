"""Benchmark config files (TOML, JSON or YAML): axis lists and settings, by the same names as the flags
with dashes or underscores (``batch_sizes`` or ``batch-sizes``)."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from opsd_rollout.bench.scenarios.base import Scenario

FLAG_KEYS: dict[str, dict[str, str]] = {
    "rollout": {"prompt_kind": "prompts"},
    "step": {"prompt_kind": "prompts", "student": "model", "teacher_cache_budget": "teacher_cache_budget_bytes"},
}
"""Keys named after their flag whose setting has another name (the one result files hold): flag key -> setting."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's settings and axes, keys with underscores; every problem is one ``ValueError`` line naming
    the file (and, for a parse error, the line and column)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror})") from None
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ValueError(f"--config {path}: use a .toml, .json, .yaml or .yml file")
    try:
        data = _parse(text, suffix)
    except tomllib.TOMLDecodeError as error:  # "Unclosed array (at line 2, column 1)"
        where = re.search(r"\(at line (\d+), column (\d+)\)", str(error))
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(error))
        raise ValueError(f"--config {path}:{where[1]}:{where[2]}: {message}" if where
                         else f"--config {path}: {message}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--config {path}:{error.lineno}:{error.colno}: {error.msg}") from None
    except Exception as error:  # noqa: BLE001 - PyYAML's errors carry a mark: the place it stopped
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ValueError(f"--config {path}{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must hold a table of settings and axes, not {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _parse(text: str, suffix: str) -> Any:
    if suffix == ".toml":
        return tomllib.loads(text)
    if suffix == ".json":
        return json.loads(text)
    try:
        import yaml  # optional: YAML config files need PyYAML
    except ImportError:
        raise ValueError("--config: YAML files need PyYAML (pip install pyyaml)") from None
    return yaml.safe_load(text) or {}


def split_config(data: dict[str, Any], scenario: type[Scenario],
                 source: str = "--config") -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """``(axes, settings)`` of ``scenario`` from a config file's contents, settings by their field names; unknown
    keys are an error naming them."""
    flag_keys = FLAG_KEYS.get(scenario.kind, {})
    axis_names = {axis.name for axis in scenario.axes}
    setting_of = {**{f.name: f.name for f in fields(scenario.settings_type)}, **flag_keys}
    unknown = sorted(k for k in data if k not in axis_names and k not in setting_of)
    if unknown:
        shown = sorted((set(setting_of) - set(flag_keys.values())) | set(flag_keys))
        raise ValueError(f"{source}: unknown keys {unknown}; axes are {sorted(axis_names)}, settings are {shown}")
    splitters = {axis.name: axis.split for axis in scenario.axes}
    axes = {k: _as_list(v, splitters[k]) for k, v in data.items() if k in axis_names}
    settings = {setting_of[k]: v for k, v in data.items() if k in setting_of}
    return axes, settings


def _as_list(value: Any, split: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        return [part for part in split(value) if part.strip()]
    return [value]
