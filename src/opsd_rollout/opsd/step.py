"""One on-policy distillation step, profiled: rollout -> teacher cache -> student forward -> divergence ->
backward -> optimizer step, with the eval/train switches around the rollout timed."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from opsd_rollout.metrics import STEP_PARTS, STEP_STAGES, hidden_share, label
from opsd_rollout.modeling import innermost_model, position_ids, text_config
from opsd_rollout.opsd.divergence import DivergenceConfig, chunked_divergence
from opsd_rollout.opsd.fused import fusion_problem, head_divergence
from opsd_rollout.opsd.sampled import head_sampled_divergence, sampled_divergence
from opsd_rollout.opsd.served import ServedTeacher, refuse_full_cache
from opsd_rollout.opsd.targets import response_targets
from opsd_rollout.opsd.teacher import TeacherCacheBuffers, TeacherCacheConfig, build_teacher_cache
from opsd_rollout.profiling import Clock, PeakMemory, RolloutProfile, StageRecorder, timed_eval
from opsd_rollout.profiling.profile import byte_size, json_safe


logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepProfile:
    """Where one OPSD step's time went (ms), with the rollout's own profile nested."""

    rollout: RolloutProfile | None
    """The rollout's full profile (``None`` if the rollout was not profiled)."""
    eval_ms: float
    """``engine.eval()`` before the rollout."""
    train_ms: float
    """``engine.train()`` after it."""
    rollout_ms: float
    """The rollout call (its profile's ``total_ms`` plus validation)."""
    teacher_forward_ms: float
    """The in-process teacher's forwards and LM-head chunks (0 with a served teacher: see ``teacher_wait_ms``)."""
    cache_write_ms: float
    """Copying teacher logits (or their top-k) to the host cache (the in-process teacher's)."""
    teacher_wait_ms: float = 0.0
    """A served teacher: the step blocked on its answer, after the student's forward (the latency not hidden)."""
    student_forward_ms: float
    loss_ms: float
    backward_ms: float
    optimizer_ms: float
    total_ms: float
    rollout_share: float
    """(eval + rollout + train) / total: what the step spends producing its samples."""
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    """Per step part: accelerator peak allocated on CUDA, process peak RSS on CPU."""
    part_start_ms: dict[str, float] = field(default_factory=dict)
    """Per step part: its start, from the start of the step (for traces)."""
    response_tokens: int = 0
    teacher_cache_bytes: int = 0
    teacher_cache_budget_bytes: int = 0
    """The host-memory budget the teacher cache was checked against."""
    teacher_cache_mode: str = "full"
    """The cache that was built: ``full`` or ``topk`` (also when ``over_budget="topk"`` switched to it)."""
    fused_loss: bool = False
    """Whether the loss ran fused with the student's LM head (``DivergenceConfig.fused``)."""
    teacher_parameter_bytes: int = 0
    """The teacher's parameter bytes held on this rank: all of them, or its partition under ZeRO-3."""
    loss: float = 0.0
    grad_norm: float | None = None
    """The 2-norm of the gradient the optimizer stepped on, before clipping, when asked for
    (``opsd_step(..., grad_norm=True)``) and the step was an accumulation boundary; else ``None``."""
    teacher_latency_ms: float = 0.0
    """A served teacher: its requests, from sending to the cache written. In flight while the step works (the
    student's forward; in ``train`` with accumulation, the next micro-batches' rollouts too): not a part of
    ``total_ms``, whose parts hold only ``teacher_wait_ms``, the latency left exposed."""

    @property
    def teacher_hidden_share(self) -> float | None:
        """The share of a served teacher's latency the step's own work hid, ``1 - wait / latency``; ``None`` with
        an in-process teacher."""
        return hidden_share(self.teacher_wait_ms, self.teacher_latency_ms)

    @property
    def tokens_per_second(self) -> float:
        """Response tokens trained on per second of step."""
        return self.response_tokens / (self.total_ms / 1e3) if self.total_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """One flat, JSON-safe record with stable names, for a JSON line or a scalar logger: the step's fields,
        ``tokens_per_second``, ``peak_memory_bytes`` (the largest part's) and ``peak_<part>_bytes``,
        ``<part>_start_ms``, and the rollout profile's record under ``rollout/`` (absent when it was not profiled)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("rollout", "peak_memory_bytes", "part_start_ms")}
        data["tokens_per_second"] = self.tokens_per_second
        data["teacher_hidden_share"] = self.teacher_hidden_share
        data["peak_memory_bytes"] = max(self.peak_memory_bytes.values(), default=0)
        data.update({f"peak_{part}_bytes": peak for part, peak in self.peak_memory_bytes.items()})
        data.update({f"{part}_start_ms": start for part, start in self.part_start_ms.items()})
        data = json_safe(data)
        if self.rollout is not None:
            data.update({f"rollout/{key}": value for key, value in self.rollout.to_dict().items()})
        return data

    def __str__(self) -> str:
        """A few lines for a person: loss, the parts in ms, throughput and memory, then the rollout's first line."""
        parts = ", ".join(f"{label(name)} {getattr(self, name):.1f}" for name in STEP_STAGES)
        peak = byte_size(max(self.peak_memory_bytes.values(), default=0))
        lines = [f"StepProfile: loss {self.loss:.4f}, {self.total_ms:.1f} ms, rollout share {self.rollout_share:.0%}",
                 f"  parts ms: {parts}",
                 f"  {self.response_tokens} response tokens, {self.tokens_per_second:.1f} tok/s; peak memory {peak}; "
                 f"teacher cache {self.teacher_cache_mode} {byte_size(self.teacher_cache_bytes)}; "
                 f"fused loss {'on' if self.fused_loss else 'off'}"]
        if self.rollout is not None:
            lines.append("  rollout: " + str(self.rollout).splitlines()[0].removeprefix("RolloutProfile: "))
        return "\n".join(lines)


