"""What the two losses fused with the student's LM head share: ``fused.py``'s divergences over the teacher's
distribution and ``sampled.py``'s sampled-token reverse KL both walk the trained tokens a chunk at a time, compute
each chunk's logits from the head, and form the gradients in the forward pass (so the [M, V] logits never exist).

``HeadOptions`` is what one such pass needs to know, ``HeadGrads`` the gradients it accumulates and hands to
``backward``, ``rows_on`` the copy of a chunk's rows of a teacher tensor that may live on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HeadOptions:
    """The settings of one chunked pass over the LM head, fixed for the whole pass (an autograd ``Function``
    takes them as one argument that needs no gradient)."""

    beta: float
    """The generalized JSD's interpolation (0 forward KL, 1 reverse KL); the sampled loss passes 1."""
    temperature: float
    clip: float | None
    """``DivergenceConfig.pointwise_clip``: each entry's divergence capped there, or ``None``."""
    scale: float
    """The model's logit scale (``modeling.logit_transform``), applied after the head."""
    cap: float | None
    """The model's logit soft cap, or ``None``."""
    chunk_tokens: int
    """Trained tokens per chunk (``fused.chunk_tokens``)."""
    dtype: torch.dtype
    """What the divergence computes in: float32, or float64 for a float64 head (as ``token_divergence``)."""
    tail: bool = False
    """A top-k cache's rest of the vocabulary as one tail bucket (``DivergenceConfig.top_k_rest="tail"``): the
    student's whole logits are computed, for its mass outside the teacher's k tokens."""


def rows_on(tensor: torch.Tensor, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor[tokens]`` on ``device``; a slice (no gather, one contiguous copy) when the tokens are a run, which
    they are for a chunk of a row without padding: the teacher cache's host copy then needs no staging."""
    first, last = int(tokens[0]), int(tokens[-1])
    part = tensor[first:last + 1] if last - first + 1 == tokens.numel() else tensor.index_select(0, tokens)
    return part.to(device, non_blocking=True)


@dataclass
class HeadGrads:
    """The gradients the forward pass accumulates (``None`` where not needed), in ``HeadOptions.dtype``: the pass
    knows them chunk by chunk, so ``backward`` only scales them by the incoming gradient."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def add_full(self, tokens: torch.Tensor, states: torch.Tensor, grad: torch.Tensor, coef: torch.Tensor,
                 weight: torch.Tensor) -> None:
        """A chunk's share over the whole vocabulary: ``grad`` dL/dz [c, V] per unit of ``coef`` [c], which
        scales the [c, H] factors (cheaper than a pass over [c, V])."""
        if self.hidden is not None:
            part = (grad.to(weight.dtype) @ weight).to(grad.dtype) * coef.unsqueeze(-1)  # [c, H]
            self.hidden.index_add_(0, tokens, part.to(self.hidden.dtype))
        if self.weight is not None:
            self.weight.addmm_(grad.t(), states.to(grad.dtype) * coef.unsqueeze(-1))
        if self.bias is not None:
            self.bias += coef @ grad

    @classmethod
    def needed(cls, ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> "HeadGrads":
        """Zeroed accumulators for the inputs (hidden, weight, bias) ``ctx`` needs gradients of."""
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        return cls(torch.zeros_like(hidden) if need_hidden else None,
                   torch.zeros(weight.shape, dtype=dtype, device=hidden.device) if need_weight else None,
                   torch.zeros(bias.shape, dtype=dtype, device=hidden.device) if need_bias else None)

    @property
    def any(self) -> bool:
        return any(g is not None for g in (self.hidden, self.weight, self.bias))

    def save(self, ctx: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keep the accumulated gradients for ``backward`` (with the dtypes they return in)."""
        ctx.save_for_backward(self.hidden, self.weight, self.bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def scaled(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``backward``: the saved gradients times the incoming one, in their inputs' dtypes."""
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = (grad_bias * grad_total).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias

    def add_top_k(self, tokens: torch.Tensor, states: torch.Tensor, grad: torch.Tensor, coef: torch.Tensor,
                  indices: torch.Tensor, rows: torch.Tensor) -> None:
        """A chunk's share over the teacher's k entries: ``grad`` [c, k], ``indices`` [c, k], the gathered head
        rows [c, k, H]; each entry's gradient goes back to its row of the head."""
        grad = grad * coef.unsqueeze(-1)
        if self.hidden is not None:
            part = torch.bmm(grad.to(rows.dtype).unsqueeze(1), rows).squeeze(1)  # [c, H]
            self.hidden.index_add_(0, tokens, part.to(self.hidden.dtype))
        if self.weight is not None:
            outer = grad.unsqueeze(-1) * states.to(grad.dtype).unsqueeze(1)  # [c, k, H]
            self.weight.index_add_(0, indices.flatten(), outer.flatten(0, 1))
        if self.bias is not None:
            self.bias.index_add_(0, indices.flatten(), grad.flatten())
