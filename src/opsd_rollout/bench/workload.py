"""A benchmark workload's response lengths, applied alike to every engine: the bench's own hook on each rollout.

``workload_processor(lengths, ...)`` gives the row logits processor (``rollout/processors.py``) for a
``LengthModel`` (``bench/lengths.py``): ``fixed`` runs every row to the cap (EOS does not stop a row),
``natural`` is the model's own EOS (no processor), a synthetic distribution is forced row by row
(``LengthForcing``). Its ``as_logits_processor`` is the same forcing inside transformers' ``generate`` (and so
DeepSpeed's rollout): the same coins on the same rows. ``WorkloadRollout`` hands the processor to every call of
a rollout, so code that calls ``generate(request, sampling)`` (the OPSD step) runs the workload unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from opsd_rollout.rollout.counter_rng import rollout_key, uniforms
from opsd_rollout.bench.lengths import LengthModel

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
    base[:1] = 1  # a slice is filled on the device; an element would be copied from the host
    return torch.cumprod(base, dim=0)  # int64 products wrap modulo 2**64


class FixedLengths:
    """Every row runs ``max_new_tokens`` steps: EOS ends no row (the batch is still cut at the first EOS)."""

    eos_stops = False

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples_per_prompt: int) -> None:
        pass

    def adjust(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return logits

    def observe(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        pass

    def as_logits_processor(self, prompt_mask: torch.Tensor, samples_per_prompt: int) -> Any:
        return None


class LengthForcing:
    """Forces ``model``'s lengths in our decode loop: ``adjust`` before each token, ``observe`` after it; state is
    per request row (``rows`` index it, the sink row included), set afresh by ``start`` at each call."""

    eos_stops = True

    def __init__(self, model: LengthModel, cap: int, eos_token_id: int, seed: int):
        self.model, self.cap, self.seed = model, cap, seed
        self.hazard = torch.tensor(model.hazards(cap), dtype=torch.float64)
        self.eos, self.key = eos_token_id, rollout_key(seed, LENGTH_SALT)

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples_per_prompt: int) -> None:
        """prompt_ids, prompt_mask: [N, P] expanded prompts (row ``i`` is sample ``i % n`` of its prompt); a
        sink row is added for finished slots."""
        self.hazard = self.hazard.to(prompt_ids.device)
        h, power = content_hash(prompt_ids, prompt_mask)
        h = h + sample_salt(prompt_ids.shape[0], samples_per_prompt, h.device)
        self.hash, self.power = torch.cat([h, h[:1]]), torch.cat([power, power[:1]])

    def adjust(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return force(logits, self.hash[rows], steps, self.hazard, self.eos, self.key)

    def observe(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.hash[rows] = self.hash[rows] + (tokens + 1) * self.power[rows]
        self.power[rows] = self.power[rows] * HASH_BASE

    def as_logits_processor(self, prompt_mask: torch.Tensor, samples_per_prompt: int) -> Any:
        return _HashedLengths(self.model, self.cap, self.eos, self.seed, prompt_mask, samples_per_prompt)


def force(logits: torch.Tensor, hashes: torch.Tensor, steps: torch.Tensor, hazard: torch.Tensor, eos: int,
          key: int) -> torch.Tensor:
    """logits [A, V] -> a copy where rows whose coin falls under the hazard can only emit EOS, and the others
    never can."""
    coin = uniforms(key, hashes, steps).squeeze(1)
    stop = coin.to(hazard.device) < hazard[steps.clamp(max=hazard.numel() - 1)]
    out = logits.masked_fill(stop[:, None], float("-inf"))  # fills on the device: nothing read back to the host
    out[:, eos] = torch.full_like(out[:, eos], float("-inf")).masked_fill_(stop, 0.0)
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


def workload_processor(lengths: LengthModel | str, max_new_tokens: int, eos_token_ids: tuple[int, ...] | list[int],
                       seed: int = 0) -> Any:
    """The row logits processor of a workload's response lengths, or ``None`` (``natural``: the model's EOS)."""
    lengths = LengthModel.parse(lengths) if isinstance(lengths, str) else lengths
    if lengths.kind == "fixed":
        return FixedLengths()
    if not lengths.synthetic:
        return None
    if not eos_token_ids:
        raise ValueError(f"response lengths {lengths.spec!r} force an EOS, but neither the tokenizer nor the model "
                         "has one")
    return LengthForcing(lengths, max_new_tokens, eos_token_ids[0], seed)


class WorkloadRollout:
    """A rollout engine whose every ``generate`` runs the workload's response lengths (``lengths``, a spec or a
    ``LengthModel``); everything else is the engine's own."""

    def __init__(self, rollout: Any, lengths: LengthModel | str, eos_token_ids: tuple[int, ...] | list[int],
                 seed: int = 0):
        self.rollout, self.eos_token_ids, self.seed = rollout, tuple(eos_token_ids), seed
        self.lengths = LengthModel.parse(lengths) if isinstance(lengths, str) else lengths

    def generate(self, request: Any, sampling: Any) -> Any:
        processor = workload_processor(self.lengths, sampling.max_new_tokens, self.eos_token_ids, self.seed)
        if processor is None:
            return self.rollout.generate(request, sampling)
        return self.rollout.generate(request, sampling, logits_processor=processor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rollout, name)


def workload_rollout(engine: Any, tokenizer: Any, lengths: LengthModel | str, **fields: Any) -> WorkloadRollout:
    """Our ``HybridEngineRollout`` on ``engine`` (its config from flat field and option names, see
    ``HybridEngineRolloutConfig.from_flat``), running the workload's ``lengths`` with the config's seed."""
    from opsd_rollout.rollout import HybridEngineRollout, HybridEngineRolloutConfig

    rollout = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig.from_flat(**fields))
    return WorkloadRollout(rollout, lengths, rollout.eos_token_ids, seed=rollout.cfg.seed or 0)
