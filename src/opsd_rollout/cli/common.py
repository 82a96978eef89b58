"""What every subcommand shares: the flags accepted before and after any subcommand (``-v``, the launcher's
``--local_rank``), the console tables print on, and DeepSpeed's CPU-fallback line hidden without ``-v``. Light: no
torch at import."""

from __future__ import annotations

import argparse
import logging
import os

from rich.console import Console

from opsd_rollout.placement import DTYPES, device_flag
from opsd_rollout.quiet import DEEPSPEED_LOGGER, CpuFallbackFilter

__all__ = ["CpuFallbackFilter", "add_placement_flags", "apply_local_rank", "common_flags", "console",
           "show_accelerator_fallback"]


def console() -> Console:
    """The width it is given: ``COLUMNS``, else the terminal's, else 80 (a file, a CI log); every table folds
    to fit it."""
    return Console()


LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
"""What the DeepSpeed launcher (and torch's older launcher) pass every rank: accepted, as DeepSpeed programs do."""


def common_flags() -> argparse.ArgumentParser:
    """The parent parser of the top level and of every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="also show what DeepSpeed and the package log (accelerator detection, op builds)")
    # the DeepSpeed launcher passes --local_rank=N before the subcommand; accepted there and after it, hidden.
    # SUPPRESS: a subcommand's default must not overwrite a value given before the subcommand.
    common.add_argument(*LOCAL_RANK_FLAGS, dest="local_rank", type=int, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    return common


def add_placement_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """``--dtype`` and ``--device``, with ``train``'s choices and defaults (``opsd_rollout.placement``)."""
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=f"{what}'s dtype (default auto: bf16 on a "
                        "GPU, fp32 on the CPU)")
    parser.add_argument("--device", type=device_flag, default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                        help=f"where {what} runs (default auto: a GPU when there is one, else the CPU)")


def apply_local_rank(local_rank: int | None) -> None:
    """``--local_rank=N`` from a launcher: the rank's device index. The environment's ``LOCAL_RANK`` (which
    torchrun and DeepSpeed's launcher also set) is what the run reads; the flag fills it in when absent."""
    if local_rank is None:
        return
    if local_rank < 0:
        raise ValueError(f"--local_rank must be >= 0; got {local_rank}")
    current = os.environ.get("LOCAL_RANK")
    if current is not None and current != str(local_rank):
        raise ValueError(f"--local_rank={local_rank} disagrees with LOCAL_RANK={current} in the environment")
    os.environ["LOCAL_RANK"] = str(local_rank)


def show_accelerator_fallback(verbose: bool) -> None:
    """With ``-v`` DeepSpeed's CPU-fallback warning shows; without, ``CpuFallbackFilter`` drops it. A filter on
    DeepSpeed's logger, installed before DeepSpeed is imported (no torch import here): DeepSpeed resets the
    logger's level when it creates it, but keeps its filters."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    installed = [f for f in logger.filters if isinstance(f, CpuFallbackFilter)]
    if verbose:
        for found in installed:
            logger.removeFilter(found)
    elif not installed:
        logger.addFilter(CpuFallbackFilter())
