"""One-row products on the CPU by our own kernel, split across the cores (opt-in: ``options.cpu_row_kernel``).

At batch 1 a decode step multiplies one row by every weight of the model, so reading the weights is the whole
cost, and the step can go no faster than the memory streams them. oneMKL's one-row product on the AMD EPYC this
project measures on reads float32 weights at about half the speed a plain sum reads memory, on one core however many
it is given (the LM head of ``qwen2-0.5b``, [151936, 896]: 11-13 GB/s on one thread or two, where ``torch.sum`` reads
23 GB/s on one and 32 on two), and bfloat16 slower still (benchmarks/RESULTS.md, issue 38).

The kernel (``row_kernel.cpp``) computes each output as one sequential read of its weight row, summed in float32 (a
bfloat16 weight widened on the fly), the output rows split across torch's intra-op threads. It is built on first use
with the machine's own instruction set (``torch.utils.cpp_extension``: a C++ compiler and ninja; torch caches the
build), and called through a custom op (``opsd_rollout::row_linear``), so a compiled decode step calls it as one
node. Its sums run in another order than oneMKL's: the same products up to float32 rounding, which can turn a greedy
near-tie. A machine that cannot build it decodes as before, with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from opsd_rollout.rollout.linears import forwards_replaced, plain_linear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_kernel.cpp")
DTYPES = (torch.float32, torch.bfloat16)
"""The weight dtypes the kernel multiplies."""

_built: dict[str, object] = {}


def _extension() -> object:
    """The compiled kernel (built once a process, from the cache after the first build); raises why it cannot be."""
    if "module" not in _built:
        if "error" in _built:
            raise RuntimeError(_built["error"])
        try:
            from torch.utils.cpp_extension import load

            _built["module"] = load("opsd_rollout_row_kernel", [str(SOURCE)],
                                    extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
        except Exception as error:  # noqa: BLE001 - a compiler, ninja or headers missing: said once, decoding goes on
            _built["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            raise RuntimeError(_built["error"]) from error
    return _built["module"]


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (built on the first call), or ``None``."""
    try:
        _extension()
    except RuntimeError as error:
        return str(error)
    return None


@torch.library.custom_op("opsd_rollout::row_linear", mutates_args=())
def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` (``in`` elements) times ``weight`` [out, in] (float32 or bfloat16, contiguous, CPU): ``[out]`` in ``x``'s
    dtype, summed in float32."""
    return _extension().row_linear(x, weight)


@row_linear.register_fake
def _row_linear_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(weight.shape[0])


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module``'s forward: one row (a decode step at batch 1) by the kernel, anything else (and anything autograd
    records: the kernel has no backward) by ``F.linear``."""
    weight = module.weight
    if (x.numel() != module.in_features or x.dtype != weight.dtype or not weight.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, module.bias)
    y = torch.ops.opsd_rollout.row_linear(x, weight)
    if module.bias is not None:
        y = y + module.bias
    return y.view(*x.shape[:-1], module.out_features)


def _eligible(module: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` on the CPU in a dtype the kernel multiplies (``linears.plain_linear``)."""
    return plain_linear(module, DTYPES)


class RowKernelLinears:
    """The context in which a model's linear layers multiply one row by the kernel."""

    def __init__(self) -> None:
        self._forwards: dict[torch.nn.Module, functools.partial] = {}
        """Each layer's forward, made once: a compiled step guards on the layers' forwards, so a new callable at
        every call would recompile it at every call."""
        self._warned = False

    def applies(self, model: torch.nn.Module, device: torch.device) -> bool:
        """Whether a rollout on ``device`` uses the kernel: the CPU, a layer it can multiply, and a kernel that
        builds here (else one warning, and the model's own forwards)."""
        if device.type != "cpu" or not any(_eligible(m) for m in model.modules()):
            return False
        reason = unavailable_reason()
        if reason is not None:
            if not self._warned:
                self._warned = True
                logger.warning("options.cpu_row_kernel: the kernel cannot be built here (%s); decoding with the "
                               "model's own linear layers", reason)
            return False
        return True

    def decoding(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Within the block every eligible layer's forward sends one row to the kernel
        (``linears.forwards_replaced``); on leaving, every layer has its own forward back."""
        forwards = [(module, self._forwards.setdefault(module, functools.partial(_forward, module)))
                    for module in model.modules() if _eligible(module)]
        return forwards_replaced(forwards)
