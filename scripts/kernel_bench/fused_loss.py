"""``fused_loss``: the OPSD loss forward + backward at a vocabulary size, from a student's final hidden states
``[rows, response, H]`` and its LM head ``[V, H]``: ours fused (the head and the divergence a chunk of tokens at a
time, gradients to the hidden states and the head) against DeepSpeed's ``generalized_jsd_loss`` over the logits
``[rows, response, V]`` materialized first (its backward reaches the logits only: it takes logits). The teacher's
cache is the full logits, or its top-k (ours reads the top-k pair; DeepSpeed takes the full logits and its own
``teacher_top_k``). Each side's peak memory is its own call's (``PeakMemory``: on CPU the process's peak RSS,
what the process held before the call included)."""

from __future__ import annotations

import math
from typing import Any

import torch

from kernel_bench.contest import Contest
from opsd_rollout.models import parse_dtype


class FusedLossContest(Contest):
    measure_memory = True

    def __init__(self, config: Any, settings: Any, device: torch.device):
        from opsd_rollout.opsd import DivergenceConfig

        super().__init__(device)
        dtype, g = parse_dtype(config.dtype), torch.Generator().manual_seed(settings.seed)
        rows, window, size, vocab = config.rows, config.response_length, settings.hidden_size, config.vocab_size
        self.hidden = torch.randn(rows, window, size, generator=g).to(device, dtype)  # [N, R, H]
        self.weight = (torch.randn(vocab, size, generator=g) / size**0.5).to(device, dtype)  # [V, H]
        self.teacher = (torch.randn(rows, window, vocab, generator=g) * 2).to(device, dtype)  # [N, R, V]
        self.top_k = int(config.teacher_cache[3:]) if config.teacher_cache.startswith("top") else None
        if self.top_k is None:
            self.cache: Any = self.teacher
        else:
            top = torch.topk(self.teacher, self.top_k, dim=-1)
            self.cache = (top.values, top.indices.int())  # [N, R, k] each
        self.mask = torch.ones(rows, window, dtype=torch.bool, device=device)
        self.config, self.beta = DivergenceConfig(loss="jsd", beta=settings.beta), settings.beta

    def ours(self) -> float:
        from opsd_rollout.opsd.fused import fused_divergence

        hidden, weight = self.hidden.clone().requires_grad_(), self.weight.clone().requires_grad_()
        total, count = fused_divergence(hidden, weight, None, self.cache, self.mask, self.config)
        loss = total / count
        loss.backward()
        return float(loss.detach())

    def baseline(self) -> float:
        from deepspeed.runtime.rollout import generalized_jsd_loss

        logits = (self.hidden @ self.weight.T).requires_grad_()  # what the student's forward would have made
        loss = generalized_jsd_loss(logits, self.teacher, self.mask, beta=self.beta, teacher_top_k=self.top_k).loss
        loss.backward()
        return float(loss.detach())

    def same(self, ours: float, baseline: float) -> bool:
        """The same loss (float32 sums in other orders: within 1e-4 relative; half precision within 1e-2)."""
        return math.isclose(ours, baseline, rel_tol=1e-4 if self.hidden.dtype == torch.float32 else 1e-2)


def build(config: Any, settings: Any, built: Any, device: torch.device) -> FusedLossContest:
    return FusedLossContest(config, settings, device)
