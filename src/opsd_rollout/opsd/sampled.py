"""The sampled-token reverse KL (Thinking Machines' on-policy distillation, verl's k1/k3): the teacher's signal is
its log-probability of each token the student sampled, 4 bytes a token at any vocabulary.

For a sampled token ``y`` with the student's log-probability ``lp = log p_s(y)`` (with grad), the teacher's ``lq``,
``r = lp - lq``, and the rollout policy's ``lm`` (what sampled ``y``; on-policy, the student itself when it
sampled, ``rho = exp(lp - lm)`` is then 1), per token:

- ``k1`` (Tinker): the advantage ``-sg(r)`` (stop-gradient, discount 0: each token its own return) in an
  importance-sampled policy gradient, ``loss = sg(r) * rho``; ``d loss / d lp = sg(r) * rho``. Its value is the
  plain estimate of KL(student || teacher) and its gradient an unbiased estimate of the reverse KL's gradient
  (REINFORCE with the log-ratio as the cost).
- ``k3`` (verl's low-variance estimator): ``loss = sg(rho) * (exp(-r) - 1 + r)``, differentiated through ``lp`` as
  verl does; ``d loss / d lp = sg(rho) * (1 - exp(-r))``. Its value estimates the same reverse KL with a lower
  variance (never negative); its gradient's expectation is the forward KL's, KL(teacher || student): it moves the
  student toward the teacher too, by the other divergence. (Using k3 as a stop-gradient advantage instead would
  push the student away: E[k3 grad lp] is neither KL's gradient; a test checks all three by sampling.)

The student's ``lp`` comes from ``log_softmax`` of its logits at the token: over materialized logits
(``sampled_divergence``) or fused with its LM head a chunk of tokens at a time (``fused_sampled_divergence``), whose
gradient with respect to the logits ``z`` is ``d loss / d lp * (onehot(y) - softmax(z))``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from opsd_rollout.opsd.divergence import DivergenceConfig
from opsd_rollout.opsd.fused import chunk_tokens, through_head
from opsd_rollout.opsd.head_chunks import HeadGrads, HeadOptions, rows_on


def estimate(student_logp: torch.Tensor, teacher_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token estimate of KL(student || teacher) from the sampled tokens' log-probabilities (no grad)."""
    r = student_logp.detach() - teacher_logp
    return r if estimator == "k1" else torch.expm1(-r) + r


def token_loss(student_logp: torch.Tensor, teacher_logp: torch.Tensor, behaviour_logp: torch.Tensor | None,
               estimator: str) -> torch.Tensor:
    """[...] -> the loss per token (see the module docstring), its gradient through ``student_logp`` only;
    ``behaviour_logp`` ``None``: on-policy."""
    behaviour = student_logp.detach() if behaviour_logp is None else behaviour_logp.to(student_logp.dtype)
    if estimator == "k1":
        return estimate(student_logp, teacher_logp, "k1") * torch.exp(student_logp - behaviour)
    r = student_logp - teacher_logp
    return torch.exp(student_logp.detach() - behaviour) * (torch.expm1(-r) + r)