class StepParts:
    """The step's parts as stages of one deferred recorder (marks read once, at the end), each with the peak
    memory it reached."""

    def __init__(self, recorder: StageRecorder, device: torch.device):
        self.recorder, self.device = recorder, device
        self.peaks: dict[str, int] = {}

    def run(self, name: str, fn, *args, **kwargs):
        memory = PeakMemory(self.device)
        memory.start()
        with self.recorder.stage(name):
            result = fn(*args, **kwargs)
        self.peaks[name] = memory.stop()[0]
        return result

    def times(self) -> tuple[dict[str, float], dict[str, float]]:
        """Once the step is over: each stage's ms, and each step part's start from the start of the step."""
        resolved = self.recorder.resolve()
        return resolved.stages, {span.name: span.start_ms for span in resolved.spans if span.name in STEP_PARTS}


def optimizer_step(engine: Any, *, grad_norm: bool = False) -> Any:
    """``engine.step()``; with ``grad_norm``, at an accumulation boundary (the call that steps the optimizer), the
    2-norm of the gradient it stepped on, before clipping: DeepSpeed's own (ZeRO 1-3, bf16 and fp16 keep it), or at
    ZeRO-0 in float32, where DeepSpeed keeps none, taken here before the step from the gradients the backwards left
    (accumulated over the micro-batches, each scaled by 1 / ``gradient_accumulation_steps``, and averaged over the
    ranks by the boundary's backward: alike on every rank). A number or a 0-d tensor (read it once the step's marks
    are resolved, not to sync mid-step); ``None`` between boundaries and without ``grad_norm``."""
    boundary = grad_norm and engine.is_gradient_accumulation_boundary()
    ours = None
    if boundary and engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
        ours = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    engine.step()
    if not boundary:
        return None
    theirs = engine.get_global_grad_norm()
    return ours if theirs is None else theirs


def student_logits(engine: Any, targets) -> torch.Tensor:
    """The student's logits over the response window [N, R, V]: its whole forward (an OPSD step's unfused loss and
    the SFT step's cross-entropy both read them), positions counted from each row's first real token."""
    out = engine(input_ids=targets.input_ids, attention_mask=targets.attention_mask,
                 position_ids=position_ids(targets.attention_mask))
    return out.logits[:, targets.window]  # [N, R, V]


def _student_hidden(engine: Any, targets) -> torch.Tensor:
    """The student's final hidden states over the response window [N, R, H]: its forward with the LM head run on
    one position only (the fused loss runs the head itself)."""
    out = engine(input_ids=targets.input_ids, attention_mask=targets.attention_mask,
                 position_ids=position_ids(targets.attention_mask), output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1][:, targets.window]


