"""The student's side of the OPSD loss fused with its LM head: logits a chunk of response tokens at a time,
never whole, and their gradients computed in the same pass.

For the response tokens' final hidden states ``h`` [M, H] and the LM head ``W`` [V, H] (bias ``b``), each chunk of
trained tokens gets its logits ``z = h W^T + b`` (in the model's dtype, as the model's head computes them), the
model's own logit transform (scale, soft cap), then in float32 the divergence against the teacher cache's rows and
its gradient with respect to ``z``; two matmuls turn that into the chunk's share of dL/dh and dL/dW. Backward
only scales the stored gradients by the incoming one. Memory: one chunk's float32 intermediates and a float32
[V, H] gradient of ``W``, never [M, V]. Tokens with mask 0 (prompt, padding after EOS) are skipped, not computed.

With a top-k teacher cache renormalized (DeepSpeed's definition) both distributions live on the teacher's k
entries, so only those k student logits are computed: each token's k rows of ``W`` are gathered, c x k x H work
instead of c x V x H. With the tail bucket (``top_k_rest="tail"``) the student's mass outside the k entries needs
its whole logits: the divergence is over k + 1 buckets, and the tail bucket's gradient reaches each token outside
the k in proportion to its share of the tail (``_tail_chunk``).

The gradient of one token's divergence with respect to the student's log-probabilities ``lp`` (teacher ``lq``,
``p = exp(lp)``, ``q = exp(lq)``), entry by entry:

- forward KL, ``e = q (lq - lp)``: ``de/dlp = -q``;
- reverse KL, ``e = p (lp - lq)``: ``de/dlp = p (lp - lq + 1)``;
- generalized JSD, ``m = log(beta q + (1 - beta) p)``, ``e = beta q (lq - m) + (1 - beta) p (lp - m)``:
  ``de/dlp = (1 - beta) p (lp - m)`` (the terms through ``m`` cancel);
- ``pointwise_clip``: ``min(e, clip)`` passes the gradient where ``e <= clip``, as ``torch.clamp`` does;

then through ``log_softmax``: ``g_s = g - p * sum(g)``, and through the temperature and the transform to ``z``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from opsd_rollout.modeling import lm_head, logit_transform, model_config
from opsd_rollout.opsd.divergence import DivergenceConfig, TeacherLogits, student_tail_logp, tail_logp
from opsd_rollout.opsd.head_chunks import HeadGrads, HeadOptions, rows_on
from opsd_rollout.rollout.linears import forwards_replaced

CHUNK_BYTES = 32 << 20
"""Default size of one float32 intermediate of a chunk (see ``DivergenceConfig.fused_chunk_tokens``)."""

_TINY = torch.finfo(torch.float32).tiny  # the mixture's floor: log(0) would turn 0 * (-inf) into NaN


def _divergence_and_grad(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float,
                         clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[c, W] log-probabilities -> the per-token divergence [c] and its gradient [c, W] with respect to what the
    student's ``log_softmax`` took (its logits over the temperature), per unit of token weight. Overwrites
    ``teacher_logp``."""
    probs = student_logp.exp()
    if beta == 0.0:
        teacher_probs = teacher_logp.exp()
        entries = (teacher_logp - student_logp).mul_(teacher_probs)
        grad = teacher_probs.neg_()
    elif beta == 1.0:
        entries = (student_logp - teacher_logp).mul_(probs)
        grad = None  # p (lp - lq + 1) = entries + p, formed below once the clip has read the entries
    else:
        scaled_teacher = teacher_logp.exp().mul_(beta)  # beta q
        mixture = torch.add(scaled_teacher, probs, alpha=1.0 - beta).clamp_min_(_TINY).log_()  # m
        grad = (student_logp - mixture).mul_(probs).mul_(1.0 - beta)  # (1 - beta) p (lp - m)
        entries = teacher_logp.sub_(mixture).mul_(scaled_teacher)  # beta q (lq - m)
        del mixture, scaled_teacher
        if clip is None:  # the student's half of the divergence is the gradient's own sum
            grad_sum = grad.sum(-1, keepdim=True)
            per_token = entries.sum(-1) + grad_sum.squeeze(-1)
            return per_token, grad.addcmul_(probs, grad_sum, value=-1.0)
        entries.add_(grad)
    keep = None if clip is None else entries <= clip
    per_token = (entries if clip is None else entries.clamp(max=clip)).sum(-1)
    if grad is None:
        grad = entries.add_(probs)
    if keep is not None:
        grad.masked_fill_(~keep, 0.0)
    # through log_softmax: g - p * sum(g)
    return per_token, grad.addcmul_(probs, grad.sum(-1, keepdim=True), value=-1.0)


