"""Row logits processors: a hook on the logits of every token a rollout samples, keyed by request row.

transformers' ``LogitsProcessor`` sees the batch in its own order; our decode loop moves rows between slots
(continuous batching, compaction), so its processors are told which request row and which step each logits row
is. A processor changes nothing unless a caller hands one to ``HybridEngineRollout.generate``; the benchmark's
synthetic response lengths are one (``bench/workload.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class RowLogitsProcessor(Protocol):
    eos_stops: bool
    """Whether an EOS ends a row (``False``: every row runs ``max_new_tokens`` steps; the batch is still cut at
    the first EOS)."""

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples_per_prompt: int) -> None:
        """Before the first token: the expanded prompts ``[N, P]`` (row ``i`` is sample ``i % n`` of its prompt)."""
        ...

    def adjust(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """logits [A, V] of request rows ``rows`` [A] at their steps ``steps`` [A] -> the logits to sample from.
        ``rows`` may hold ``N``, one past the last request row: a finished slot, whose token is thrown away."""
        ...

    def observe(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens [A] request rows ``rows`` [A] emitted."""
        ...

    def as_logits_processor(self, prompt_mask: torch.Tensor, samples_per_prompt: int) -> Any:
        """The same processing as a transformers ``LogitsProcessor`` for ``generate`` (rows in request order),
        or ``None`` when there is nothing to do there."""
        ...
