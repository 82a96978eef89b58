"""Decode matmuls on the CPU in the weight layout oneMKL multiplies fast.

``nn.Linear`` keeps its weight ``[out, in]`` and computes ``x @ weight.T``. On the CPU, for float32 and small
matrices, that transposed right operand sends oneMKL's GEMM down a slow path at a few dozen rows, the sizes of a
decode step: every linear layer of ``llama-small`` at 16 rows takes 25.5 ms with the weights as the model keeps
them and 11.2 ms with each weight stored ``[in, out]`` (torch 2.11 and 2.13 with oneMKL, an Intel Xeon; about
equal at 1-8 rows, the gain fading from 64 rows; bfloat16 gains nothing and float16 loses badly, so only float32
is changed; benchmarks/RESULTS.md, "The CPU's weight layout").

So on the CPU, a rollout of at least ``MIN_ROWS`` decode rows over a model of at most ``MAX_BYTES`` of float32
linear weights multiplies every such ``nn.Linear`` by an ``[in, out]`` copy of its weight (``F.linear`` over the
copy's transposed view: the same op, bias included, on the fast path). The copies are kept between calls (a
workspace, like the KV cache) and written again at the start of every call, because training changes the
weights between rollouts (an optimizer step, a LoRA merge, a ZeRO-3 gather: none of them reliably visible from
the tensor). Writing them costs a strided read of the weights (a profiled rollout times it as
``weight_layout_ms``: 36 ms for ``llama-small``, about one decode step at 16 rows).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F

from opsd_rollout.metrics import bytes_text
from opsd_rollout.rollout.gather import available_bytes
from opsd_rollout.rollout.linears import forwards_replaced, plain_linear

logger = logging.getLogger(__name__)

MIN_ROWS = 16
"""The fewest decode rows (slots) for which a rollout copies the weights: below it the two layouts multiply
about as fast (oneMKL's slow path starts between 12 and 16 rows) and the copy would not pay. Rows that finish
leave the batch; a rollout that started with enough keeps the copies to its end (no slower at fewer rows)."""
TILE = 128
"""Weight rows transposed per copy: a whole-matrix strided copy runs at half the speed (cache misses)."""
MAX_BYTES = 256 * 2**20
"""The most bytes of weights copied: a larger model keeps its layout. oneMKL's slow path is a matter of small
matrices (at 16 rows, 2.8-5.7x for every shape measured with 512 outputs or at most 512 inputs, 1.0-1.5x for
the larger ones), and a large model's step is bound by reading its weights: ``qwen2-0.5b`` (1.84 GiB of linear
weights) decodes no faster with the copies (0.99x at 16 rows, 1.10x at 32) and its copy costs 0.75 s a call,
where ``llama-small`` (90 MiB) is 1.66x faster at 16 rows for a 36 ms copy."""
MEMORY_SHARE = 0.5
"""The copies are skipped (with a warning) when they would take more than this share of the available RAM."""


def _linear(module: torch.nn.Linear, weight_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``module``'s forward over ``weight_t`` ([in, out]): ``x @ weight_t + bias``."""
    return F.linear(x, weight_t.t(), module.bias)


def _eligible(module: torch.nn.Module) -> bool:
    """A plain float32 ``nn.Linear`` on the CPU (``linears.plain_linear``)."""
    return plain_linear(module, (torch.float32,))


class TransposedLinears:
    """``[in, out]`` copies of a model's float32 ``nn.Linear`` weights, kept between calls, and the context in
    which the model's linear layers multiply by them."""

    def __init__(self) -> None:
        self._copies: dict[torch.nn.Module, torch.Tensor] = {}
        self._forwards: dict[torch.nn.Module, functools.partial] = {}
        """Each copied layer's forward, made once with its copy: a compiled step guards on the layers' forwards,
        so a new callable at every call would recompile it at every call."""
        self._warned = False

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold now (0 once released)."""
        return sum(copy.untyped_storage().nbytes() for copy in self._copies.values())

    def release(self) -> None:
        """Free the copies' memory. The copy tensors and the forwards over them stay (empty until the next
        ``refresh``): a compiled step guards on the forwards, and new ones would recompile it."""
        for copy in self._copies.values():
            copy.untyped_storage().resize_(0)

    def applies(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device, slots: int) -> bool:
        """Whether a rollout of ``slots`` decode rows of a ``dtype`` model on ``device`` uses the copies: a float32
        model on the CPU (a half-precision model's float32 LoRA adapters alone would not pay for their copies),
        from ``MIN_ROWS`` rows, with such layers, at most ``MAX_BYTES`` of them, whose copies fit
        ``MEMORY_SHARE`` of the RAM."""
        if device.type != "cpu" or dtype != torch.float32 or slots < MIN_ROWS:
            return False
        total = sum(m.weight.nbytes for m in model.modules() if _eligible(m))
        if not total or total > MAX_BYTES:
            return False
        needed = total - self.nbytes
        if needed > MEMORY_SHARE * available_bytes(device):
            if not self._warned:
                self._warned = True
                logger.warning("decoding with the model's own weight layout: transposed copies of its linear weights "
                               "(%s) would take more than half the available RAM", bytes_text(needed))
            return False
        return True

    def refresh(self, model: torch.nn.Module) -> None:
        """Write every eligible layer's weight into its copy, allocating copies for layers new (or reshaped)
        since the last call and dropping those of layers gone. A profiled rollout times it as ``weight_layout``."""
        copies, forwards = {}, {}
        for module in model.modules():
            if not _eligible(module):
                continue
            weight = module.weight.detach()
            copy, forward = self._copies.get(module), self._forwards.get(module)
            if copy is None or copy.shape != weight.t().shape:
                copy = torch.empty(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
                forward = functools.partial(_linear, module, copy)
            elif copy.untyped_storage().nbytes() == 0:  # released: the same tensor gets its memory back
                copy.untyped_storage().resize_(copy.numel() * copy.element_size())
            for start in range(0, weight.shape[0], TILE):  # [in, out] <- [out, in], a band of rows at a time
                copy[:, start:start + TILE].copy_(weight[start:start + TILE].t())
            copies[module], forwards[module] = copy, forward
        self._copies, self._forwards = copies, forwards

    def decoding(self) -> contextlib.AbstractContextManager:
        """Within the block (the whole decode loop: the prefills that admit prompts into it too, for which the two
        layouts multiply alike) each copied layer's forward multiplies by its copy (``linears.forwards_replaced``);
        on leaving, every layer has its own forward back."""
        return forwards_replaced(self._forwards.items())
