"""A model's plain linear layers, and modules' forwards swapped for a block: what the CPU's weight layout
(``weight_layout.py``) and the one-row kernel (``row_kernel.py``) both do to a layer during a rollout's decode loop,
and what the fused loss does to the LM head for one call (``opsd/fused.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def plain_linear(module: torch.nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    """A plain ``nn.Linear`` (not a subclass: quantized or otherwise special layers keep their own forward) whose
    weight is a parameter (not one that a pre-hook rebuilds before each forward, as pruning and weight norm do: a
    forward of ours would miss the rebuild) and whole, on the CPU, in one of ``dtypes`` (a ZeRO-3 parameter not
    gathered has no elements here)."""
    if type(module) is not torch.nn.Linear or not isinstance(module._parameters.get("weight"), torch.nn.Parameter):
        return False
    weight = module.weight
    return (weight.device.type == "cpu" and weight.dtype in dtypes and weight.dim() == 2
            and weight.numel() == module.in_features * module.out_features)


@contextlib.contextmanager
def forwards_replaced(forwards: Iterable[tuple[torch.nn.Module, Callable[..., torch.Tensor]]], *,
                      over_others: bool = False) -> Iterator[None]:
    """Within the block each module's forward is the one given (only the instance's ``forward``: calls of the module
    run it inside every hook it has, ZeRO-3's gathers included). A module that has an instance forward already
    (someone else's) is left alone, or with ``over_others`` (where the block's result needs the given forward)
    replaced too; on leaving, every module has the forward it had back."""
    replaced: list[tuple[torch.nn.Module, Callable[..., Any] | None]] = []
    try:
        for module, forward in forwards:
            own = module.__dict__.get("forward")
            if own is not None and not over_others:
                continue
            module.forward = forward
            replaced.append((module, own))
        yield
    finally:
        for module, own in reversed(replaced):
            if own is None:
                del module.forward
            else:
                module.forward = own
