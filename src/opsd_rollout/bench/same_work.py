"""What ``compare`` may compare: two files that measured the same work. A faster AFTER that did less work says
nothing about the code, so every setting that changes the work must agree, and those that only change how it was
measured (``PROCEDURE``) may differ."""

from __future__ import annotations

from typing import Any

PROCEDURE = ("warmup", "warmup_max_iterations", "warmup_max_seconds", "steady_tolerance", "iterations", "processes",
             "interleave", "baseline")
"""Settings that change how a config is measured (or which contender its ratio is against), not the work measured:
the files may differ in them. Every other setting, one added later included, must agree."""


class MismatchError(ValueError):
    """BEFORE and AFTER measured different work (another model, other settings): their times say nothing
    about a change of code."""


def work_of(document: dict[str, Any], settings_type: type | None) -> dict[str, Any]:
    """What a file measured besides its configs' axes: the settings that change the work (those it lacks at
    their defaults, as ``--resume`` reads them; ``settings_type`` ``None``: as written) and the number of ranks."""
    settings = {**(vars(settings_type()) if settings_type else {}), **(document.get("settings") or {})}
    work = {name: value for name, value in settings.items() if name not in PROCEDURE}
    work["world_size"] = (document.get("environment") or {}).get("world_size", 1)
    return work


def check_same_work(before: dict[str, Any], after: dict[str, Any], settings_type: type | None,
                    ignore: tuple[str, ...]) -> list[str]:
    """Refuse files that measured different work (``MismatchError`` naming every setting, or the rank count, they
    disagree on); the differences ``ignore`` lets through come back as notes."""
    old, new = work_of(before, settings_type), work_of(after, settings_type)
    differences = {name: f"{name}: {old.get(name)!r} in BEFORE, {new.get(name)!r} in AFTER"
                   for name in dict.fromkeys([*old, *new]) if old.get(name) != new.get(name)}
    refused = [text for name, text in differences.items() if name not in ignore]
    if refused:
        names = ",".join(name for name in differences if name not in ignore)
        raise MismatchError("BEFORE and AFTER measured different work, so their times say nothing about a change:"
                            "\n  " + "\n  ".join(refused) + f"\n(--ignore-axes {names} compares them anyway)")
    return [f"{text}: compared anyway (--ignore-axes)" for name, text in differences.items() if name in ignore]


def matrix_notes(before: dict[str, Any], after: dict[str, Any], axes: list[tuple[str, str]],
                 ignore: tuple[str, ...]) -> list[str]:
    """The axes (each its matrix name and config field) whose values the two files' matrices disagree on: why
    configs are only in one of them."""
    old, new = before.get("matrix") or {}, after.get("matrix") or {}
    return [f"matrix: {name} {old.get(name)} in BEFORE, {new.get(name)} in AFTER"
            for name, field_name in axes if field_name not in ignore and old.get(name) != new.get(name)]
