"""What every generation strategy provides (the protocol), and what its last rollout did (``DecodeStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.workspace import KVWorkspace


@dataclass
class DecodeStats:
    """What the last rollout's generation did, for the profile."""

    row_steps: int = 0
    """Row-steps computed: one per row for its first token (from its prefill), plus every row each decode
    forward computed (finished rows still in the batch included)."""
    compactions: int = 0
    admission_rounds: int = 0
    """Prefill rounds after the first (continuous batching)."""
    slots: int = 0
    """Rows the decode batch could hold (``continuous_batch_size``, or every row)."""
    forwards: int = 0
    decode_steps: int = 0
    """Decode forwards (one token per row in the batch)."""
    peak_active_rows: int = 0
    """The most rows decoding at once (admitted and not finished)."""
    cache_capacity: int | None = None
    """Key/value positions one row can span: its slot's columns, plus its prompt's in the prefix store."""
    cache_bytes: int | None = None
    """Bytes of this rollout's key/value cache: its slots, and the prefix store in the shared-prefix layout."""
    compacted_bytes: int = 0
    """Bytes of keys/values compactions moved (live rows to the front of the batch, their prompts in the store)."""
    compiled_graphs: int = 0
    """Graphs the compiled decode step compiled during this rollout (new shapes; 0 once every bucket was seen), and
    any compiled inside a decode step on a shape seen before (a failing guard, warned)."""
    kv_layout: str | None = None
    """``copied`` (each row's slot holds its prompt's keys/values) or ``shared_prefix`` (each prompt's once)."""
    weight_layout: str | None = None
    """``transposed`` (CPU: the linear layers multiplied by ``[in, out]`` copies of their weights) or ``model``."""
    finish_forward: torch.Tensor | None = None
    """[N] per request row, the index (among the rollout's forwards) of the forward that produced its last token;
    ``None`` when every row started at the first forward (its length then says it)."""


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
                 plan: RolloutPlan, recorder: Any, processor: Any = None) -> torch.Tensor:
        """prompt_ids, prompt_mask: [N, P] left-padded; ``recorder`` records the phases it runs (compaction,
        compile, ...); ``processor``: a ``RowLogitsProcessor`` or ``None``. Returns ``[N, P + R']``: the prompts exactly as given,
        then the generated tokens (``R' <= max_new_tokens``), in a tensor the caller may write into."""
        ...

    def release_workspace(self) -> None:
        """Free whatever the strategy keeps between calls."""
        ...

    @property
    def last_stats(self) -> DecodeStats:
        """What the last ``generate`` did."""
        ...

    def probe_points(self) -> list[tuple[Any, str, str]]:
        """``(object, method, attributed phase)`` a profiled rollout times (e.g. the workspace's allocation)."""
        ...