def _student_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    indices: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [c, H] -> logits [c, V] (``indices`` None) or at the teacher's entries [c, k], in the model's dtype,
    with the gathered head rows [c, k, H] the gradients reuse."""
    if indices is None:
        return F.linear(hidden, weight, bias), None
    rows = F.embedding(indices, weight)  # [c, k, H]
    logits = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)  # [c, k]
    return (logits if bias is None else logits + bias[indices]), rows


def _tail_chunk(student: torch.Tensor, teacher_logp: torch.Tensor, indices: torch.Tensor,
                options: HeadOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence over the teacher's k tokens and one tail bucket: student logits [c, V] (temperature 1),
    the teacher's k log-probabilities and token ids [c, k] -> the per-token divergence [c] and dL/dz [c, V].

    With ``g`` the gradient with respect to the k + 1 buckets' logits (``_divergence_and_grad``'s), a top-k
    token's logit gets its bucket's ``g``, and a token ``j`` outside the k gets ``g_tail * p_j / P_tail``: the
    tail's log-probability is ``logsumexp`` over those tokens minus the whole ``logsumexp``."""
    top, rest = student_tail_logp(student, indices)
    teacher_logp = torch.cat([teacher_logp, tail_logp(teacher_logp)], dim=-1)  # [c, k + 1]
    per_token, bucket_grad = _divergence_and_grad(torch.cat([top, rest], dim=-1), teacher_logp, options.beta,
                                                  options.clip)
    share = torch.softmax(student.scatter(-1, indices, float("-inf")), dim=-1)  # p_j / P_tail, 0 on the top-k
    grad = share.mul_(bucket_grad[:, -1:]).scatter_(-1, indices, bucket_grad[:, :-1])
    return per_token, grad


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher: torch.Tensor,
           indices: torch.Tensor | None, options: HeadOptions,
           need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk of c trained tokens: the divergence per token [c], dL/dz [c, W] per unit of token weight (in
    ``options.dtype``; ``None`` without ``need_grad``) and the gathered head rows (top-k renormalized; ``None``
    when ``W`` is the vocabulary)."""
    tail = options.tail and indices is not None and indices.shape[-1] < weight.shape[0]
    logits, rows = _student_logits(hidden, weight, bias, None if tail else indices)
    logits = logits.to(options.dtype)
    factor = options.scale / options.temperature
    squashed = None
    if options.cap:
        squashed = torch.tanh(logits.mul_(options.scale / options.cap))
        student = squashed * (options.cap / options.temperature)
    elif factor != 1.0:
        student = logits.mul_(factor)
    else:
        student = logits
    if tail:  # temperature 1 (DivergenceConfig checks it)
        assert indices is not None
        per_token, grad = _tail_chunk(student, teacher.to(options.dtype), indices, options)
        if not need_grad:
            return per_token, None, None
        if squashed is not None:
            grad.mul_(squashed.square_().neg_().add_(1.0))
        return per_token, grad, None
    student_logp = F.log_softmax(student, dim=-1)
    del student, logits
    teacher = teacher.to(options.dtype)
    teacher_logp = F.log_softmax(teacher if options.temperature == 1.0 else teacher / options.temperature, dim=-1)
    del teacher
    per_token, grad = _divergence_and_grad(student_logp, teacher_logp, options.beta, options.clip)
    if not need_grad:
        return per_token, None, rows
    if squashed is not None:  # d(cap tanh(scale z / cap))/dz = scale (1 - tanh^2)
        grad.mul_(squashed.square_().neg_().add_(1.0))
    return per_token, grad, rows


class FusedHeadDivergence(torch.autograd.Function):
    """``apply(hidden [M, H], weight [V, H], bias [V] | None, teacher_values [M, W], teacher_indices [M, W] | None,
    token_weights [M], options)`` -> the weighted divergence sum (float32; float64 for a float64 head). The
    teacher's tensors may stay on the host: each chunk's rows are copied to ``hidden``'s device."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                teacher_values: torch.Tensor, teacher_indices: torch.Tensor | None, token_weights: torch.Tensor,
                options: HeadOptions) -> torch.Tensor:
        device, dtype = hidden.device, options.dtype
        grads = HeadGrads.needed(ctx, hidden, weight, bias, dtype)
        need_grad = grads.any
        total = torch.zeros((), dtype=dtype, device=device)
        trained = token_weights.nonzero().squeeze(1)  # one host sync: which tokens to compute
        on_host = trained.to(teacher_values.device)
        for start in range(0, trained.numel(), options.chunk_tokens):
            tokens = trained[start:start + options.chunk_tokens]
            host_tokens = on_host[start:start + options.chunk_tokens]
            teacher = rows_on(teacher_values, host_tokens, device)
            indices = None if teacher_indices is None else rows_on(teacher_indices, host_tokens, device).long()
            states = hidden.index_select(0, tokens)  # [c, H]
            per_token, grad, rows = _chunk(states, weight, bias, teacher, indices, options, need_grad)
            coef = token_weights.index_select(0, tokens).to(dtype)  # each token's weight
            total += per_token @ coef
            if grad is not None:
                coef = coef * (options.scale / options.temperature)  # and the temperature's 1/T, the scale
                if rows is None:
                    grads.add_full(tokens, states, grad, coef, weight)
                else:
                    assert indices is not None  # rows are gathered for a top-k teacher only
                    grads.add_top_k(tokens, states, grad, coef, indices, rows)
        grads.save(ctx, weight, bias)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return *HeadGrads.scaled(ctx, grad_total), None, None, None, None


