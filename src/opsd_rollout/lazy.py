"""Packages whose names load on first use (PEP 562): a package's ``__getattr__`` from ``lazy_exports``, so that
importing the package, or one light module of it, imports none of its heavy modules (torch, DeepSpeed) until a
name that needs them is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of the package whose ``globals()`` are ``namespace``: a name of ``exports`` is imported from
    its module (``exports[name]``: a module's full name, or one relative to the package, ``.clock``) when first asked
    for and kept in the package, so later lookups find it there; any other name is an ``AttributeError``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    return __getattr__
