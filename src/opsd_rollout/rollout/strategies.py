"""Generation strategies: each turns expanded prompts into generated tokens ``[N, R']``.

A strategy only generates; expansion, EOS trimming and masks are the engine's, so every strategy gets
the same output contract for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan

if TYPE_CHECKING:
    from opsd_rollout.rollout.config import HybridEngineRolloutConfig


class GenerationStrategy(Protocol):
    name: str

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan) -> torch.Tensor:
        """prompt_ids, prompt_mask: [N, P] left-padded. Returns ``[N, P + R']``: the prompts exactly as given,
        then the generated tokens (``R' <= max_new_tokens``), in a tensor the caller may write into."""
        ...

    def release_workspace(self) -> None:
        """Free whatever the strategy keeps between calls."""
        ...


class TransformersGenerate:
    """transformers' ``generate`` with the call's sampling knobs; rows stop at EOS and the batch stops when
    every row has. Under ZeRO-3 with several ranks, ``synced_gpus`` keeps ranks running the same number of
    forwards (a rank that is done keeps joining the parameter gathers) without padding its own output."""

    name = "generate"

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan) -> torch.Tensor:
        from transformers import GenerationConfig

        sampling = {} if plan.greedy else dict(temperature=plan.temperature, top_k=max(plan.top_k, 0),
                                                top_p=plan.top_p)
        # Only the knobs the rollout owns are set; other generation options (e.g. repetition_penalty) follow
        # the model's own generation_config, as with a plain model.generate().
        # generate() fills a None eos_token_id from the model's generation_config, so "never stop" is an id
        # that cannot be generated: one past the vocabulary
        never = [target.vocab_size if target.vocab_size is not None else 2**31 - 1]
        stop_ids = never if plan.ignore_eos else (list(plan.eos_token_ids) or never)
        config = GenerationConfig(max_new_tokens=plan.max_new_tokens, do_sample=not plan.greedy, num_beams=1,
                                  eos_token_id=stop_ids, pad_token_id=plan.pad_token_id, use_cache=True, **sampling)
        return target.generate_fn(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                                  synced_gpus=target.zero_stage == 3 and target.world_size > 1)


    def release_workspace(self) -> None:
        """generate keeps no workspace of its own between calls."""


def make_strategy(cfg: "HybridEngineRolloutConfig") -> GenerationStrategy:
    """The strategy ``cfg.strategy`` names, configured from ``cfg``."""
    from opsd_rollout.rollout.static import StaticDecode

    if cfg.strategy == StaticDecode.name:
        return StaticDecode(shared_prefill=cfg.shared_prefill, stop_check_interval=cfg.stop_check_interval,
                            seed=cfg.seed, compile_decode=cfg.compile_decode,
                            static_shapes=cfg.static_shapes)
    if cfg.strategy == TransformersGenerate.name:
        return TransformersGenerate()
    raise ValueError(f"unknown strategy {cfg.strategy!r}")
