"""Roofline estimates from a model's facts (``ModelSpec``): the bytes a decode step must read and the FLOPs a
prefill must compute, against which measured times become utilisation figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # light module: the scenarios import it, and the command line reads them for its help
    from opsd_rollout.modeling import ModelSpec


def dtype_bytes(spec: ModelSpec) -> int:
    return spec.dtype.itemsize


def decode_weight_bytes(spec: ModelSpec, rows: int) -> float:
    """The weights a decode step of ``rows`` rows reads at least: every matrix once (the LM head whole, tied to the
    input embedding or not), and of each lookup table (an untied input embedding, learned positions) one row per
    row of the batch."""
    return (spec.matmul_parameters + rows * spec.lookup_width) * dtype_bytes(spec)


def decode_bytes_per_step(spec: ModelSpec, rows: int, context: float, *, shared_prompts: int = 0,
                          prompt_length: int = 0) -> float:
    """The bytes a decode step must read: its weights (``decode_weight_bytes``) plus the KV cache of ``rows`` rows
    at ``context`` positions each; with ``shared_prompts`` (the shared-prefix layout) those prompts'
    ``prompt_length`` positions are read once each and ``context`` counts each row's own response positions only.
    A floor: activations, the logits and what a kernel reads twice are not counted."""
    positions = rows * context + shared_prompts * prompt_length
    kv = spec.kv.bytes_per_token(dtype_bytes(spec)) * positions if spec.kv is not None else 0.0
    return decode_weight_bytes(spec, rows) + kv


def roofline(bytes_per_step: float, ms_per_step: float, ceilings: dict | None) -> dict[str, float | None]:
    """A decode step's achieved memory traffic: ``decode_bytes_per_step`` (what it must read), that over its time
    (``decode_bandwidth_bytes_per_s``) and that over the machine's measured copy bandwidth
    (``decode_bandwidth_utilisation``, the share of the roofline: 1.0 is a step that reads its bytes as fast as a
    large copy moves bytes, its reads and writes counted)."""
    achieved = bytes_per_step / (ms_per_step / 1e3) if ms_per_step and ms_per_step > 0 else None
    ceiling = (ceilings or {}).get("memory_bandwidth_bytes_per_s")
    return {"decode_bytes_per_step": bytes_per_step, "decode_bandwidth_bytes_per_s": achieved,
            "decode_bandwidth_utilisation": achieved / ceiling if achieved is not None and ceiling else None}


def prefill_flops(spec: ModelSpec, rows: int, prompt_length: int) -> float:
    """Dense matmuls (2 FLOP per parameter per token) plus causal attention scores and values."""
    dense = 2 * spec.matmul_parameters * rows * prompt_length
    layers = spec.kv.layers if spec.kv is not None else 0
    attention = 2 * layers * (spec.hidden_size or 0) * rows * prompt_length**2
    return float(dense + attention)
