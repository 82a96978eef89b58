"""What every generation strategy provides (the protocol); what its last rollout did is a ``DecodeStats``
(``rollout/decode/stats.py``)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from opsd_rollout.rollout.decode.stats import DecodeStats
from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.workspace import KVWorkspace


class GenerationStrategy(Protocol):
    name: str
    workspace: KVWorkspace | None
    """What the strategy keeps between calls (its allocation is timed, its reuse reported), or ``None``."""

    def unsupported_reason(self, target: RolloutTarget) -> str | None:
        """Why this strategy cannot run ``target`` (the rollout then uses ``generate``), or ``None``."""
        ...

    def prepare(self, target: RolloutTarget) -> None:
        """Once, when the rollout is built, before any call."""
        ...

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan, recorder: Any, processor: Any = None, seed: int | None = None) -> torch.Tensor:
        """prompt_ids, prompt_mask: [N, P] left-padded; ``recorder`` records the phases it runs (compaction,
        compile, ...); ``processor``: a ``RowLogitsProcessor`` or ``None``; ``seed``: this call's own seed, or ``None``. Returns ``[N, P + R']``: the prompts exactly as given,
        then the generated tokens (``R' <= max_new_tokens``), in a tensor the caller may write into."""
        ...

    def release_workspace(self) -> None:
        """Free whatever the strategy keeps between calls."""
        ...

    @property
    def last_stats(self) -> DecodeStats:
        """What the last ``generate`` did."""
        ...

    @property
    def weight_layout_bytes(self) -> int | None:
        """Bytes of weight copies the strategy keeps between calls (``None``: it keeps none by design)."""
        ...

    def probe_points(self) -> list[tuple[Any, str, str]]:
        """``(object, method, attributed phase)`` a profiled rollout times (e.g. the workspace's allocation)."""
        ...
