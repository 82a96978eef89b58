"""``HybridEngineRollout``: DeepSpeed's rollout interface over our engine, with opt-in profiling."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from deepspeed.runtime.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

from opsd_rollout import checks
from opsd_rollout.distributed import agree_max
from opsd_rollout.models import dtype_name
from opsd_rollout.profiling import NULL_RECORDER, Clock, PeakMemory, RolloutProfile, Span, StageRecorder
from opsd_rollout.profiling.probes import PhaseProbes
from opsd_rollout.profiling.profile import build_profile
from opsd_rollout.rollout import postprocess
from opsd_rollout.rollout.config import HybridEngineRolloutConfig
from opsd_rollout.rollout.continuous_stats import continuous_stats
from opsd_rollout.rollout.deepspeed_fields import ReadBack
from opsd_rollout.rollout.gather import GatherOnce
from opsd_rollout.rollout.phases import add_rollout_probes, zero3_offload
from opsd_rollout.rollout.processors import RowLogitsProcessor
from opsd_rollout.rollout.strategies import TransformersGenerate, make_strategy
from opsd_rollout.rollout.target import hybrid_engine_problem, merged_weights, resolve_target
from opsd_rollout.rollout.validation import RolloutPlan, plan_rollout, resolve_special_tokens


logger = logging.getLogger(__name__)


def empty_accelerator_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
        problem = hybrid_engine_problem(engine) if self.target.hybrid_engine else None
        if problem:
            raise ValueError(problem)
        if self.cfg.merge_adapters and not self.target.is_peft:
            raise ValueError(f"merge_adapters=True needs a PEFT model (with merge_adapter/unmerge_adapter); "
                             f"got {type(self.target.model).__name__}")
        self.strategy = make_strategy(self.cfg)
        reason = self.strategy.unsupported_reason(self.target)
        if reason:
            logger.warning("strategy %r cannot run %s (%s); using 'generate'", self.cfg.strategy,
                           type(self.target.forward_module).__name__, reason)
            self.strategy = TransformersGenerate()
        self.strategy.prepare(self.target)
        self._gather_once = (GatherOnce(self.target.model, self.cfg.options.gather_memory_budget_bytes, self.target.device,
                                        zero3_offload(self.target.engine))
                             if self.target.zero_stage == 3 and not self.target.hybrid_engine
                             and self.cfg.zero3_gather == "once" else None)
        self._last: Callable[[], tuple[RolloutProfile, list[Span]]] | None = None
        """The last profiled call's profile and timeline, read when first asked for (reading waits for the device)."""
        self._continuous: Callable[[], dict[str, Any]] | None = None
        """The last continuous-batching call's statistics, read when first asked for."""
        self._clock = Clock(self.target.device)
        self._closed = False
        self._warned_slots = False

    # DeepSpeed's rollout exposes its config's six fields as attributes; ours reads them on its config, with the
    # strategy that runs (deepspeed_fields.read_back)
    enable_profiling = ReadBack(on_rollout=True)
    use_graph_capture = ReadBack(on_rollout=True)
    use_shared_prefill = ReadBack(on_rollout=True)
    align_decode_fronts = ReadBack(on_rollout=True)
    enable_cache_trimming = ReadBack(on_rollout=True)
    continuous_cache_capacity = ReadBack(on_rollout=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The token ids a response ends at: the tokenizer's EOS and the model's ``generation_config``'s."""
        return resolve_special_tokens(self.tokenizer, self.target)[1]

    def get_last_profile(self) -> RolloutProfile | None:
        """The last call's profile; ``None`` before the first profiled call and after a call that raised. Read when
        first asked for (on CUDA, one wait for the device): a profiled call itself waits for nothing."""
        return self._last()[0] if self._last is not None else None

    def get_last_continuous_stats(self) -> dict[str, Any] | None:
        """DeepSpeed's statistics of the last continuous-batching call (``SamplingConfig.continuous_batch_size``
        set), under its keys (``rollout/continuous_stats.py``); ``None`` before the first. Times and throughput are
        ``None`` unless the call was profiled."""
        return self._continuous() if self._continuous is not None else None

    def get_last_timeline(self) -> list[Span] | None:
        """The last profiled call's spans (stages and forwards, start offsets from the call's start), for traces."""
        return self._last()[1] if self._last is not None else None

    def sync_weights(self, step: int) -> None:  # noqa: ARG002 - interface
        """No-op: the rollout generates with the training engine's own weights."""

    def release_workspace(self) -> None:
        """Free inference workspaces kept between calls and the accelerator's cached blocks."""
        self._release(NULL_RECORDER)

    def _release(self, recorder: Any) -> None:
        with recorder.phase("inference_cache"):
            self.strategy.release_workspace()
        with recorder.phase("empty_cache"):
            empty_accelerator_cache(self.target.device)

    def shutdown(self) -> None:
        self.release_workspace()
        self._closed = True
        self._last = None

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig, *,
                 logits_processor: RowLogitsProcessor | None = None, seed: int | None = None) -> RolloutBatch:
        """Roll out ``sampling.n_samples_per_prompt`` responses per prompt (the batch contract: docs/CONTRACT.md).
        Ours, not DeepSpeed's: ``logits_processor`` adjusts the logits of every sampled token, by request row
        (``rollout/processors.py``; the benchmark forces its workloads' response lengths with one); ``seed`` is this
        call's own seed (the same seed, the same samples, whatever was called before: what a trainer that resumes
        needs), over ``HybridEngineRolloutConfig.seed``."""
        self._last = None
        if self._closed:
            raise RuntimeError("generate() called after shutdown()")
        checks.integer("seed", seed, minimum=0, optional=True)
        plan = plan_rollout(request, sampling, self.target, self.tokenizer)
        if plan.continuous_batch_size and self.strategy.name == "generate" and not self._warned_slots:
            self._warned_slots = True
            logger.warning("strategy 'generate' decodes every row at once: continuous_batch_size=%d bounds nothing "
                           "(the rows returned are the same); strategy 'static' honours it", plan.continuous_batch_size)
        prompt_ids = request.prompt_ids.to(self.target.device)
        prompt_mask = request.prompt_attention_mask.to(self.target.device)
        if self.cfg.enable_profiling:
            batch, lengths = self._profiled_rollout(prompt_ids, prompt_mask, plan, logits_processor, seed)
        else:
            batch, lengths = self._rollout(prompt_ids, prompt_mask, plan, NULL_RECORDER, logits_processor, seed)
        if plan.continuous_batch_size is not None:  # times and throughput only from a profiled call
            stats, profiled = dataclasses.replace(self.strategy.last_stats), self._last
            self._continuous = functools.cache(lambda: continuous_stats(
                stats, lengths, plan.prompt_length, profiled()[0] if profiled is not None else None))
        return batch

    def _profiled_rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, plan: RolloutPlan,
                          processor: RowLogitsProcessor | None, seed: int | None) -> tuple[RolloutBatch, torch.Tensor]:
        """``_rollout`` under a recorder, waiting for nothing: what the profile reads from the device (the marks, each
        row's length) is read when it is first asked for (``get_last_profile``)."""
        memory = PeakMemory(self.target.device)
        memory.start()
        recorder = StageRecorder(self._clock, time_forwards=self.cfg.options.profile_forwards)
        with recorder.stage("total"):
            batch, lengths = self._rollout(prompt_ids, prompt_mask, plan, recorder, processor, seed)
        finish = self.strategy.last_stats.finish_forward
        stats = dataclasses.replace(self.strategy.last_stats,
                                    finish_forward=None if finish is None else self._clock.host_copy(finish))
        host_lengths = self._clock.host_copy(lengths)
        workspace = self.strategy.workspace
        facts = dict(
            peak_memory=memory.stop(), effective_batch_size=plan.effective_batch_size,
            response_length=batch.seq_len - plan.prompt_length, batch_size=plan.batch_size,
            samples_per_prompt=plan.samples_per_prompt, prompt_length=plan.prompt_length,
            max_new_tokens=plan.max_new_tokens, dtype=dtype_name(self.target.dtype), device=str(self.target.device),
            decoding=plan.decoding, strategy=self.strategy.name, zero_stage=self.target.zero_stage,
            world_size=self.target.world_size, rank=self.target.rank, timer=self._clock.kind, decode_stats=stats,
            kv_workspace_bytes=workspace.nbytes if workspace is not None else None,
            weight_layout_bytes=self.strategy.weight_layout_bytes,
            workspace=workspace.last_event if workspace is not None else None)

        @functools.cache
        def read() -> tuple[RolloutProfile, list[Span]]:
            resolved = recorder.resolve()  # the one wait: the copies to the host landed too
            profile = build_profile(stages=resolved.stages, forwards=resolved.forwards, phases=resolved.phases,
                                    lengths=host_lengths, **facts)
            return profile, resolved.spans

        self._last = read
        return batch, lengths

    def _width(self, lengths: torch.Tensor, plan: RolloutPlan) -> int:
        """The batch's response columns: ``max_new_tokens`` (DeepSpeed's), or the longest response on any rank."""
        if self.cfg.response_width == "max_new_tokens":
            return plan.max_new_tokens
        return agree_max([int(lengths.max())], lengths.device)[0]

    def _probes(self) -> PhaseProbes:
        probes = PhaseProbes(self._clock)
        add_rollout_probes(probes, self.target, merge_adapters=self.cfg.merge_adapters)
        for obj, method, phase in self.strategy.probe_points():
            probes.add(obj, method, phase)
        return probes

    def _params_gathered(self, recorder: Any) -> contextlib.AbstractContextManager:
        return self._gather_once(recorder) if self._gather_once is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _adapters_merged(self, gathered: bool) -> Iterator[None]:
        """PEFT's adapters merged into the weights for the block (``merge_adapters``), and the weights put back
        exactly after it: PEFT's unmerge subtracts the update again, which rounds, and a frozen base that drifted a
        rounding a rollout would no longer be the base the adapters are saved for. Under ZeRO-3 only while the
        parameters are gathered whole (a partition has nothing to merge into)."""
        if not self.cfg.merge_adapters or (self.target.zero_stage == 3 and not gathered):
            yield
            return
        kept = [(weight, weight.detach().clone()) for weight in merged_weights(self.target.model)]
        self.target.model.merge_adapter()
        try:
            yield
        finally:
            self.target.model.unmerge_adapter()
            with torch.no_grad():
                for weight, original in kept:
                    weight.copy_(original)

    def _rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, plan: RolloutPlan, recorder: Any,
                 processor: RowLogitsProcessor | None, seed: int | None) -> tuple[RolloutBatch, torch.Tensor]:
        P = plan.prompt_length
        with recorder.stage("prompt_expansion"):  # the mask [N, P + max_new_tokens]: the batch's, allocated once
            ids, batch_mask = postprocess.expand_prompts(prompt_ids, prompt_mask, plan.samples_per_prompt,
                                                         plan.max_new_tokens)
            mask = batch_mask[:, :P]
        probes = self._probes() if recorder.enabled else None  # the unprofiled path builds nothing
        with recorder.stage("generation"), recorder.forwards(self.target.forward_module), recorder.probes(probes):
            with self._params_gathered(recorder) as gathered, self._adapters_merged(gathered):
                # per-layer ZeRO-3 gathering makes every forward a collective: ranks must prefill together
                layerwise = self.target.zero_stage == 3 and not gathered
                plan = dataclasses.replace(plan, layerwise_gather=layerwise,
                                           collective_forwards=plan.lockstep and layerwise)
                sequences = self.strategy.generate(self.target, ids, mask, plan, recorder, processor,
                                                   seed)  # [N, P + R']
            if self.cfg.cache_policy == "release":
                self._release(recorder)
        with recorder.stage("post_processing"):
            handed = self.strategy.last_stats.lengths  # the decode loop knows where each row stopped
            if handed is not None:
                lengths = handed
            else:
                eos = torch.tensor(plan.eos_token_ids, dtype=sequences.dtype, device=sequences.device)
                lengths = postprocess.response_lengths(sequences[:, P:], eos)
            width = self._width(lengths, plan)
            input_ids = postprocess.finalize_input_ids(sequences, P, lengths, width, plan.pad_token_id,
                                                       padded=handed is not None)
            with recorder.stage("attention_mask"):
                attention_mask = postprocess.attention_mask(batch_mask, P, lengths, width)
            start = torch.full((ids.shape[0], ), P, dtype=torch.int64, device=ids.device)
            batch = RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, response_start_idx=start)
        return batch, lengths