@dataclass
class StepState:
    """What ``opsd_step`` keeps from one step to the next, held by the caller that runs the steps (train's loop, the
    benchmark's step scenario) so that nothing lives in the module: ``opsd_step`` makes a fresh one when given none,
    so a one-off step needs nothing, and a caller running many passes the same one to each."""

    buffers: TeacherCacheBuffers = field(default_factory=TeacherCacheBuffers)
    """The host memory the teacher cache is built in, reused from step to step (pinned on CUDA once, not every
    step)."""
    slots: dict[int, TeacherCacheBuffers] = field(default_factory=dict)
    """The buffers of the steps in flight beside the first (``start_step(..., slot=1, ...)``), each its own."""
    checked: "weakref.WeakSet[torch.nn.Module]" = field(default_factory=weakref.WeakSet)
    """Students already compared with their teacher: at their first step only, since afterwards their weights
    have moved (weak: a student dropped is forgotten)."""
    warned: "weakref.WeakSet[torch.nn.Module]" = field(default_factory=weakref.WeakSet)
    """Students already told that the fused loss cannot run on them: said once, not at every step."""


def _same_weights(student: torch.nn.Module, teacher: torch.nn.Module) -> bool:
    """Whether the teacher is the student: the same module, or an equal first parameter (cheap, and enough for
    what happens in practice: one preset loaded twice with one seed, one checkpoint loaded twice). Parameters of
    different shapes (one side a ZeRO-3 partition, the other whole), dtypes or devices say nothing."""
    if student is teacher:
        return True
    first = [next(m.parameters(), None) for m in (student, teacher)]
    if first[0] is None or first[1] is None:
        return False
    a, b = (getattr(p, "ds_tensor", p) for p in first)  # a ZeRO-3 parameter's data is its rank's partition
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.numel() > 0
            and torch.equal(a, b))


def _warn_if_teacher_is_student(student: torch.nn.Module, teacher: torch.nn.Module, state: StepState) -> None:
    """Once per student and ``state``, at its first step (afterwards its weights have moved): a teacher equal to
    the student makes every divergence 0, so the step would train nothing and report ``loss 0.0000`` without a
    word."""
    if student in state.checked:
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


def _student_forward(parts: "StepParts", engine: Any, targets, fused: bool) -> torch.Tensor:
    """The student's forward: its final hidden states over the response window [N, R, H] when the loss runs fused
    with the LM head, else its logits [N, R, V]."""
    return parts.run("student_forward", _student_hidden if fused else student_logits, engine, targets)


