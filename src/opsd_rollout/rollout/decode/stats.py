"""``DecodeStats``: what one rollout's generation did, counted by the code that did it (the decode loop, a
strategy), for the profile and DeepSpeed's continuous-batching statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """``transposed`` (CPU: the linear layers multiplied by ``[in, out]`` copies of their weights), ``row_kernel``
    (CPU: one-row products by our kernel) or ``model``."""
    finish_forward: torch.Tensor | None = None
    """[N] per request row, the index (among the rollout's forwards) of the forward that produced its last token;
    ``None`` when every row started at the first forward (its length then says it)."""
    lengths: torch.Tensor | None = None
    """[N] per request row, its response's length (its first EOS included) when the decode loop stopped rows at
    their first EOS: what post-processing would search the tokens for, handed over instead, and every token after
    it is padding already. ``None`` when rows did not stop at EOS (a logits processor that ignores it) or the
    strategy does not know (``generate``)."""
