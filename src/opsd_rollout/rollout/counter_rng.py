"""Random numbers that do not depend on scheduling: row ``r``'s uniform at step ``s`` of a rollout is a hash of
``(seed, call, r, s)`` computed on the device (splitmix64 in int64 arithmetic, no state, no host
synchronization). Batch composition, slot assignment and compaction therefore never change a sampled token;
only the row's index in the request, its step and the seed do.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
ROW_STRIDE, STEP_STRIDE = 0xD1B54A32D192ED03, 0xAEF17502108EF2D9  # odd constants: rows and steps spread apart


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def splitmix64(value: int) -> int:
    """splitmix64's finalizer on a Python int (the host-side half: seed and call into one key)."""
    z = (value + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def rollout_key(seed: int, call: int) -> int:
    """One 64-bit key per (seed, call): the same seed gives a repeatable sequence of calls, each different."""
    return splitmix64(splitmix64(seed & MASK64) ^ (call & MASK64))


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = z + _signed(GOLDEN)
    z = (z ^ _shift(z, 30)) * _signed(MIX1)  # int64 multiplication wraps modulo 2**64
    z = (z ^ _shift(z, 27)) * _signed(MIX2)
    return z ^ _shift(z, 31)


def uniforms(key: int, rows: torch.Tensor, steps: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """rows, steps: [N] int64 (a row's index in the request, its step) -> [N, 1] uniforms in [0, 1) of
    ``dtype`` (53 random bits in float64, 24 in float32)."""
    z = _mix(rows.to(torch.int64) * _signed(ROW_STRIDE) + steps.to(torch.int64) * _signed(STEP_STRIDE) + _signed(key))
    bits = 53 if dtype == torch.float64 else 24
    return (_shift(z, 64 - bits).to(dtype) * 2.0**-bits).unsqueeze(1)
