"""``sampling``: one decode step's token selection at a vocabulary size, ours against what ``generate`` runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from kernel_bench.contest import Contest
from opsd_rollout.models import parse_dtype
from opsd_rollout.rollout.sampling import precise_dtype, sample


def transformers_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                        generator: torch.Generator) -> torch.Tensor:
    """logits [N, V] -> tokens [N]: what ``generate(do_sample=True)`` does at each step (the warpers, softmax,
    ``multinomial``); top-k <= 0 and top-p 1 leave their warper out, as ``generate`` does."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


class SamplingContest(Contest):
    """Random logits ``[rows, vocab]`` (scaled by 3: a peaked distribution, as a model's), in ``dtype``: bf16
    logits tie often at the k-th, which both sides keep."""

    def __init__(self, config: Any, settings: Any, device: torch.device):
        super().__init__(device)
        self.repeats = settings.repeats
        generator = torch.Generator().manual_seed(settings.seed)
        logits = torch.randn(config.rows, config.vocab_size, generator=generator) * 3
        self.logits = logits.to(parse_dtype(config.dtype)).to(device)  # [rows, V]
        self.uniform = torch.rand(config.rows, 1, generator=generator, dtype=torch.float64)
        self.uniform = self.uniform.to(precise_dtype(device)).to(device)  # [rows, 1]: each row's draw
        self.plan = SimpleNamespace(greedy=False, temperature=settings.temperature, top_k=config.top_k,
                                    top_p=config.top_p)
        self.greedy = SimpleNamespace(greedy=True)
        self.generator = torch.Generator(device).manual_seed(settings.seed)
        self.settings, self.config = settings, config

    def ours(self) -> torch.Tensor:
        return sample(self.logits, self.plan, self.uniform)

    def baseline(self) -> torch.Tensor:
        c = self.config
        return transformers_sample(self.logits.float(), self.settings.temperature, c.top_k, c.top_p, self.generator)

    def extras(self) -> dict[str, Any]:
        return {"greedy": lambda: sample(self.logits, self.greedy, None)}


def build(config: Any, settings: Any, built: Any, device: torch.device) -> SamplingContest:
    return SamplingContest(config, settings, device)