def token_loss_and_grad(student_logp: torch.Tensor, teacher_logp: torch.Tensor, behaviour_logp: torch.Tensor | None,
                        estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_loss``'s value and its derivative with respect to ``student_logp``, without autograd."""
    rho = 1.0 if behaviour_logp is None else torch.exp(student_logp - behaviour_logp)
    r = student_logp - teacher_logp
    if estimator == "k1":
        loss = r * rho
        return loss, loss
    return rho * (torch.expm1(-r) + r), -rho * torch.expm1(-r)


def sampled_divergence(student_logits: torch.Tensor, labels: torch.Tensor, teacher_logp: torch.Tensor,
                       mask: torch.Tensor, config: DivergenceConfig,
                       behaviour_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference over materialized logits: student_logits [N, R, V] (with grad), labels [N, R] the sampled
    tokens, teacher_logp and behaviour_logp [N, R] (on any device), mask [N, R]. Returns ``(sum, count)``."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    logp = F.log_softmax(student_logits.to(dtype), dim=-1).gather(-1, labels.unsqueeze(-1).long()).squeeze(-1)
    device = logp.device
    behaviour = None if behaviour_logp is None else behaviour_logp.to(device)
    loss = token_loss(logp, teacher_logp.to(device, dtype), behaviour, config.estimator)
    mask = mask.to(device, dtype)
    return (loss * mask).sum(), mask.sum()


class FusedSampledLoss(torch.autograd.Function):
    """``apply(hidden [M, H], weight [V, H], bias | None, labels [M], teacher_logp [M], behaviour_logp [M] | None,
    token_weights [M], options, estimator)`` -> the weighted loss sum; gradients formed in the forward pass."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, teacher_logp: torch.Tensor, behaviour_logp: torch.Tensor | None,
                token_weights: torch.Tensor, options: HeadOptions, estimator: str) -> torch.Tensor:
        device, dtype = hidden.device, options.dtype
        grads = HeadGrads.needed(ctx, hidden, weight, bias, dtype)
        total = torch.zeros((), dtype=dtype, device=device)
        trained = token_weights.nonzero().squeeze(1)  # one host sync: which tokens to compute
        on_host = trained.to(teacher_logp.device)
        for start in range(0, trained.numel(), options.chunk_tokens):
            tokens, host_tokens = trained[start:start + options.chunk_tokens], on_host[start:start + options.chunk_tokens]
            states = hidden.index_select(0, tokens)  # [c, H]
            logits = F.linear(states, weight, bias).to(dtype)  # [c, V]
            squashed = None
            if options.cap:
                squashed = torch.tanh(logits * (options.scale / options.cap))
                logits = squashed * options.cap
            elif options.scale != 1.0:
                logits = logits * options.scale
            probs = torch.softmax(logits, dim=-1)
            token = labels.index_select(0, tokens).long()
            logp = logits.gather(1, token[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)  # [c]
            teacher = rows_on(teacher_logp, host_tokens, device).to(dtype)
            behaviour = None if behaviour_logp is None else rows_on(behaviour_logp, host_tokens, device).to(dtype)
            loss, dlp = token_loss_and_grad(logp, teacher, behaviour, estimator)  # [c] each
            coef = token_weights.index_select(0, tokens).to(dtype)
            total += loss @ coef
            if grads.any:
                grad = probs.neg_().scatter_add_(1, token[:, None], torch.ones_like(logp)[:, None])  # onehot - p
                grad.mul_(dlp.unsqueeze(-1))
                if squashed is not None:  # d(cap tanh(scale z / cap))/dz = scale (1 - tanh^2)
                    grad.mul_(squashed.square_().neg_().add_(1.0))
                grads.add_full(tokens, states, grad, coef * options.scale, weight)
        grads.save(ctx, weight, bias)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor):
        return *HeadGrads.scaled(ctx, grad_total), None, None, None, None, None, None


def fused_sampled_divergence(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             labels: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                             config: DivergenceConfig, *, behaviour_logp: torch.Tensor | None = None,
                             logit_scale: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampled_divergence`` with the student's LM head computed here, a chunk of trained tokens at a time (no
    [N, R, V] logits): hidden [N, R, H], weight [V, H], bias [V] or ``None``, the rest [N, R]. Returns
    ``(sum, count)``: the same values and gradients."""
    rows, window, size = hidden.shape
    for name, tensor in (("labels", labels), ("teacher_logp", teacher_logp), ("mask", mask),
                         ("behaviour_logp", behaviour_logp)):
        if tensor is not None and tuple(tensor.shape) != (rows, window):
            raise ValueError(f"{name} must be [{rows}, {window}] like the hidden states; got {tuple(tensor.shape)}")
    options = HeadOptions(beta=1.0, temperature=1.0, clip=None, scale=logit_scale, cap=softcap,
                          chunk_tokens=chunk_tokens(config, weight.shape[0], size, None),
                          dtype=torch.promote_types(weight.dtype, torch.float32))
    weights = mask.reshape(-1).to(device=hidden.device, dtype=options.dtype)
    flat = [None if t is None else t.reshape(-1) for t in (labels.to(hidden.device), teacher_logp, behaviour_logp)]
    total = FusedSampledLoss.apply(hidden.reshape(rows * window, size), weight, bias, *flat, weights, options,
                                   config.estimator)
    return total, weights.sum()


def head_sampled_divergence(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                            teacher_logp: torch.Tensor, mask: torch.Tensor, config: DivergenceConfig,
                            behaviour_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_sampled_divergence`` with ``model``'s own LM head (``fused.through_head``: inside a call of the head
    module, so that ZeRO-3 gathers its weight)."""
    return through_head(model, hidden, mask, lambda states, weight, bias, scale, cap: fused_sampled_divergence(
        states, weight, bias, labels, teacher_logp, mask, config, behaviour_logp=behaviour_logp, logit_scale=scale,
        softcap=cap)[0])
