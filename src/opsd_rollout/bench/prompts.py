"""Synthetic prompts for benchmarks: exact-length, or variable-length left-padded."""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.rollout.base import RolloutRequest, SamplingConfig


def synthetic_prompts(batch_size: int, prompt_length: int, *, vocab_size: int, seed: int, low: int = 3,
                      pad_fraction: float = 0.0, pad_token_id: int = 0,
                      device: torch.device | str = "cpu") -> RolloutRequest:
    """Random token ids in ``[low, vocab_size)`` on ``device`` (drawn on the CPU: the same ids on every device); with
    ``pad_fraction > 0`` row lengths vary and on average that fraction of the ``[B, P]`` grid is left padding."""
    if not 0.0 <= pad_fraction < 1.0:
        raise ValueError(f"pad_fraction must be in [0, 1); got {pad_fraction!r}")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab_size, (batch_size, prompt_length), generator=generator)
    mask = torch.ones_like(ids)
    if pad_fraction > 0:
        # lengths uniform in [P * (1 - 2f), P], clipped to at least 1: mean padding is f of the grid
        shortest = max(1, round(prompt_length * (1 - 2 * pad_fraction)))
        lengths = torch.randint(shortest, prompt_length + 1, (batch_size, ), generator=generator)
        positions = torch.arange(prompt_length).unsqueeze(0)
        mask = (positions >= prompt_length - lengths.unsqueeze(1)).long()
        ids = ids.masked_fill(mask == 0, pad_token_id)
    return RolloutRequest(ids.to(device), mask.to(device))


def rollout_inputs(config: Any, settings: Any, tokenizer: Any, vocab_size: int, rank: int,
                   device: torch.device) -> tuple[RolloutRequest, SamplingConfig]:
    """The request and sampling config of one rollout config; each rank rolls out its own shard of prompts."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    request = synthetic_prompts(config.batch_size, config.prompt_length, vocab_size=vocab_size,
                                seed=settings.seed + 1000 * rank,
                                pad_fraction=settings.pad_fraction if settings.prompts == "variable" else 0.0,
                                pad_token_id=pad, device=device)
    greedy = config.decoding == "greedy"
    sampling = SamplingConfig(max_new_tokens=config.response_length, n_samples_per_prompt=config.samples_per_prompt,
                              temperature=0.0 if greedy else settings.temperature, top_k=settings.top_k,
                              top_p=settings.top_p,
                              continuous_batch_size=getattr(config, "continuous_batch_size", None))
    return request, sampling
