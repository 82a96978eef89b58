"""Benchmark config files (TOML, JSON or YAML): axis lists and settings, by the same names as the flags
with dashes or underscores (``batch_sizes`` or ``batch-sizes``). A renamed flag's old name is still read, with a
line naming the new one (``RENAMED``)."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from opsd_rollout.bench.scenarios.base import Scenario

RENAMED: dict[str, dict[str, str]] = {
    "rollout": {"prompts": "prompt_kind"},
    "step": {"prompts": "prompt_kind", "loss": "losses", "beta": "betas", "teacher_cache": "teacher_caches"},
    "kernels": {"top_k": "top_ks", "top_p": "top_ps", "teacher_cache": "teacher_caches"},
}
"""Each benchmark kind's old names -> new, as flags (``--top-k`` -> ``--top-ks``) and config keys: a name has one
meaning and one type in every subcommand (``--prompts`` is ``train``'s prompt file; ``--top-k``, ``--beta``,
``--loss`` and ``--teacher-cache`` are one value, their plurals the lists a matrix sweeps)."""

FLAG_KEYS: dict[str, dict[str, str]] = {
    "rollout": {"prompt_kind": "prompts"},
    "step": {"prompt_kind": "prompts", "student": "model", "teacher_cache_budget": "teacher_cache_budget_bytes"},
}
"""Keys named after their flag whose setting has another name (the one result files hold): flag key -> setting."""


def renamed_note(old: str, new: str) -> str:
    """The line an old spelling gets: what to write instead."""
    return f"opsd-rollout: {old} is now {new} (the old spelling goes in a later release)"


def current_names(data: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """``data`` (a config file's keys, a result file's matrix) with ``kind``'s old names renamed to the new."""
    renamed = RENAMED.get(kind or "", {})
    both = [f"{old} and {renamed[old]}" for old in data if old in renamed and renamed[old] in data]
    if both:
        raise ValueError(f"{'; '.join(both)} are one name, old and new: keep the new one")
    return {renamed.get(key, key): value for key, value in data.items()}


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
    """``(axes, settings)`` of ``scenario`` from a config file's contents, settings by their field names; an old
    name is read as the new with a line on stderr saying so; unknown keys are an error naming them."""
    renamed, flag_keys = RENAMED.get(scenario.kind, {}), FLAG_KEYS.get(scenario.kind, {})
    old_keys = [key for key in data if key in renamed]
    data, given = current_names(data, scenario.kind), data
    for old in old_keys:
        value = json.dumps(given[old], default=str)
        print(renamed_note(f"{source}: {old} = {value}", f"{renamed[old]} = {value}"), file=sys.stderr)
    axis_names = {axis.name for axis in scenario.axes}
    setting_of = {**{f.name: f.name for f in fields(scenario.settings_type)}, **flag_keys}
    unknown = sorted(k for k in data if k not in axis_names and k not in setting_of)
    if unknown:
        shown = sorted((set(setting_of) - set(flag_keys.values()) - set(renamed)) | set(flag_keys))
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
