"""The compiled one-token decode step: shapes bucketed so a training run compiles a bounded number of graphs,
and every graph counted, so running past torch's recompile limit (after which torch silently runs the step
eagerly for the rest of the process) is a warning, not a surprise."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)

LENGTH_BUCKET_MIN = 64
"""The smallest compiled cache length; lengths round up to powers of two from here."""


def bucket(value: int, minimum: int = 1) -> int:
    """The power of two at or above ``value`` (and ``minimum``)."""
    return max(minimum, 1 << max(0, value - 1).bit_length())


def recompile_limit() -> int:
    """How many graphs torch compiles for one function before it stops compiling and runs it eagerly."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


class CompiledStep:
    """``torch.compile(fn, **options)`` plus a count of the shapes it has been called with.

    torch keeps compiled graphs per code object, so every instance compiling the same function shares one
    budget of ``recompile_limit()`` graphs; the count is shared the same way (per process)."""

    _shapes: ClassVar[dict[Callable, set[Hashable]]] = {}

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]):
        self.fn = fn
        self._compiled = torch.compile(fn, **options)
        self._warned = False

    @property
    def graphs(self) -> int:
        """Distinct shapes this function has been compiled for in this process."""
        return len(self._shapes.get(self.fn, ()))

    def note_shape(self, key: Hashable) -> bool:
        """Record that the next calls use shape ``key``; True when it is new (a compile follows)."""
        seen = self._shapes.setdefault(self.fn, set())
        if key in seen:
            return False
        seen.add(key)
        if len(seen) > recompile_limit() and not self._warned:
            self._warned = True
            logger.warning("the compiled decode step has now been called with %d shapes, over torch's recompile "
                           "limit of %d: torch runs it eagerly for the rest of the process. Keep prompt + "
                           "max_new_tokens and the batch within fewer buckets (powers of two), or raise "
                           "torch._dynamo.config.recompile_limit.", len(seen), recompile_limit())
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)
