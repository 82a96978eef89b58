"""What the package keeps quiet unless asked, from the command line (``-v`` shows it) and from the library alike:
DeepSpeed's "Setting accelerator to CPU" line (logged the first time DeepSpeed is imported on a machine without a
GPU: nothing a user can act on) and transformers' progress bars while checkpoints load and save (a run's own
progress line says enough). Through the libraries' own settings, each scoped to a ``with`` block and put back as it
was after it: nothing of the process is left changed. Light: logging alone at import."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

DEEPSPEED_LOGGER = "DeepSpeed"
"""The logger DeepSpeed logs through (``deepspeed.utils.logging``); it prints to stdout itself."""


class CpuFallbackFilter(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." (``real_accelerator.py``, logged on
    every first ``get_accelerator()`` of a machine without one); DeepSpeed's other messages pass. DeepSpeed resets its
    logger's level when it creates it, but keeps its filters: one installed before DeepSpeed is imported works."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU")


@contextlib.contextmanager
def cpu_fallback_hidden() -> Iterator[None]:
    """DeepSpeed's CPU-fallback line dropped inside the block (unless a filter of ours already drops it)."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    added = None
    if not any(isinstance(f, CpuFallbackFilter) for f in logger.filters):
        added = CpuFallbackFilter()
        logger.addFilter(added)
    try:
        yield
    finally:
        if added is not None:
            logger.removeFilter(added)


@contextlib.contextmanager
def progress_bars_hidden() -> Iterator[None]:
    """transformers' progress bars (loading and saving checkpoints) off inside the block, then as they were."""
    from transformers.utils import logging as transformers_logging

    was = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            transformers_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet(verbose: bool = False) -> Iterator[None]:
    """Both of the above inside the block, unless ``verbose``."""
    if verbose:
        yield
        return
    with cpu_fallback_hidden(), progress_bars_hidden():
        yield
