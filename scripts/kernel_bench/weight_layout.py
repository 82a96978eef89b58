"""``weight_layout``: ``nn.Linear`` multiplies by its weight stored ``[out, in]`` (``x @ W.T``); on some CPUs' BLAS
that transposed operand takes a slow path at a decode batch's row counts. One pass over every plain ``nn.Linear``
of the settings' model (``weight_shape`` ``model``), or over one random weight of ``K`` inputs and ``N`` outputs
(``KxN``), at ``rows`` rows of one token: over an ``[in, out]`` copy (``F.linear`` of its transposed view, what
``RolloutOptions(cpu_transposed_weights=True)`` multiplies by) against the weight as the model keeps it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_bench.contest import Contest
from opsd_rollout.models import parse_dtype


def layers_of(config: Any, built: Any, dtype: torch.dtype, device: torch.device,
              generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight [out, in], bias) of each layer in the pass."""
    if config.weight_shape != "model":
        inputs, outputs = (int(v) for v in config.weight_shape.split("x"))
        return [(torch.randn(outputs, inputs, generator=generator).to(device, dtype), None)]
    layers = [(m.weight.detach(), m.bias) for m in built.engine.modules() if type(m) is torch.nn.Linear]
    if not layers:
        raise ValueError(f"the model {type(built.engine).__name__} has no plain nn.Linear layer to multiply by")
    return layers


class WeightLayoutContest(Contest):
    def __init__(self, config: Any, settings: Any, built: Any, device: torch.device):
        super().__init__(device)
        self.repeats = settings.repeats
        dtype, generator = parse_dtype(config.dtype), torch.Generator().manual_seed(settings.seed)
        self.layers = layers_of(config, built, dtype, device, generator)
        self.copies = [weight.t().contiguous() for weight, _ in self.layers]  # [in, out] each
        self.inputs = [torch.randn(config.rows, 1, weight.shape[1], generator=generator).to(device, dtype)
                       for weight, _ in self.layers]  # [rows, 1, in] each
        self.dtype = dtype

    @torch.no_grad()
    def ours(self) -> list[torch.Tensor]:
        return [F.linear(x, copy.t(), bias) for (_, bias), copy, x in zip(self.layers, self.copies, self.inputs)]

    @torch.no_grad()
    def baseline(self) -> list[torch.Tensor]:
        return [F.linear(x, weight, bias) for (weight, bias), x in zip(self.layers, self.inputs)]

    def same(self, ours: Any, baseline: Any) -> bool:
        """Equal within the dtype's rounding (the two layouts sum in other orders)."""
        tolerance = 1e-4 if self.dtype == torch.float32 else 2e-2
        return all(torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance) for a, b in zip(ours, baseline))


def build(config: Any, settings: Any, built: Any, device: torch.device) -> WeightLayoutContest:
    return WeightLayoutContest(config, settings, built, device)
