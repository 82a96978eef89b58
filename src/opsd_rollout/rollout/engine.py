"""``HybridEngineRollout``: DeepSpeed's rollout interface over our engine, with opt-in profiling."""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

from opsd_rollout.models import dtype_name
from opsd_rollout.profiling import NULL_RECORDER, Clock, PeakMemory, RolloutProfile, StageRecorder
from opsd_rollout.rollout import postprocess
from opsd_rollout.rollout.config import HybridEngineRolloutConfig
from opsd_rollout.rollout.strategies import make_strategy
from opsd_rollout.rollout.target import resolve_target
from opsd_rollout.rollout.validation import RolloutPlan, plan_rollout


class HybridEngineRollout(RolloutEngine):
    """Drop-in for ``deepspeed.runtime.rollout.HybridEngineRollout``.

    Args:
        engine: a DeepSpeed engine (ZeRO 0-3, hybrid engine on or off) or a transformers causal LM.
        tokenizer: anything with ``pad_token_id`` and ``eos_token_id``.
        cfg: a :class:`HybridEngineRolloutConfig` (DeepSpeed's config objects are accepted too).
    """

    name = "opsd_rollout"

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = HybridEngineRolloutConfig.from_any(cfg)
        self.target = resolve_target(engine)
        self.strategy = make_strategy(self.cfg.strategy)
        self._last_profile: RolloutProfile | None = None
        self._clock = Clock(self.target.device)
        self._closed = False

    @property
    def enable_profiling(self) -> bool:
        return self.cfg.enable_profiling

    def get_last_profile(self) -> RolloutProfile | None:
        """The last call's profile; ``None`` before the first profiled call and after a call that raised."""
        return self._last_profile

    def sync_weights(self, step: int) -> None:  # noqa: ARG002 - interface
        """No-op: the rollout generates with the training engine's own weights."""

    def shutdown(self) -> None:
        self._closed = True
        self._last_profile = None

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Roll out ``sampling.n_samples_per_prompt`` responses per prompt; see DESIGN.md's batch contract."""
        self._last_profile = None
        if self._closed:
            raise RuntimeError("generate() called after shutdown()")
        plan = plan_rollout(request, sampling, self.target, self.tokenizer)
        prompt_ids = request.prompt_ids.to(self.target.device)
        prompt_mask = request.prompt_attention_mask.to(self.target.device)
        if not self.cfg.enable_profiling:
            return self._rollout(prompt_ids, prompt_mask, plan, NULL_RECORDER)[0]

        memory = PeakMemory(self.target.device)
        memory.start()
        recorder = StageRecorder(self._clock)
        with recorder.stage("total"):
            batch, lengths = self._rollout(prompt_ids, prompt_mask, plan, recorder)
        self._last_profile = self._profile(recorder, memory, plan, batch, lengths)
        return batch

    def _rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, plan: RolloutPlan,
                 recorder: Any) -> tuple[RolloutBatch, torch.Tensor]:
        with recorder.stage("prompt_expansion"):
            ids, mask = postprocess.expand_prompts(prompt_ids, prompt_mask, plan.samples_per_prompt)
        with recorder.stage("generation"), recorder.forwards(self.target.forward_module):
            sequences = self.strategy.generate(self.target, ids, mask, plan)  # [N, P + R']
        with recorder.stage("post_processing"):
            P = plan.prompt_length
            eos = torch.tensor(plan.eos_token_ids, dtype=sequences.dtype, device=sequences.device)
            lengths = postprocess.response_lengths(sequences[:, P:], eos)
            width = int(lengths.max())  # R: the longest response
            input_ids = postprocess.finalize_input_ids(sequences, P, lengths, width, plan.pad_token_id)
            with recorder.stage("attention_mask"):
                attention_mask = postprocess.build_attention_mask(mask, lengths, width)
            start = torch.full((ids.shape[0], ), P, dtype=torch.int64, device=ids.device)
            batch = RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, response_start_idx=start)
        return batch, lengths

    def _profile(self, recorder: StageRecorder, memory: PeakMemory, plan: RolloutPlan, batch: RolloutBatch,
                 lengths: torch.Tensor) -> RolloutProfile:
        stages = recorder.stage_ms()
        forwards = recorder.forward_times()
        prefill = [f.ms for f in forwards if f.phase == "prefill"]
        decode = [f.ms for f in forwards if f.phase == "decode"]
        peak_bytes, peak_source = memory.stop()
        rows, response_length = plan.effective_batch_size, batch.seq_len - plan.prompt_length
        generated = int(lengths.sum())
        total_ms, decode_ms = stages["total"], sum(decode)
        return RolloutProfile(
            prompt_expansion_ms=stages["prompt_expansion"], generation_ms=stages["generation"],
            prefill_ms=sum(prefill), decode_ms=decode_ms, decode_steps=len(decode), prefill_forwards=len(prefill),
            post_processing_ms=stages["post_processing"], attention_mask_ms=stages["attention_mask"],
            total_ms=total_ms,
            generated_tokens=generated, padded_tokens=rows * response_length - generated,
            tokens_per_second=generated / (total_ms / 1e3) if total_ms > 0 else 0.0,
            decode_tokens_per_second=(generated - rows) / (decode_ms / 1e3) if decode_ms > 0 else 0.0,
            peak_memory_bytes=peak_bytes, peak_memory_source=peak_source,
            batch_size=plan.batch_size, samples_per_prompt=plan.samples_per_prompt, effective_batch_size=rows,
            prompt_length=plan.prompt_length, response_length=response_length, max_new_tokens=plan.max_new_tokens,
            dtype=dtype_name(self.target.dtype), device=str(self.target.device), decoding=plan.decoding,
            strategy=self.strategy.name, zero_stage=self.target.zero_stage, world_size=self.target.world_size,
            rank=self.target.rank, timer=self._clock.kind)