def _student_loss(parts: "StepParts", engine: Any, out: torch.Tensor, targets, cache, divergence: DivergenceConfig,
                  fused: bool, behaviour_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence's sum and count over ``out`` (``_student_forward``'s): fused with the LM head, or over
    whole logits."""
    if divergence.loss == "sampled_reverse_kl":
        if fused:
            return parts.run("loss", head_sampled_divergence, innermost_model(engine), out, targets.labels,
                             cache.values, targets.mask.to(out.device), divergence, behaviour_logp)
        return parts.run("loss", sampled_divergence, out, targets.labels, cache.values, targets.mask, divergence,
                         behaviour_logp)
    if fused:
        return parts.run("loss", head_divergence, innermost_model(engine), out, cache.stored,
                         targets.mask.to(out.device), divergence)
    return parts.run("loss", chunked_divergence, out, lambda s, e: cache.chunk(s, e, out.device),
                     targets.mask.to(out.device), divergence)


def token_mean(total: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss to backpropagate and the value to report (a device scalar, read after the step): the mean over
    every rank's valid tokens.

    DeepSpeed averages gradients over ranks, so each rank scales its sum by ``world_size / global count``;
    dividing by its own count would weight ranks with fewer valid tokens too much.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return total / count.clamp(min=1), total.detach() / count.clamp(min=1)
    both = torch.stack([total.detach().float(), count.float()]).to(total.device)
    dist.all_reduce(both)
    global_count = both[1].clamp(min=1)
    return total * dist.get_world_size() / global_count, both[0] / global_count


def resident_bytes(module: Any) -> int:
    """Bytes of ``module``'s parameters held on this rank (a ZeRO-3 parameter's own partition)."""
    held = (getattr(p, "ds_tensor", p) for p in innermost_model(module).parameters())
    return sum(t.numel() * t.element_size() for t in held)


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


def opsd_step(student_engine: Any, teacher: Any, rollout: Any, request: Any, sampling: Any, *,
              divergence: DivergenceConfig | None = None, teacher_cache: TeacherCacheConfig | None = None,
              behaviour_logprobs: torch.Tensor | None = None, state: StepState | None = None,
              rollout_seed: int | None = None, grad_norm: bool = False) -> StepProfile:
    """Run one step on ``student_engine`` (a DeepSpeed engine, ZeRO 0-3) and return its profile:
    ``start_step(...).finish()``.

    ``teacher``: a model (plain, or a DeepSpeed engine, ZeRO-3 partitioned or not) run here into the host cache, or
    a ``ServedTeacher`` (``opsd/served.py``) whose server sends the cache's log-probabilities (``topk`` or
    ``sampled`` caches; ``full`` is refused before any work), its request in flight while the student's forward
    runs (``ServedTeacher(overlap=True)``, the default).

    ``behaviour_logprobs`` [N, R]: with ``sampled_reverse_kl``, the log-probabilities of the sampled tokens under
    the policy that sampled them, for an off-policy update (a second step on one rollout, a generation buffer);
    ``None``: on-policy, the student as it is now. ``state``: what a caller running many steps keeps across them
    (the teacher cache's host buffers, the checks and warnings said once); ``None``: a fresh one, for one step.
    ``rollout_seed``: handed to ``rollout.generate(..., seed=)`` (ours takes it: the samples a function of it alone,
    what a trainer that resumes needs); ``None``: the rollout is called as DeepSpeed's is. ``grad_norm``: report the
    gradient norm of the optimizer step this call completes (``StepProfile.grad_norm``; at ZeRO-0 a pass over the
    gradients, inside the ``optimizer`` part)."""
    return start_step(student_engine, teacher, rollout, request, sampling, divergence=divergence,
                      teacher_cache=teacher_cache, behaviour_logprobs=behaviour_logprobs, state=state,
                      rollout_seed=rollout_seed, grad_norm=grad_norm).finish()


def start_step(student_engine: Any, teacher: Any, rollout: Any, request: Any, sampling: Any, *,
               divergence: DivergenceConfig | None = None, teacher_cache: TeacherCacheConfig | None = None,
               behaviour_logprobs: torch.Tensor | None = None, state: StepState | None = None,
               rollout_seed: int | None = None, grad_norm: bool = False, slot: int = 0) -> "StepInFlight":
    """The first half of ``opsd_step`` (its arguments), up to the teacher: the checks, the rollout, and the teacher's
    cache, built here by an in-process teacher, or asked of a served one in the background (``overlap``) and left
    in flight. ``.finish()`` is the rest: the student's forward, the wait for a served teacher, the loss, backward
    and the optimizer.

    Between the two halves the caller may work on something that does not change the student's weights: ``train``
    rolls out its next micro-batches there, so that each one's teacher request is in flight behind the next one's
    rollout. Steps in flight at once each take their own ``slot`` (0, 1, ...): the host buffers their teacher
    caches are built in."""
    state = state if state is not None else StepState()
    divergence = divergence or DivergenceConfig()
    teacher_cache = teacher_cache or TeacherCacheConfig()
    check_pairing(divergence, teacher_cache)
    served = isinstance(teacher, ServedTeacher)
    student_vocab = text_config(innermost_model(student_engine).config).vocab_size
    if served:  # before any work: the cache it can give, the server, its model, tokenizer and vocabulary
        refuse_full_cache(teacher_cache)
        teacher.connect(student_vocab)
    else:
        teacher_vocab = text_config(innermost_model(teacher).config).vocab_size
        if student_vocab != teacher_vocab:  # before any work: a partitioned teacher would fail inside its gathers
            raise ValueError(f"the teacher's vocabulary ({teacher_vocab:,} tokens) differs from the student's "
                             f"({student_vocab:,}): distillation compares their distributions token by token")
        _warn_if_teacher_is_student(innermost_model(student_engine), innermost_model(teacher), state)
    fused = _fuses(innermost_model(student_engine), divergence, state)
    device = torch.device(student_engine.device)
    recorder = StageRecorder(Clock(device), time_forwards=False)
    step = StepInFlight(engine=student_engine, teacher=teacher, rollout=rollout, divergence=divergence,
                        behaviour_logprobs=behaviour_logprobs, grad_norm=grad_norm, fused=fused,
                        recorder=recorder, parts=StepParts(recorder, device))
    buffers = state.buffers if slot == 0 else state.slots.setdefault(slot, TeacherCacheBuffers())
    with recorder.stage("total"):
        with timed_eval(student_engine, device, train_after=True) as switch:
            seeded = {} if rollout_seed is None else {"seed": rollout_seed}
            batch = step.parts.run("rollout", rollout.generate, request, sampling, **seeded)
        step.switch, step.targets = switch, response_targets(batch)
        if served:
            step.pending = teacher.submit(step.targets, teacher_cache, buffers=buffers, pin=device.type == "cuda")
            if not teacher.overlap:
                step.wait()
        else:
            step.cache = step.parts.run("teacher", build_teacher_cache, teacher, step.targets, teacher_cache,
                                        recorder=recorder, buffers=buffers)
    return step


@dataclass(kw_only=True, eq=False)
class StepInFlight:
    """An OPSD step between its halves (``start_step``): its rollout done, its teacher cache built or asked for."""

    engine: Any
    teacher: Any
    rollout: Any
    divergence: DivergenceConfig
    behaviour_logprobs: torch.Tensor | None
    grad_norm: bool
    fused: bool
    recorder: StageRecorder
    parts: StepParts
    switch: Any = None
    targets: Any = None
    cache: Any = None
    """The teacher's cache, once it is here."""
    pending: Any = None
    """A served teacher's answer in flight (a ``ServedTeacher.submit`` future)."""

    def wait(self) -> None:
        """The served teacher's cache, waited for as the step's ``teacher`` part (the latency not hidden)."""
        if self.cache is None:
            self.cache = self.parts.run("teacher", self.pending.result)

    def finish(self) -> StepProfile:
        """The rest of the step, then its profile: the student's forward (a served teacher's request in flight
        during it), the teacher's cache, the loss, backward and the optimizer."""
        parts, targets = self.parts, self.targets
        with self.recorder.stage("total"):
            out = _student_forward(parts, self.engine, targets, self.fused)
            self.wait()
            total, count = _student_loss(parts, self.engine, out, targets, self.cache, self.divergence, self.fused,
                                         self.behaviour_logprobs)
            loss, reported = token_mean(total, count)
            parts.run("backward", self.engine.backward, loss)
            norm = parts.run("optimizer", optimizer_step, self.engine, grad_norm=self.grad_norm)
        return self._profile(reported, norm)

    def _profile(self, reported: torch.Tensor, norm: Any) -> StepProfile:
        ms, starts = self.parts.times()
        switch, cache, served = self.switch, self.cache, self.pending is not None
        producing = switch.eval_ms + ms["rollout"] + (switch.train_ms or 0.0)
        return StepProfile(
            rollout=self.rollout.get_last_profile(), eval_ms=switch.eval_ms, train_ms=switch.train_ms or 0.0,
            rollout_ms=ms["rollout"], teacher_forward_ms=ms.get("teacher_forward", 0.0),
            cache_write_ms=ms.get("cache_write", 0.0), teacher_wait_ms=ms["teacher"] if served else 0.0,
            student_forward_ms=ms["student_forward"], loss_ms=ms["loss"], backward_ms=ms["backward"],
            optimizer_ms=ms["optimizer"], total_ms=ms["total"],
            rollout_share=producing / ms["total"] if ms["total"] > 0 else 0.0,
            peak_memory_bytes=dict(self.parts.peaks), part_start_ms=starts, response_tokens=self.targets.tokens,
            teacher_cache_bytes=cache.nbytes, teacher_cache_budget_bytes=cache.budget_bytes,
            teacher_cache_mode=cache.mode, fused_loss=self.fused, loss=float(reported),
            teacher_parameter_bytes=0 if served else resident_bytes(self.teacher),
            grad_norm=None if norm is None else float(norm),
            teacher_latency_ms=self.pending.latency_ms if served else 0.0)
