"""``StepInFlight``: an OPSD step between its halves. ``OPSDStep.start`` rolls out and builds (or asks a served
teacher for) the teachers' caches; ``finish`` runs the student's side (its forward with a served answer in flight
behind it, the loss over each teacher's rows, backward, the optimizer) and returns the step's profile. Between the
two, a caller can start the next micro-batch's rollout, so a served teacher's latency hides behind it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from opsd_rollout.distributed import several_ranks
from opsd_rollout.opsd.nonfinite import nonfinite_part
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.opsd.step_profile import StepParts, StepProfile
from opsd_rollout.opsd.student import engine_step, student_forward, student_loss, token_mean
from opsd_rollout.opsd.targets import ResponseTargets
from opsd_rollout.opsd.teachers import Share, resident_bytes
from opsd_rollout.profiling import StageRecorder
from opsd_rollout.profiling.transitions import ModeSwitchTimes
from opsd_rollout.seeding import seeded

if TYPE_CHECKING:
    from deepspeed.runtime.rollout import RolloutBatch, RolloutRequest, SamplingConfig

    from opsd_rollout.opsd.divergence import DivergenceConfig
    from opsd_rollout.profiling import RolloutProfile


class StepRollout(Protocol):
    """What samples a step's responses: ours (``HybridEngineRollout``, whose ``generate`` also takes ``seed=``),
    DeepSpeed's, or a source of batches made beforehand."""

    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch: ...

    def get_last_profile(self) -> RolloutProfile | None: ...


class StudentSide(Protocol):
    """What the second half of a step reads of the step that started it (``OPSDStep``)."""

    @property
    def engine(self) -> Any:
        """The student's DeepSpeed engine."""

    @property
    def device(self) -> torch.device: ...

    @property
    def fused(self) -> bool:
        """Whether the loss runs fused with the LM head."""

    @property
    def divergence(self) -> DivergenceConfig: ...

    @property
    def grad_norm(self) -> bool: ...

    @property
    def teachers(self) -> Mapping[str | None, Any]:
        """The step's teachers by name (``None``: a step's only teacher)."""


