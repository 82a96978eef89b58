"""``get_last_continuous_stats()``: DeepSpeed's cache statistics of a continuous-batching rollout, from our
engine's own figures.

DeepSpeed's continuous batching keeps one cache whose columns every slot shares, so finished rows leave dead
columns it trims (copies the live ones left). Our slots each own their columns and finished rows leave the batch
by row compaction, so the trim figures count compactions: ``trim_count`` the compactions, ``trim_bytes_moved``
the key/value bytes they copied, ``trim_latency_ms`` their time, and ``trimmed_columns`` is 0 (no slot ever holds
a dead column). docs/MIGRATING.md says the same for users.
"""

from __future__ import annotations

from typing import Any

import torch

from opsd_rollout.rollout.decode.stats import DecodeStats

KEYS = ("cache_capacity", "peak_cache_length", "cache_memory_bytes", "trim_count", "trimmed_columns",
        "trim_latency_ms", "decode_steps", "end_to_end_ms", "tokens_per_second", "trim_bytes_moved",
        "trim_frequency")
"""DeepSpeed 0.19.8's keys, in its order."""


def continuous_stats(decode: DecodeStats, lengths: torch.Tensor, prompt_length: int,
                     profile: Any = None) -> dict[str, Any]:
    """The statistics of one continuous-batching call under DeepSpeed's keys.

    ``lengths``: [N] each row's response length; ``profile``: the call's ``RolloutProfile``, or ``None`` when it
    was not profiled (then, as in DeepSpeed, the times and throughput are ``None``).
    """
    longest = int(lengths.max()) if lengths.numel() else 0
    steps = decode.decode_steps
    return {
        "cache_capacity": decode.cache_capacity,
        # the last token of a row is sampled, never fed back: the prompt plus the others were written
        "peak_cache_length": prompt_length + max(longest - 1, 0),
        "cache_memory_bytes": decode.cache_bytes,
        "trim_count": decode.compactions,
        "trimmed_columns": 0,
        "trim_latency_ms": None if profile is None else profile.compaction_ms or 0.0,
        "decode_steps": steps,
        "end_to_end_ms": None if profile is None else profile.total_ms,
        "tokens_per_second": None if profile is None else profile.tokens_per_second,
        "trim_bytes_moved": decode.compacted_bytes,
        "trim_frequency": decode.compactions / steps if steps else 0.0,
    }
