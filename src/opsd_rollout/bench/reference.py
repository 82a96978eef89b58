"""A fixed reference workload, timed beside every iteration of every config: how fast the machine ran at that moment.

Two runs of the same code on a shared VM can differ by 10-20% in every process, with no steal, no other process and
no load to show for it (issue 52's pair 6: a neighbour on the host contending for cache or memory bandwidth for
minutes). A guard that reads the processes alone cannot tell that from a regression. This workload never changes
with the code under test (plain torch ops, none of this package's) and does the same kind of work as a small model's
decode step (small matmuls, a norm, attention over a short cache, an LM head and a softmax, each op dispatched from
Python), so the machine's slowdown shows in its time as it does in the config's (further, measured: ``bench/pace.py``).
``compare`` reads each process's reference beside its metrics: a note on how far the machine moved, and with
``--pace adjusted`` the times adjusted for it.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from opsd_rollout.bench.pace import REFERENCE_METRIC
from opsd_rollout.bench.timing import timed

HIDDEN, FFN, VOCAB, BATCH, CACHE, STEPS, LAYERS = 256, 1024, 4096, 4, 64, 4, 2
"""The workload's shape: ``STEPS`` decode steps of a ``LAYERS``-layer model of width ``HIDDEN`` over a batch of
``BATCH``, a ``CACHE``-token cache, a ``VOCAB``-token head. Fixed: a reference that changed would read as the machine
moving."""
CALLS = 3
"""Calls timed beside each iteration, their median recorded: a few milliseconds each on 2 CPU cores, so a single slow
call (a page fault, a timer tick) does not speak for the iteration."""
WARMUP_CALLS = 3
"""Calls a process makes before the first it times (the allocator's first blocks, the ops' first dispatch)."""


def without_reference(row: dict[str, Any]) -> dict[str, Any]:
    """An iteration's profile fields: ``row`` without the reference's time, which the runner records beside them."""
    return {name: value for name, value in row.items() if name != REFERENCE_METRIC}


class ReferenceWorkload:
    """The reference's weights, made once a process from a fixed seed (its own generator: the run's random state is
    untouched) and warmed up; ``run()`` times it."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(0)

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) / shape[0] ** 0.5).to(self.device)

        self.layers = [(weight(HIDDEN, 3 * HIDDEN), weight(HIDDEN, HIDDEN), weight(HIDDEN, FFN), weight(FFN, HIDDEN))
                       for _ in range(LAYERS)]
        self.head = weight(HIDDEN, VOCAB)
        self.cache = [(weight(BATCH, CACHE, HIDDEN), weight(BATCH, CACHE, HIDDEN)) for _ in range(LAYERS)]
        self.start = weight(BATCH, HIDDEN)
        for _ in range(WARMUP_CALLS):
            self.call()

    @torch.inference_mode()
    def call(self) -> torch.Tensor:
        """``STEPS`` decode steps; the last step's sampled ids ``[BATCH]``."""
        x = self.start  # [B, H]
        ids = torch.zeros(BATCH, dtype=torch.long, device=self.device)
        for _ in range(STEPS):
            h = x
            for (qkv, out, up, down), (keys, values) in zip(self.layers, self.cache):
                q, k, v = (h @ qkv).split(HIDDEN, dim=-1)  # [B, H] each
                scores = torch.cat([keys @ q.unsqueeze(-1), (k * q).sum(-1, keepdim=True).unsqueeze(1)], dim=1)
                weights = torch.softmax(scores.squeeze(-1) / HIDDEN ** 0.5, dim=-1)  # [B, C + 1]
                attended = (weights[:, :-1].unsqueeze(-1) * values).sum(1) + weights[:, -1:] * v
                h = torch.nn.functional.layer_norm(h + attended @ out, (HIDDEN,))
                h = torch.nn.functional.layer_norm(h + torch.nn.functional.gelu(h @ up) @ down, (HIDDEN,))
            probabilities = torch.softmax(h @ self.head, dim=-1)  # [B, V]
            ids = probabilities.argmax(-1)
            x = h
        return ids

    def run(self, calls: int = CALLS) -> float:
        """The median wall-clock ms of ``calls`` calls (the device synchronized before and after each)."""
        return statistics.median(timed(self.call, self.device)[0] for _ in range(calls))
