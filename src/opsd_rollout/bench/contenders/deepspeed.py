"""The ``deepspeed`` contender: what DeepSpeed's own pieces give, on the bench's engine, measured like ours
(``build``, ``step``, ``skip_reason``: see ``bench/contenders/__init__.py``).

``DeepSpeedRollout`` is ``deepspeed.runtime.rollout.HybridEngineRollout`` (``enable_profiling=True``) with the
workload's response lengths forced inside the transformers ``generate`` it calls (the ``LogitsProcessor`` of
``LengthForcing.as_logits_processor``: the same coins on the same rows as our rollout's), each call's profile
read into a ``RolloutProfile``: DeepSpeed's own stage times, real response tokens counted on the batch it returned
(its profile counts every position), the peak memory, and the bench's clock for any time its profile lacks.

``deepspeed_step`` is an OPSD step from DeepSpeed's pieces: that rollout, the teacher's full logits (a plain
forward), DeepSpeed's ``generalized_jsd_loss`` over the student's materialized logits, backward, optimizer
step; a ``StepProfile`` like ``opsd_step``'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from deepspeed.runtime.rollout import HybridEngineRollout, ResponseTokenBatch, generalized_jsd_loss
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig
from transformers import LogitsProcessorList

from opsd_rollout.bench.workload import workload_processor
from opsd_rollout.distributed import rank_info
from opsd_rollout.models import dtype_name
from opsd_rollout.opsd.step_profile import StepParts, StepProfile
from opsd_rollout.opsd.teachers import resident_bytes
from opsd_rollout.profiling import Clock, PeakMemory, RolloutProfile, StageRecorder, timed_eval
from opsd_rollout.profiling.recorder import Span

DEEPSPEED_LOSSES = {"jsd": None, "forward_kl": 0.0, "reverse_kl": 1.0}
"""Our losses that DeepSpeed's ``generalized_jsd_loss`` computes, with the beta it takes for them (``None``: the
config's own beta)."""


def real_response_tokens(input_ids: torch.Tensor, response_start: int, eos_token_id: int | None) -> torch.Tensor:
    """input_ids [N, T] -> [N]: response tokens up to and including each row's first EOS, by position (a token
    equal to the pad id before it counts)."""
    responses = input_ids[:, response_start:]
    if eos_token_id is None:
        return torch.full((responses.shape[0],), responses.shape[1], device=responses.device)
    ended = (responses == eos_token_id).long().cumsum(dim=1)
    return ((ended == 0) | ((ended == 1) & (responses == eos_token_id))).sum(dim=1)


