"""A model's plain linear layers, and their forwards swapped during a rollout's decode loop: what the CPU's weight
layout (``weight_layout.py``) and the one-row kernel (``row_kernel.py``) both do to a layer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

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
def forwards_replaced(forwards: Iterable[tuple[torch.nn.Module, Callable[..., torch.Tensor]]]) -> Iterator[None]:
    """Within the block each module's forward is the one given (only the instance's ``forward``: hooks run as
    before), except a module that has an instance forward already (someone else's: left alone); on leaving, every
    module has its own forward back."""
    replaced = []
    try:
        for module, forward in forwards:
            if "forward" in module.__dict__:
                continue
            module.forward = forward
            replaced.append(module)
        yield
    finally:
        for module in replaced:
            del module.forward
