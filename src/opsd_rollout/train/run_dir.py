"""A training run's output directory: refused when it already holds another run (a run never writes over one
unasked), cleared first with ``overwrite``, and the directory a ``--resume`` continues into when none is named.
Light: no torch, so the command line refuses before any model loads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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