class DeepSpeedRollout:
    """DeepSpeed's ``HybridEngineRollout`` on ``engine`` running the workload's ``lengths``; ``generate`` and
    ``get_last_profile`` (a ``RolloutProfile``, strategy ``deepspeed``) like ours."""

    strategy = "deepspeed"

    def __init__(self, engine: Any, tokenizer: Any, lengths: Any, seed: int = 0):
        self.inner = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
        self.engine, self.module, self.seed, self.lengths = engine, engine.module, seed, lengths
        self.eos = tokenizer.eos_token_id  # what DeepSpeed pads after, and what the forcing emits
        self.device = torch.device(engine.device)
        self._clock = Clock(self.device)
        self._last: RolloutProfile | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.eos is None else (int(self.eos),)

    def generate(self, request: Any, sampling: Any) -> Any:
        self._last = None
        processor = workload_processor(self.lengths, sampling.max_new_tokens, self.eos_token_ids, self.seed)
        memory = PeakMemory(self.device)
        memory.start()
        start = self._clock.mark()
        with self._forced(processor, sampling.n_samples_per_prompt):
            batch = self.inner.generate(request, sampling)
        wall_ms = self._clock.elapsed_ms(start, self._clock.mark())
        self._last = self._profile(self.inner.get_last_profile() or {}, batch, request, sampling, wall_ms,
                                   memory.stop())
        return batch

    @contextlib.contextmanager
    def _forced(self, processor: Any, samples_per_prompt: int) -> Iterator[None]:
        """The module's ``generate`` with the workload's ``LogitsProcessor`` added (DeepSpeed's rollout takes none
        of its own), put back as it was after the call (a hybrid engine's own patch included)."""
        if processor is None:
            yield
            return
        own = vars(self.module).get("generate")
        original = self.module.generate

        def forced(input_ids: torch.Tensor, **kwargs: Any) -> Any:
            extra = processor.as_logits_processor(kwargs["attention_mask"], samples_per_prompt)  # the expanded rows'
            if extra is not None:
                kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), extra])
            return original(input_ids, **kwargs)

        self.module.generate = forced
        try:
            yield
        finally:
            if own is None:
                del self.module.generate
            else:
                self.module.generate = own

    def _profile(self, ds: Mapping[str, Any], batch: Any, request: Any, sampling: Any, wall_ms: float,
                 peak: tuple[int, str]) -> RolloutProfile:
        """DeepSpeed's profile under our names; a stage it did not time counts as generation, a total it did not
        time is the bench's clock around the call."""
        prompt = int(request.prompt_ids.shape[1])
        rows, response = int(batch.input_ids.shape[0]), int(batch.input_ids.shape[1]) - prompt
        generated = int(real_response_tokens(batch.input_ids, prompt, self.eos).sum())
        total = ds.get("total_ms") or wall_ms
        expansion, post = ds.get("prompt_expansion_ms") or 0.0, ds.get("post_processing_ms") or 0.0
        generation = ds.get("generation_ms", max(0.0, total - expansion - post))
        prefill, decode, steps = ds.get("prefill_forward_ms"), ds.get("decode_forward_ms"), ds.get("num_decode_forwards")
        decode_rate = (generated - rows) / (decode / 1e3) if decode and generated > rows else None
        ranks = rank_info()
        return RolloutProfile(
            prompt_expansion_ms=expansion, generation_ms=generation, prefill_ms=prefill, decode_ms=decode,
            decode_steps=steps, prefill_forwards=1 if prefill is not None else None,
            ttft_ms=None,  # its profile has no offsets: when the first forward ended is unknown
            tpot_ms=decode / steps if decode is not None and steps else None,  # the mean decode forward
            prefill_tokens=rows * prompt, post_processing_ms=post, attention_mask_ms=0.0, total_ms=total,
            generated_tokens=generated, padded_tokens=rows * response - generated,
            tokens_per_second=generated / (total / 1e3) if total > 0 else 0.0,
            decode_tokens_per_second=decode_rate,
            prefill_tokens_per_second=rows * prompt / (prefill / 1e3) if prefill else None,
            row_steps=rows * response,  # it computes every row at every step
            live_row_utilisation=generated / (rows * response) if response else None,
            decode_slots=rows, peak_memory_bytes=peak[0], peak_memory_source=peak[1],
            batch_size=int(request.prompt_ids.shape[0]), samples_per_prompt=sampling.n_samples_per_prompt,
            effective_batch_size=rows, prompt_length=prompt, response_length=response,
            max_new_tokens=sampling.max_new_tokens, dtype=dtype_name(next(self.module.parameters()).dtype),
            device=str(self.device), decoding="greedy" if sampling.temperature <= 0 else "sampling",
            strategy=self.strategy, zero_stage=_zero_stage(self.engine), world_size=ranks.world_size, rank=ranks.rank,
            timer="synchronized_clock")

    def get_last_profile(self) -> RolloutProfile | None:
        return self._last

    def get_last_timeline(self) -> list[Span]:
        """The last call's stages, back to back as its profile gives them (it records no offsets)."""
        p = self._last
        if p is None:
            return []
        stages = (("prompt_expansion", p.prompt_expansion_ms), ("generation", p.generation_ms),
                  ("post_processing", p.post_processing_ms))
        spans, start = [Span("rollout", 0.0, p.total_ms, None)], 0.0
        for name, ms in stages:
            spans.append(Span(name, start, ms, "rollout"))
            start += ms
        return spans

    def shutdown(self) -> None:
        self._last = None


