"""Where models run and in what precision: the ``--device`` and ``--dtype`` of ``train``, ``eval`` and
``serve-teacher`` (the same choices and defaults in all three), resolved once, and a teacher put where its student
runs. Light at import (torch loads inside the functions that need it), so the parsers check a value at once.

``auto`` means: the accelerator when there is one (CUDA), else the CPU; bf16 on a GPU, fp32 on the CPU (the CPU
computes bf16 slower than fp32, and a GPU's tensor cores want it).
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "fp32", "bf16", "fp16")
"""``--dtype``'s choices."""
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
"""``--device``'s spellings: ``auto``, ``cpu``, ``cuda`` (this rank's GPU) or ``cuda:N``."""


def device_choice(value: str, name: str = "device") -> str:
    """A device's name checked: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not isinstance(value, str) or not DEVICE.fullmatch(value):
        raise ValueError(f"{name} must be auto, cpu, cuda or cuda:N; got {value!r}")
    return value


def device_flag(value: str) -> str:
    """``--device``'s argparse ``type``: ``device_choice``, said under the flag's name."""
    try:
        return device_choice(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N; got {value!r}") from None


def dtype_choice(value: str, name: str = "dtype") -> str:
    """A dtype's name checked: one of ``DTYPES``."""
    if value not in DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}; got {value!r}")
    return value


def resolve_device(value: str) -> str:
    """The device ``value`` names on this machine: ``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``; a CUDA
    device on a machine without one is refused in one line."""
    import torch

    device_choice(value)
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(value.partition(":")[2] or 0)
        if index >= count:
            raise ValueError(f"--device {value}: this machine has {count or 'no'} CUDA device{'s' * (count != 1)}"
                             f"{'' if count else '; use --device cpu (or auto)'}")
    return value


def resolve_dtype(value: str, device_type: str) -> str:
    """The dtype ``value`` names for a model on ``device_type`` (``cuda``, ``cpu``): ``auto`` is bf16 on a GPU,
    fp32 on the CPU."""
    dtype_choice(value)
    if value != "auto":
        return value
    return "bf16" if device_type != "cpu" else "fp32"


def place(module: Any, device: torch.device | str, dtype: torch.dtype) -> Any:
    """``module`` on ``device`` in ``dtype`` (its floating-point parameters and buffers; integer buffers keep
    theirs), returned: where a teacher goes to score beside its student."""
    return module.to(device=device, dtype=dtype)


def engine_placement(engine: Any) -> tuple[torch.device, torch.dtype]:
    """Where a DeepSpeed engine's model runs and in what dtype: its device, and its parameters' dtype (what its
    config's bf16/fp16 section made them; under ZeRO-3 each partition's)."""
    import torch

    return torch.device(engine.device), next(engine.module.parameters()).dtype
