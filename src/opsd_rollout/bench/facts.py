"""Roofline estimates from a model's facts (``ModelSpec``): the bytes a decode step must read and the FLOPs a
prefill must compute, against which measured times become utilisation figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # light module: the scenarios import it, and the command line reads them for its help
    from opsd_rollout.modeling import ModelSpec


def dtype_bytes(spec: ModelSpec) -> int:
    return spec.dtype.itemsize


def decode_bytes_per_step(spec: ModelSpec, rows: int, context: float, *, shared_prompts: int = 0,
                          prompt_length: int = 0) -> float:
    """Weights read once per step plus the KV cache of ``rows`` rows at ``context`` positions each; with
    ``shared_prompts`` (the shared-prefix layout) those prompts' ``prompt_length`` positions are read once each
    and ``context`` counts each row's own response positions only."""
    positions = rows * context + shared_prompts * prompt_length
    kv = spec.kv.bytes_per_token(dtype_bytes(spec)) * positions if spec.kv is not None else 0.0
    return spec.parameters * dtype_bytes(spec) + kv


def prefill_flops(spec: ModelSpec, rows: int, prompt_length: int) -> float:
    """Dense matmuls (2 FLOP per parameter per token) plus causal attention scores and values."""
    dense = 2 * spec.matmul_parameters * rows * prompt_length
    layers = spec.kv.layers if spec.kv is not None else 0
    attention = 2 * layers * (spec.hidden_size or 0) * rows * prompt_length**2
    return float(dense + attention)
