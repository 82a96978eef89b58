"""Forcing a ``LengthModel``'s synthetic response lengths (see ``rollout/lengths.py``): in our decode loop
(``LengthForcing``) and in transformers' ``generate`` (``as_logits_processor``), the same coins on the same rows.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from opsd_rollout.rollout.counter_rng import rollout_key, uniforms
from opsd_rollout.rollout.lengths import LengthModel

HASH_BASE = 0x100000001B3  # FNV's 64-bit prime: content hashes are polynomials in it, modulo 2**64
LENGTH_SALT = 0x6C656E67  # a key apart from the sampling key of the same seed
SAMPLE_STRIDE = 0x2545F4914F6CDD1D  # a row's sample index within its prompt, mixed into its hash


def content_hash(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, mask: [N, T] -> (hash, next power) [N] int64: ``sum((token + 1) * BASE**i)`` over the real
    tokens (``i`` counts them), wrapping modulo 2**64; the next token adds ``(token + 1) * power``."""
    mask = mask.bool()
    index = mask.long().cumsum(dim=1) - 1
    powers = _powers(int(mask.shape[1]) + 1, tokens.device)
    terms = (tokens.long() + 1) * powers[index.clamp(min=0)]
    return (terms * mask).sum(dim=1), powers[mask.long().sum(dim=1)]


def sample_salt(rows: int, samples_per_prompt: int, device: torch.device) -> torch.Tensor:
    """[rows] int64: each row's sample index within its prompt, spread over 64 bits: the n samples of one prompt
    draw their lengths independently, also where their content is the same (greedy decoding)."""
    stride = SAMPLE_STRIDE - (1 << 64) if SAMPLE_STRIDE >= 1 << 63 else SAMPLE_STRIDE
    return (torch.arange(rows, device=device) % samples_per_prompt) * stride


def _powers(count: int, device: torch.device) -> torch.Tensor:
    base = torch.full((count,), HASH_BASE - (1 << 64) if HASH_BASE >= 1 << 63 else HASH_BASE, dtype=torch.int64,
                      device=device)
    base[0] = 1
    return torch.cumprod(base, dim=0)  # int64 products wrap modulo 2**64


class LengthForcing:
    """Forces ``model``'s lengths in our decode loop: ``adjust`` before each token, ``observe`` after it; state is
    per request row (``rows`` index it, the sink row included)."""

    def __init__(self, model: LengthModel, cap: int, eos_token_id: int, seed: int, device: torch.device):
        self.hazard = torch.tensor(model.hazards(cap), dtype=torch.float64, device=device)
        self.eos, self.key = eos_token_id, rollout_key(seed, LENGTH_SALT)

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples_per_prompt: int) -> None:
        """prompt_ids, prompt_mask: [N, P] expanded prompts (row ``i`` is sample ``i % n`` of its prompt); a
        sink row is added for finished slots."""
        h, power = content_hash(prompt_ids, prompt_mask)
        h = h + sample_salt(prompt_ids.shape[0], samples_per_prompt, h.device)
        self.hash, self.power = torch.cat([h, h[:1]]), torch.cat([power, power[:1]])

    def adjust(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return force(logits, self.hash[rows], steps, self.hazard, self.eos, self.key)

    def observe(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.hash[rows] = self.hash[rows] + (tokens + 1) * self.power[rows]
        self.power[rows] = self.power[rows] * _powers(2, tokens.device)[1]


def force(logits: torch.Tensor, hashes: torch.Tensor, steps: torch.Tensor, hazard: torch.Tensor, eos: int,
          key: int) -> torch.Tensor:
    """logits [A, V] -> a copy where rows whose coin falls under the hazard can only emit EOS, and the others
    never can."""
    coin = uniforms(key, hashes, steps).squeeze(1)
    stop = coin.to(hazard.device) < hazard[steps.clamp(max=hazard.numel() - 1)]
    out = logits.clone()
    out[:, eos] = float("-inf")
    out[stop] = float("-inf")
    out[stop, eos] = 0.0
    return out


class _HashedLengths(LogitsProcessor):
    """A transformers ``LogitsProcessor`` forcing the same lengths in ``generate`` (rows never reorder there):
    hashes each row's content from scratch at every step (prompt mask known, generated tokens all real)."""

    def __init__(self, model: LengthModel, cap: int, eos: int, seed: int, prompt_mask: torch.Tensor,
                 samples_per_prompt: int):
        self.hazard = torch.tensor(model.hazards(cap), dtype=torch.float64)
        self.eos, self.key, self.mask = eos, rollout_key(seed, LENGTH_SALT), prompt_mask
        self.salt = sample_salt(prompt_mask.shape[0], samples_per_prompt, prompt_mask.device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        prompt = self.mask.shape[1]
        generated = input_ids.shape[1] - prompt
        mask = torch.cat([self.mask.to(input_ids.device), self.mask.new_ones(input_ids.shape[0], generated)], dim=1)
        hashes, _ = content_hash(input_ids, mask)
        hashes = hashes + self.salt.to(hashes.device)
        steps = torch.full((input_ids.shape[0],), generated, dtype=torch.int64, device=input_ids.device)
        return force(scores, hashes, steps, self.hazard.to(scores.device), self.eos, self.key)


def as_logits_processor(model: LengthModel, cap: int, eos: int, seed: int, prompt_mask: torch.Tensor,
                        samples_per_prompt: int) -> Any:
    """The ``LogitsProcessor`` forcing ``model``'s lengths in ``generate`` for the expanded prompts with
    ``prompt_mask`` (rows in ``repeat_interleave`` order)."""
    return _HashedLengths(model, cap, eos, seed, prompt_mask, samples_per_prompt)
