"""One on-policy distillation step, profiled: rollout -> teacher cache -> student forward -> divergence ->
backward -> optimizer step, with the eval/train switches around the rollout timed."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from opsd_rollout.distributed import partitioned
from opsd_rollout.modeling import innermost_model, model_config, text_config
from opsd_rollout.opsd.divergence import DivergenceConfig
from opsd_rollout.opsd.fused import fusion_problem
from opsd_rollout.opsd.in_flight import StepInFlight, StepRollout
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.opsd.self_teacher import SelfTeacher
from opsd_rollout.opsd.targets import ResponseTargets, expanded_prompts, reprompted, response_targets
from opsd_rollout.opsd.step_profile import StepParts, StepProfile
from opsd_rollout.opsd.teacher import TeacherCacheBuffers, TeacherCacheConfig, build_teacher_cache
from opsd_rollout.opsd.teachers import Share, Teacher, Teachers, check_routes, check_teacher, route_rows, share_targets
from opsd_rollout.profiling import Clock, StageRecorder, timed_eval
from opsd_rollout.seeding import seeded

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

logger = logging.getLogger(__name__)


@dataclass
class StepState:
    """What ``opsd_step`` keeps from one step to the next, held by the caller that runs the steps (train's loop, the
    benchmark's step scenario) so that nothing lives in the module: ``opsd_step`` makes a fresh one when given none,
    so a one-off step needs nothing, and a caller running many passes the same one to each."""

    buffers: TeacherCacheBuffers = field(default_factory=TeacherCacheBuffers)
    """The host memory the teacher cache is built in, reused from step to step (pinned on CUDA once, not every
    step)."""
    slots: dict[tuple[int, str | None], TeacherCacheBuffers] = field(default_factory=dict)
    """The buffers of the other caches: of steps in flight beside the first (``OPSDStep.start(..., slot=1)``),
    and of each of several teachers, by ``(slot, teacher's name)``."""
    checked: "weakref.WeakSet[torch.nn.Module]" = field(default_factory=weakref.WeakSet)
    """Students already compared with their teacher: at their first step only, since afterwards their weights
    have moved (weak: a student dropped is forgotten)."""
    warned: "weakref.WeakSet[torch.nn.Module]" = field(default_factory=weakref.WeakSet)
    """Students already told that the fused loss cannot run on them: said once, not at every step."""

    def buffers_for(self, slot: int, teacher: str | None) -> TeacherCacheBuffers:
        """The host buffers of step ``slot``'s cache of ``teacher`` (``None``: a step's only teacher)."""
        if slot == 0 and teacher is None:
            return self.buffers
        return self.slots.setdefault((slot, teacher), TeacherCacheBuffers())


def _same_weights(student: torch.nn.Module, teacher: torch.nn.Module) -> bool:
    """Whether the teacher is the student: the same module, or an equal first parameter (cheap, and enough for
    what happens in practice: one preset loaded twice with one seed, one checkpoint loaded twice). Parameters of
    different shapes (one side a ZeRO-3 partition, the other whole), dtypes or devices say nothing."""
    if student is teacher:
        return True
    first, other = next(student.parameters(), None), next(teacher.parameters(), None)
    if first is None or other is None:
        return False
    a, b = (getattr(p, "ds_tensor", p) for p in (first, other))  # a ZeRO-3 parameter's data is its rank's partition
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.numel() > 0
            and torch.equal(a, b))


def _warn_if_teacher_is_student(student: torch.nn.Module, teacher: torch.nn.Module | SelfTeacher,
                                state: StepState) -> None:
    """Once per student and ``state``, at its first step (afterwards its weights have moved): a teacher equal to
    the student makes every divergence 0, so the step would train nothing and report ``loss 0.0000`` without a
    word."""
    if student in state.checked or isinstance(teacher, SelfTeacher):  # a self-teacher differs by its context
        return
    state.checked.add(student)
    if _same_weights(student, teacher):
        logger.warning("the teacher has the student's weights (the same model, or the same preset and seed): the "
                       "loss and its gradient are 0 at every step. Distil from another model: another preset, a "
                       "checkpoint, or the same preset with other weights (opsd_rollout.models.load_model(name, "
                       "seed=...))")


def _fuses(model: torch.nn.Module, divergence: DivergenceConfig, state: StepState) -> bool:
    """Whether the loss runs fused on ``model``; a model that cannot is said once per ``state``, and runs the
    reference."""
    if not divergence.fused:
        return False
    problem = fusion_problem(model)
    if problem is not None and model not in state.warned:
        state.warned.add(model)
        logger.warning("the fused loss cannot run on this student (%s): computing its logits whole instead", problem)
    return problem is None


def check_pairing(divergence: DivergenceConfig, teacher_cache: TeacherCacheConfig) -> None:
    """A loss and a teacher cache that go together: ``sampled_reverse_kl`` reads the ``sampled`` cache, every other
    loss the teacher's distribution (``full`` or ``topk``)."""
    sampled_loss, sampled_cache = divergence.loss == "sampled_reverse_kl", teacher_cache.mode == "sampled"
    if sampled_cache and not sampled_loss:
        raise ValueError(f"the sampled teacher cache holds one token's log-probability, and loss {divergence.loss!r} "
                         "needs the teacher's whole distribution: use TeacherCacheConfig(mode='full' or 'topk') "
                         "(--teacher-cache full or topk), or loss='sampled_reverse_kl'")
    if sampled_loss and not sampled_cache:
        raise ValueError(f"loss 'sampled_reverse_kl' reads the teacher's log-probability of each sampled token: use "
                         f"TeacherCacheConfig(mode='sampled'), on the command line --teacher-cache sampled (got mode "
                         f"{teacher_cache.mode!r})")


def opsd_step(student_engine: DeepSpeedEngine, teacher: Teachers, rollout: StepRollout, request: RolloutRequest,
              sampling: SamplingConfig, *,
              divergence: DivergenceConfig | None = None, teacher_cache: TeacherCacheConfig | None = None,
              behaviour_logprobs: torch.Tensor | None = None, state: StepState | None = None,
              seed: int | None = None, grad_norm: bool = False, routes: Sequence[str] | None = None,
              teacher_request: RolloutRequest | None = None) -> StepProfile:
    """One step on ``student_engine`` (a DeepSpeed engine, ZeRO 0-3), and its profile: the one-call convenience over
    ``OPSDStep`` (``OPSDStep(...)(request, ...)``; a caller running many steps builds the ``OPSDStep`` once).

    ``teacher``: a model (plain, or a DeepSpeed engine, ZeRO-3 partitioned or not) run here into the host cache, or
    a ``ServedTeacher`` (``opsd/served.py``) whose server sends the cache's log-probabilities (``topk`` or
    ``sampled`` caches; ``full`` is refused before any work), its request in flight while the student's forward
    runs (``ServedTeacher(overlap=True)``, the default); or several, ``{name: teacher}``, with ``routes`` naming
    each prompt's (each scores its prompts' rows alone; ``StepProfile.teacher_losses`` has each one's loss).
    ``state``: what a caller running many steps keeps across them (``StepState``); the rest: ``OPSDStep`` and its
    ``start``."""
    step = OPSDStep(engine=student_engine, teacher=teacher, rollout=rollout, sampling=sampling,
                    divergence=divergence or DivergenceConfig(), teacher_cache=teacher_cache or TeacherCacheConfig(),
                    grad_norm=grad_norm, state=state if state is not None else StepState())
    return step(request, seed=seed, routes=routes, behaviour_logprobs=behaviour_logprobs,
                teacher_request=teacher_request)


@dataclass(kw_only=True, eq=False)
class OPSDStep:
    """What stays the same for a run's steps, checked once: the student's engine, its teachers, the rollout, the
    configs and the host buffers (``state``). Calling it runs one step on what changes per step, the request and its
    seed (``step(request, seed=...)``), as torchtitan's ``train_step(batch)``; ``start`` runs its first half."""

    engine: DeepSpeedEngine
    """The student's DeepSpeed engine (ZeRO 0-3)."""
    teacher: Teachers
    """A model run here, a ``ServedTeacher``, or several ``{name: teacher}`` (each call then routes its prompts)."""
    rollout: StepRollout
    """What samples the student's responses: ``rollout.generate(request, sampling[, seed=])``."""
    sampling: SamplingConfig
    """DeepSpeed's ``SamplingConfig``, for every step."""
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    teacher_cache: TeacherCacheConfig = field(default_factory=TeacherCacheConfig)
    grad_norm: bool = False
    """Report the gradient norm of the optimizer step a call completes (``StepProfile.grad_norm``; at ZeRO-0 a pass
    over the gradients, inside the ``optimizer`` part)."""
    state: StepState = field(default_factory=StepState)
    """The host buffers and the warnings said once, kept across the steps (a caller may share one between several
    ``OPSDStep``s: the bench's configs do)."""

    def __post_init__(self) -> None:
        check_pairing(self.divergence, self.teacher_cache)
        self.named: dict[str, Teacher] = {}
        """With several teachers, each by its name (empty with one)."""
        self.teachers: dict[str | None, Teacher] = {}
        if isinstance(self.teacher, Mapping):
            self.named = dict(self.teacher)
            self.teachers.update(self.named)
        else:
            self.teachers[None] = self.teacher
        self.routed = isinstance(self.teacher, Mapping)
        if self.routed and not self.teachers:
            raise ValueError("teacher: a model, a ServedTeacher, or a mapping {name: teacher} of at least one")
        student = innermost_model(self.engine)
        vocab = text_config(model_config(student)).vocab_size
        for name, each in self.teachers.items():  # before any work
            check_teacher(each, vocab, self.teacher_cache, name)
            if not isinstance(each, ServedTeacher):
                _warn_if_teacher_is_student(student, each if isinstance(each, SelfTeacher) else innermost_model(each),
                                            self.state)
        self.fused = _fuses(student, self.divergence, self.state)
        self.device = torch.device(self.engine.device)

    def __call__(self, request: RolloutRequest, *, seed: int | None = None, routes: Sequence[str] | None = None,
                 behaviour_logprobs: torch.Tensor | None = None, rollout: StepRollout | None = None,
                 teacher_request: RolloutRequest | None = None) -> StepProfile:
        """One whole step (``start(...).finish()``)."""
        return self.start(request, seed=seed, routes=routes, behaviour_logprobs=behaviour_logprobs,
                          rollout=rollout, teacher_request=teacher_request).finish()

    def start(self, request: RolloutRequest, *, seed: int | None = None, routes: Sequence[str] | None = None,
              behaviour_logprobs: torch.Tensor | None = None, rollout: StepRollout | None = None,
              teacher_request: RolloutRequest | None = None, slot: int = 0) -> StepInFlight:
        """The step's first half: the rollout, and each teacher's cache, built here by an in-process teacher or
        asked of a served one in the background (``overlap``) and left in flight. ``.finish()`` is the rest: the
        student's forward, the wait for a served teacher, the loss, backward and the optimizer.

        ``seed``: the step's samples are a function of it alone (handed to ``rollout.generate(..., seed=)``, which ours
        takes), and the student forward's dropout draws from it (the process's generators are put back after);
        ``None``: the rollout is called as DeepSpeed's is, on the generators as they are. ``routes``: with several
        teachers, one name per prompt. ``behaviour_logprobs`` [N, R]: with ``sampled_reverse_kl``, the sampled tokens'
        log-probabilities under the policy that sampled them, for an off-policy update (``None``: on-policy).
        ``rollout``: this step's samples from another source than the run's rollout (the teacher's samples for
        supervised KD, a batch made beforehand). ``teacher_request``: the teachers' own prompts, a
        ``RolloutRequest`` with one (left-padded) prompt for each of ``request``'s (a privileged context: the
        reference, for self-distillation); each teacher scores the student's responses after its row's prompt, the
        student learns after its own. ``None``: the teachers see the student's prompts.

        Between the halves the caller may do work that does not change the student's weights: ``train`` rolls out
        its next micro-batches there, so each one's teacher request is in flight behind the next rollout. Steps in
        flight at once each take their own ``slot`` (0, 1, ...): the host buffers their caches are built in."""
        if self.routed:
            check_routes(self.named, routes, int(request.prompt_ids.shape[0]))
        elif routes is not None:
            raise ValueError("routes name each prompt's teacher: give teacher as a mapping {name: teacher}")
        recorder = StageRecorder(Clock(self.device), time_forwards=False)
        parts = StepParts(recorder, self.device)
        rollout = rollout if rollout is not None else self.rollout
        with seeded(seed, self.device), recorder.stage("total"):
            with timed_eval(self.engine, self.device, train_after=True) as switch:
                seeded_call = {} if seed is None else {"seed": seed}
                batch = parts.run("rollout", rollout.generate, request, self.sampling, **seeded_call)
            targets = response_targets(batch)
            scored = None if teacher_request is None else reprompted(
                targets, *teacher_prompts(teacher_request, request, self.sampling.n_samples_per_prompt))
            shares = self._shares(targets, routes, scored)
            in_flight = StepInFlight(step=self, rollout=rollout, seed=seed, behaviour_logprobs=behaviour_logprobs,
                                     recorder=recorder, parts=parts, switch=switch, targets=targets, shares=shares)
            for share in sorted(shares, key=lambda share: not share.served):  # the servers' requests first
                buffers = self.state.buffers_for(slot, share.name)
                if isinstance(share.teacher, ServedTeacher):
                    share.pending = share.teacher.submit(share.teacher_targets, self.teacher_cache, buffers=buffers,
                                                         pin=self.device.type == "cuda")
                    if not share.teacher.overlap:
                        in_flight.failure = in_flight.failure or in_flight.received([share])
                else:
                    share.cache = parts.run("teacher", build_teacher_cache, share.teacher, share.teacher_targets,
                                            self.teacher_cache, recorder=recorder, buffers=buffers)
        return in_flight

    def _shares(self, targets: ResponseTargets, routes: Sequence[str] | None,
                scored: ResponseTargets | None) -> list[Share]:
        """Each teacher's rows and targets (and what it scores, ``scored``, when its prompts are not the student's):
        every row for one teacher; with several, each prompt's rows to the teacher its route names (a partitioned
        teacher joins with no rows: its gathers need every rank; a served one routed no prompt is not asked)."""
        if not self.routed or routes is None:  # routes are checked in start
            return [Share(name=None, teacher=self.teachers[None], rows=None, targets=targets, scored=scored)]
        rows = route_rows(self.named, routes, self.sampling.n_samples_per_prompt, targets.input_ids.device)
        return [Share(name=name, teacher=each, rows=rows[name], targets=share_targets(targets, rows[name]),
                      scored=None if scored is None else share_targets(scored, rows[name]))
                for name, each in self.named.items()
                if rows[name].numel() or (not isinstance(each, ServedTeacher) and partitioned(innermost_model(each)))]


def teacher_prompts(teacher_request: RolloutRequest, request: RolloutRequest,
                    samples_per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teachers' prompts ``[B * n, P']`` (ids and mask), one a response row, from ``teacher_request``'s one a
    prompt of ``request``."""
    ids, mask = teacher_request.prompt_ids, teacher_request.prompt_attention_mask
    prompts = int(request.prompt_ids.shape[0])
    if ids.dim() != 2 or ids.shape[0] != prompts or mask.shape != ids.shape:
        raise ValueError(f"teacher_request must hold one prompt for each of the request's {prompts} prompts: ids "
                         f"[{prompts}, P'] and a mask of the same shape; got {tuple(ids.shape)} and "
                         f"{tuple(mask.shape)}")
    return expanded_prompts(teacher_request, samples_per_prompt)