@dataclass(kw_only=True, eq=False)
class StepInFlight:
    """An OPSD step between its halves (``OPSDStep.start``): its rollout done, its teachers' caches built or asked
    for."""

    step: StudentSide
    """The step that started it (``OPSDStep``)."""
    rollout: StepRollout
    """What sampled this step's responses (its profile is the step's rollout's)."""
    seed: int | None
    behaviour_logprobs: torch.Tensor | None
    recorder: StageRecorder
    parts: StepParts
    switch: ModeSwitchTimes
    """The eval/train switch around the rollout, timed."""
    targets: ResponseTargets
    shares: list[Share]
    """Each teacher's rows and cache (one share, every row, with one teacher)."""
    failure: BaseException | None = None
    """A teacher's answer that failed before ``finish`` (one waited for in ``start``, without overlap)."""

    def wait(self, share: Share) -> None:
        """A served teacher's cache, waited for as the step's ``teacher`` part (the latency not hidden)."""
        if share.cache is None:
            self.parts.run("teacher", self._receive, share)

    def _receive(self, share: Share) -> None:
        if share.pending is None:
            raise RuntimeError(f"teacher {share.name!r} was asked for no cache")
        with self.recorder.stage("teacher_wait"):
            share.cache = share.pending.result()

    def cancel(self) -> None:
        """Drop the served answers not yet on their way (a run stopping with this step in flight)."""
        for share in self.shares:
            if share.pending is not None:
                share.pending.cancel()

    def received(self, shares: list[Share] | None = None) -> BaseException | None:
        """Every teacher's cache (of ``shares``, every one by default) waited for; the first failure (a request that
        gave up, an answer refused at the wire) returned, not raised, and the answers still on their way dropped."""
        if self.failure is not None:
            return self.failure
        for share in self.shares if shares is None else shares:
            try:
                self.wait(share)
            except Exception as failure:  # noqa: BLE001 - what to do is agreed with the other ranks
                self.cancel()
                return failure
        return None

    def finish(self, agree: Callable[[BaseException | None], None] | None = None) -> StepProfile:
        """The rest of the step, then its profile: the student's forward (a served teacher's request in flight
        during it), the teachers' caches, the loss (each teacher's over its rows), backward and the optimizer.

        ``agree``: called once every teacher's cache is in, before any loss, with this rank's failure to get one (or
        ``None``): where every rank decides alike whether the step goes on (``train``'s loop); it raises to stop.
        Without it, a failure is raised here."""
        step, parts, targets = self.step, self.parts, self.targets
        with seeded(self.seed, step.device), self.recorder.stage("total"):
            out = student_forward(parts, step.engine, targets, step.fused)
            failure = self.received()
            if agree is not None:
                agree(failure)
            if failure is not None:
                raise failure
            sums = [student_loss(parts, step.engine, share.pick(out), share.targets, share.built, step.divergence,
                                  step.fused, share.pick(self.behaviour_logprobs)) for share in self.shares]
            total, count = (sum(column) for column in zip(*sums))
            loss, reported = token_mean(total, count)
            parts.run("backward", step.engine.backward, loss)
            norm = parts.run("optimizer", engine_step, step.engine, grad_norm=step.grad_norm)
        value = float(reported)
        nonfinite = None if math.isfinite(value) else nonfinite_part([s.cache for s in self.shares], out, total)
        named = {share.name: sums[i] for i, share in enumerate(self.shares) if share.name is not None}
        names = [name for name in step.teachers if name is not None]
        return self._profile(value, norm, per_teacher(names, named, step.device), nonfinite)

    def _profile(self, reported: float, norm: Any, teachers: dict[str, tuple[float, int]],
                 nonfinite: str | None) -> StepProfile:
        ms, starts = self.parts.times()
        switch, caches = self.switch, [share.built for share in self.shares]
        served = [share.pending for share in self.shares if share.pending is not None]
        eval_ms = switch.eval_ms or 0.0  # read once the step's marks are resolved: a number now
        producing = eval_ms + ms["rollout"] + (switch.train_ms or 0.0)
        return StepProfile(
            rollout=self.rollout.get_last_profile(), eval_ms=eval_ms, train_ms=switch.train_ms or 0.0,
            rollout_ms=ms["rollout"], teacher_forward_ms=ms.get("teacher_forward", 0.0),
            cache_write_ms=ms.get("cache_write", 0.0), teacher_wait_ms=ms.get("teacher_wait", 0.0),
            student_forward_ms=ms["student_forward"], loss_ms=ms["loss"], backward_ms=ms["backward"],
            optimizer_ms=ms["optimizer"], total_ms=ms["total"],
            rollout_share=producing / ms["total"] if ms["total"] > 0 else 0.0,
            peak_memory_bytes=dict(self.parts.peaks), part_start_ms=starts, response_tokens=self.targets.tokens,
            teacher_cache_bytes=sum(cache.nbytes for cache in caches),
            teacher_cache_budget_bytes=max(cache.budget_bytes for cache in caches),
            teacher_cache_mode=caches[0].mode, fused_loss=self.step.fused, loss=reported, nonfinite=nonfinite,
            teacher_parameter_bytes=sum(resident_bytes(s.teacher) for s in self.shares
                                        if not isinstance(s.teacher, ServedTeacher)),
            grad_norm=None if norm is None else float(norm),
            teacher_latency_ms=max((pending.latency_ms for pending in served), default=0.0),
            teacher_losses={name: value for name, (value, _) in teachers.items()},
            teacher_tokens={name: tokens for name, (_, tokens) in teachers.items()})


def per_teacher(names: list[str], sums: dict[str, tuple[torch.Tensor, torch.Tensor]],
                device: torch.device) -> dict[str, tuple[float, int]]:
    """Each named teacher's token-mean loss and its response tokens, over every rank (``names``: the step's
    teachers, alike on every rank, in one all-reduce; a teacher no rank routed a token to is left out)."""
    if not names:
        return {}
    zero = torch.zeros(())
    stacked = torch.stack([torch.stack([t.detach().float().reshape(()).cpu(), c.float().reshape(()).cpu()])
                           for t, c in (sums.get(name, (zero, zero)) for name in names)])  # [T, 2]
    if several_ranks():
        stacked = stacked.to(device)  # the student's: where the step's other collectives run
        dist.all_reduce(stacked)
    return {name: (total / count, int(count)) for name, (total, count) in zip(names, stacked.tolist()) if count}
