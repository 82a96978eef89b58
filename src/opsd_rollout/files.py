"""Files written whole or not at all: every result, metrics file and config this package writes goes through
``write_text_atomic``, so an interrupted run never leaves half a file; JSON as strict readers take it
(``json_safe``)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` as any JSON encoder or scalar logger takes it: NaN and infinities as ``None`` (JSON has no spelling
    for them; ``json.dumps`` would write ``NaN``, which strict readers refuse), a tensor or numpy scalar as a
    Python number, dicts, lists and tuples element by element."""
    if hasattr(value, "item"):  # a tensor or a numpy scalar (no Python number has .item)
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


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
    """``document`` as JSON (``json_safe``: NaN and infinities as null), written atomically."""
    write_text_atomic(path, json.dumps(json_safe(document), indent=1, allow_nan=False) + "\n")


def save_figure_atomic(figure, path: str | os.PathLike, **savefig: object) -> Path:
    """``figure.savefig(path, **savefig)`` written whole or not at all (a temporary file beside it, renamed over
    ``path``); the folder is made. The caller closes the figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        figure.savefig(tmp, **savefig)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
