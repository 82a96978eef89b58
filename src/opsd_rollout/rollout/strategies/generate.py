"""Strategy ``generate``: transformers' own ``generate``, with the call's sampling knobs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from opsd_rollout.rollout.decode.stats import DecodeStats
from opsd_rollout.rollout.processors import RowLogitsProcessor
from opsd_rollout.seeding import seeded
from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan

if TYPE_CHECKING:
    from opsd_rollout.rollout.workspace import KVWorkspace


class TransformersGenerate:
    """transformers' ``generate`` with the call's sampling knobs; rows stop at EOS and the batch stops when
    every row has. Under ZeRO-3 with several ranks, ``synced_gpus`` keeps ranks running the same number of
    forwards (a rank that is done keeps joining the parameter gathers) without padding its own output."""

    name = "generate"
    workspace: KVWorkspace | None = None
    """Always ``None``: generate keeps no workspace (typed as the strategies' interface names it)."""

    def __init__(self) -> None:
        self.last_stats = DecodeStats()

    def unsupported_reason(self, target: RolloutTarget) -> str | None:
        """generate runs every transformers causal LM."""
        return None

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan, recorder: Any = None, processor: RowLogitsProcessor | None = None,
                 seed: int | None = None) -> torch.Tensor:
        sampling = {} if plan.greedy else dict(temperature=plan.temperature, top_k=max(plan.top_k, 0),
                                                top_p=plan.top_p)
        # Only the knobs the rollout owns are set; other generation options (e.g. repetition_penalty) follow
        # the model's own generation_config, as with a plain model.generate().
        # generate() fills a None eos_token_id from the model's generation_config, so "never stop" is an id
        # that cannot be generated: one past the vocabulary
        never = [target.vocab_size if target.vocab_size is not None else 2**31 - 1]
        stop_ids = never if processor is not None and not processor.eos_stops else (list(plan.eos_token_ids) or never)
        config = GenerationConfig(max_new_tokens=plan.max_new_tokens, do_sample=not plan.greedy, num_beams=1,
                                  eos_token_id=stop_ids, pad_token_id=plan.pad_token_id, use_cache=True, **sampling)
        processors = LogitsProcessorList()
        if processor is not None:
            processor.start(prompt_ids, prompt_mask, plan.samples_per_prompt)
            transformers_processor = processor.as_logits_processor(prompt_mask, plan.samples_per_prompt)
            if transformers_processor is not None:
                processors.append(transformers_processor)
        with seeded(seed, prompt_ids.device):  # transformers samples from torch's generators, taking no seed
            sequences = target.generate_fn(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                                           synced_gpus=target.zero_stage == 3 and target.world_size > 1,
                                           logits_processor=processors)
        rows, steps = prompt_ids.shape[0], sequences.shape[1] - prompt_ids.shape[1]
        # every row is computed at every step until the last one finishes
        self.last_stats = DecodeStats(row_steps=rows * steps, slots=rows, forwards=steps, decode_steps=steps - 1,
                                      peak_active_rows=rows)
        return sequences

    def prepare(self, target: RolloutTarget) -> None:
        """generate needs nothing prepared."""

    def release_workspace(self) -> None:
        """generate keeps no workspace of its own between calls."""

    @property
    def weight_layout_bytes(self) -> None:
        """generate multiplies by the model's own weights."""
        return None

    def probe_points(self) -> list[tuple[Any, str, str]]:
        return []