def chunk_tokens(config: DivergenceConfig, vocab: int, hidden_size: int, top_k: int | None) -> int:
    """Tokens per chunk: the config's, or as many as keep one float32 intermediate near ``CHUNK_BYTES``."""
    if config.fused_chunk_tokens is not None:
        return config.fused_chunk_tokens
    per_token = 4 * (vocab if top_k is None else top_k * hidden_size)
    return max(1, CHUNK_BYTES // per_token)


def fused_divergence(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher: TeacherLogits,
                     mask: torch.Tensor, config: DivergenceConfig, *, logit_scale: float = 1.0,
                     softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of the divergence over the response tokens, the student's logits computed here.

    hidden: [N, R, H] the student's final hidden states over the response window (what its LM head takes);
    weight: [V, H] and bias: [V] or ``None``, the LM head's (whole: under ZeRO-3 call this where they are
    gathered, e.g. through ``head_divergence``); teacher: the teacher's cache over the same window, logits
    [N, R, V] or a top-k pair (values [N, R, k], indices [N, R, k]), on any device (a ``TeacherCache``'s
    ``values``/``indices``); mask: [N, R], 0 where a position is not trained on, other values weigh the token.
    ``logit_scale``/``softcap``: the model's own transform of its logits (``modeling.logit_transform``).
    Returns ``(sum, count)`` as ``chunked_divergence`` does: the same values, and the same gradients with respect
    to ``hidden``, ``weight`` and ``bias``.
    """
    values, indices = teacher if isinstance(teacher, tuple) else (teacher, None)
    rows, window, size = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != size:
        raise ValueError(f"weight must be [V, {size}] for hidden states [N, R, {size}]; got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0], ):
        raise ValueError(f"bias must be [{weight.shape[0]}] (the LM head's vocabulary); got {tuple(bias.shape)}")
    width = weight.shape[0] if indices is None else values.shape[-1]
    if tuple(values.shape) != (rows, window, width) or (indices is not None and indices.shape != values.shape):
        expected = f"[{rows}, {window}, {weight.shape[0]}]" if indices is None else f"two [{rows}, {window}, k]"
        raise ValueError(f"teacher must be {expected} for hidden states {tuple(hidden.shape)}; got "
                         f"{[tuple(t.shape) for t in (values, indices) if t is not None]}")
    if tuple(mask.shape) != (rows, window):
        raise ValueError(f"mask must be [{rows}, {window}] like the hidden states; got {tuple(mask.shape)}")
    tail = config.top_k_rest == "tail" and indices is not None and width < weight.shape[0]
    options = HeadOptions(beta=config.effective_beta, temperature=config.temperature, clip=config.pointwise_clip,
                          scale=logit_scale, cap=softcap,
                          chunk_tokens=chunk_tokens(config, weight.shape[0], size,
                                                    None if indices is None or tail else width),
                          dtype=torch.promote_types(weight.dtype, torch.float32), tail=tail)
    weights = mask.reshape(-1).to(device=hidden.device, dtype=options.dtype)
    flat_indices = None if indices is None else indices.reshape(rows * window, width)
    total = FusedHeadDivergence.apply(hidden.reshape(rows * window, size), weight, bias,
                                      values.reshape(rows * window, width), flat_indices, weights, options)
    return total, weights.sum()


def fusion_problem(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot run on ``model`` (a transformers causal LM), or ``None``: it needs the final
    hidden states without the logits (``logits_to_keep``) and an LM head that is a plain ``nn.Linear``."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear:  # a subclass (LoRA, quantized) computes something else
        kind = type(head)  # qualified: PEFT's LoRA layer is also called Linear
        return (f"its LM head is {kind.__module__}.{kind.__qualname__}, not a plain torch.nn.Linear (a LoRA adapter on "
                "the head, a quantized layer)")
    try:
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return None if takes else f"{type(model).__name__}.forward takes no logits_to_keep"


def through_head(model: torch.nn.Module, hidden: torch.Tensor, mask: torch.Tensor,
                 loss: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss(states, weight, bias, scale, cap)`` with ``model``'s own LM head (weight, bias, logit transform),
    computed inside a call of the head module so that DeepSpeed gathers its weight as for any forward (ZeRO-3,
    tied embeddings included). Returns ``(the loss's sum, mask's sum)``. See ``fusion_problem`` for the models it
    takes."""
    problem = fusion_problem(model)
    if problem is not None:
        raise ValueError(f"the fused loss cannot use this model: {problem}; use DivergenceConfig(fused=False)")
    head = lm_head(model)
    scale, cap = logit_transform(model_config(model))
    # the head's hooks run around the loss: ZeRO-3 gathers its weight before the call and again before its backward
    with forwards_replaced([(head, lambda states: loss(states, head.weight, head.bias, scale, cap))], over_others=True):
        total = head(hidden)
    return total, mask.to(device=total.device, dtype=total.dtype).sum()


def head_divergence(model: torch.nn.Module, hidden: torch.Tensor, teacher: TeacherLogits, mask: torch.Tensor,
                    config: DivergenceConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_divergence`` with ``model``'s own LM head (``through_head``). ``model``: the transformers model
    (inside any DeepSpeed wrapper); the rest as for ``fused_divergence``."""
    return through_head(model, hidden, mask, lambda states, weight, bias, scale, cap: fused_divergence(
        states, weight, bias, teacher, mask, config, logit_scale=scale, softcap=cap)[0])
