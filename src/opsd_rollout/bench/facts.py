"""Model facts for utilisation estimates, read before any wrapper (ZeRO-3 empties parameters)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opsd_rollout.modeling import KVShape


@dataclass(frozen=True)
class ModelFacts:
    parameters: int
    matmul_parameters: int
    """Parameters that take part in a matmul per token (all but the input embedding table)."""
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    vocab_size: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelFacts":
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
        shape = KVShape.of(config)
        layers, kv_heads, head_dim = shape.layers, shape.kv_heads, shape.head_dim
        parameters = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings()
        tied = embedding.weight is getattr(model.get_output_embeddings(), "weight", None)
        embedding_params = 0 if tied else embedding.weight.numel()
        dtype_bytes = next(model.parameters()).element_size()
        return cls(parameters, parameters - embedding_params, layers, hidden, kv_heads, head_dim, dtype_bytes,
                   int(config.vocab_size))

    def decode_bytes_per_step(self, rows: int, context: float) -> float:
        """Weights read once per step plus the KV cache of ``rows`` rows at ``context`` positions."""
        kv = 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes * rows * context
        return self.parameters * self.dtype_bytes + kv

    def prefill_flops(self, rows: int, prompt_length: int) -> float:
        """Dense matmuls (2 FLOP per parameter per token) plus causal attention scores and values."""
        dense = 2 * self.matmul_parameters * rows * prompt_length
        attention = 2 * self.layers * self.hidden * rows * prompt_length**2
        return float(dense + attention)
