"""A training run's output directory: refused when it already holds another run (a run never writes over one
unasked), cleared first with ``overwrite``, and the directory a ``--resume`` continues into when none is named.
Light: no torch, so the command line refuses before any model loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

HOLDS_A_RUN = ("metrics.jsonl", "checkpoints", "train_config.json")
"""What marks a directory as holding a run: any of them."""
WRITTEN = (*HOLDS_A_RUN, "model", "model.tmp", "merged", "merged.tmp", "best", "best.tmp", "eval.png")
"""Everything a run writes in its directory: what ``overwrite`` removes (nothing else there is touched)."""


def resumed_output_dir(resume: str | os.PathLike) -> str:
    """The output directory of the run ``resume`` names: itself, or the run around it when it names the run's
    ``checkpoints/``."""
    path = Path(resume)
    return str(path.parent if path.name == "checkpoints" else path)


def check_output_dir(output_dir: str | os.PathLike, *, resume: str | os.PathLike | None, overwrite: bool) -> None:
    """Refuses (one line, before any model loads) an output directory that is a file or lies under one, and one
    that holds a run (``HOLDS_A_RUN``) unless the run continues it (``resume`` names it) or ``overwrite`` asks to
    start over; ``overwrite`` with ``resume`` of that same run is a contradiction."""
    path = Path(output_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == path else f"lies under {str(existing)!r}, a file"
        raise ValueError(f"--output-dir {str(path)!r} {where}: name a directory (it is made if missing)")
    held = [name for name in HOLDS_A_RUN if (path / name).exists()]
    continued = resume is not None and _same(resumed_output_dir(resume), path)
    if continued and overwrite:
        raise ValueError(f"--overwrite would remove the run --resume {str(resume)!r} continues: drop one of them")
    if held and not continued and not overwrite:
        raise ValueError(f"--output-dir {str(path)!r} holds a run ({', '.join(held)}): continue it with --resume "
                         f"{path}, or start over with --overwrite (which removes that run first)")


RESUMED_AS_SAVED = {"student": "--student", "prompts": "--prompts", "task": "--task", "objective": "--objective"}
"""What a run is, by ``train_config.json``'s names -> their flags: a resume that names other values (a served
teacher's address, the steps, the output directory may change) continues another run than the one saved."""


def check_resumed_run(resume: str | os.PathLike, values: Any) -> None:
    """Refuses (one line, before any model loads) a ``resume`` whose run, as its ``train_config.json`` says, is not
    the one ``values`` describe (a ``TrainConfig``, or ``RESUMED_AS_SAVED``'s names -> values; a missing name or file
    is not checked): ``train --resume DIR`` without the flags that started the run would otherwise be the built-in
    run, continued from another model's checkpoint."""
    if not isinstance(values, dict):
        values = {name: getattr(values, name) for name in RESUMED_AS_SAVED}
    saved_file = Path(resumed_output_dir(resume)) / "train_config.json"
    if not saved_file.is_file():
        return
    try:
        saved = json.loads(saved_file.read_text())
    except ValueError:  # not this package's file: nothing to compare with
        return
    if not isinstance(saved, dict):
        return
    differ = [f"{flag} {_spelled(saved.get(name))} there, {_spelled(values.get(name))} here"
              for name, flag in RESUMED_AS_SAVED.items()
              if name in saved and name in values and not _same_value(saved[name], values[name])]
    if differ:
        raise ValueError(f"--resume {str(resume)!r} continues another run than these flags describe "
                         f"({'; '.join(differ)}): give the flags that started it, as the command a stopped run "
                         "prints does")


def _spelled(value: Any) -> str:
    return "none" if value is None else repr(value)


def _same_value(a: Any, b: Any) -> bool:
    """Equal, or two names of one existing file or directory (``p.jsonl`` and ``./p.jsonl``)."""
    return a == b or (isinstance(a, str) and isinstance(b, str) and Path(a).exists() and _same(a, b))


def clear_run(output_dir: str | os.PathLike) -> list[str]:
    """Removes what a run wrote in ``output_dir`` (``WRITTEN``), so a new run starts clean, not mixed with the old
    one; returns the names removed."""
    path, removed = Path(output_dir), []
    for name in WRITTEN:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _same(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return Path(a).resolve() == Path(b).resolve()