def _zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def _logits(model: Any, batch: ResponseTokenBatch) -> torch.Tensor:
    """[N, T - 1, V]: the logits that predict each next token, over the whole sequence (DeepSpeed's recipe)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    return batch.select_causal_logits(out.logits)


def _teacher_logits(teacher: Any, batch: ResponseTokenBatch) -> torch.Tensor:
    with torch.no_grad():
        return _logits(teacher, batch)


def deepspeed_step(engine: Any, teacher: Any, rollout: DeepSpeedRollout, request: Any, sampling: Any, *,
                   beta: float, teacher_top_k: int | None = None) -> StepProfile:
    """One OPSD step of DeepSpeed's pieces on ``engine``; ``beta`` and ``teacher_top_k`` are
    ``generalized_jsd_loss``'s (top-k: both distributions renormalized over the teacher's top k)."""
    device = torch.device(engine.device)
    recorder = StageRecorder(Clock(device), time_forwards=False)
    parts = StepParts(recorder, device)
    with recorder.stage("total"):
        with timed_eval(engine, device, train_after=True) as switch:
            rollout_batch = parts.run("rollout", rollout.generate, request, sampling)
        batch = ResponseTokenBatch.from_rollout(rollout_batch)
        with recorder.stage("teacher"):
            teacher_logits = parts.run("teacher_forward", _teacher_logits, teacher, batch)
        student_logits = parts.run("student_forward", _logits, engine, batch)
        out = parts.run("loss", generalized_jsd_loss, student_logits, teacher_logits, batch.response_mask,
                        beta=beta, teacher_top_k=teacher_top_k)
        parts.run("backward", engine.backward, out.loss)
        parts.run("optimizer", engine.step)
    ms, starts = parts.times()
    peaks = {("teacher" if name == "teacher_forward" else name): peak for name, peak in parts.peaks.items()}
    producing = switch.eval_ms + ms["rollout"] + (switch.train_ms or 0.0)
    return StepProfile(
        rollout=rollout.get_last_profile(), eval_ms=switch.eval_ms, train_ms=switch.train_ms or 0.0,
        rollout_ms=ms["rollout"], teacher_forward_ms=ms["teacher_forward"], cache_write_ms=0.0,
        student_forward_ms=ms["student_forward"], loss_ms=ms["loss"], backward_ms=ms["backward"],
        optimizer_ms=ms["optimizer"], total_ms=ms["total"],
        rollout_share=producing / ms["total"] if ms["total"] > 0 else 0.0, peak_memory_bytes=peaks,
        part_start_ms=starts,
        response_tokens=int(batch.response_mask.sum()),
        teacher_cache_bytes=teacher_logits.numel() * teacher_logits.element_size(),  # held whole on the device
        teacher_cache_budget_bytes=0, teacher_cache_mode="full", fused_loss=False,
        teacher_parameter_bytes=resident_bytes(teacher), loss=float(out.loss.detach()))


def build(built: Any, config: Any) -> DeepSpeedRollout:
    return DeepSpeedRollout(built.engine, built.tokenizer, config.lengths)


def build_step(engine: Any, teacher: Any, rollout: DeepSpeedRollout, sampling: Any, divergence: Any, cache: Any,
               state: Any) -> Callable[[Any], StepProfile]:
    """``deepspeed_step`` on a request, with our loss's beta (0 for forward_kl, 1 for reverse_kl) and, for a
    ``top<k>`` teacher cache, its ``teacher_top_k``; ``state`` (our step's) is not DeepSpeed's."""
    beta = DEEPSPEED_LOSSES[divergence.loss]
    return functools.partial(deepspeed_step, engine, teacher, rollout, sampling=sampling,
                             beta=divergence.beta if beta is None else beta,
                             teacher_top_k=cache.top_k if cache.mode == "topk" else None)


def skip_reason(config: Any) -> str | None:
    if config.loss in DEEPSPEED_LOSSES:
        return None
    return ("DeepSpeed's own step has no sampled-token loss: its generalized_jsd_loss takes the teacher's "
            "distribution (forward_kl, reverse_kl, jsd)")
