"""``train``: on-policy distillation from a prompt file to a checkpoint, a loop over ``opsd_step``.

One optimizer step is DeepSpeed's ``gradient_accumulation_steps`` micro-batches, each with its own rollout. With
``lmbda`` (TRL's GKD): that fraction of the steps trains on the student's own samples, the rest on the teacher's
samples (supervised KD) or, when the data has them, on the references. ``objective="sft"`` trains on the
references with cross-entropy instead (how a teacher that knows the data is made). Everything random is a
function of the seed and the micro-batch's index, so ``resume`` continues exactly where a run stopped.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from opsd_rollout.files import write_text_atomic
from opsd_rollout.opsd.nonfinite import NONFINITE_PARTS
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.opsd.in_flight import StepInFlight
from opsd_rollout.opsd.step import OPSDStep
from opsd_rollout.opsd.step_profile import StepProfile
from opsd_rollout.quiet import quiet
from opsd_rollout.seeding import seed_of, seeded
from opsd_rollout.train.best import BEST_DIR, NOTE, Best
from opsd_rollout.train.checkpoint import (find_checkpoint, guard_writes, latest_tag, prune_checkpoints, save_merged,
                                           save_model, save_published)
from opsd_rollout.train.config import TrainConfig
from opsd_rollout.train.data import Encoder, Example, batch_indices
from opsd_rollout.train.faults import (Agreement, CheckpointNotWritten, StopSignals, TooManySkipped,
                                       stopped_by)
from opsd_rollout.train.inputs import run_inputs
from opsd_rollout.train.lora import trainable_parameters
from opsd_rollout.train.precision import place_teachers
from opsd_rollout.train.report import MetricsLog, Progress, monitor_events, plot_eval, step_record
from opsd_rollout.train.run_evaluation import RunEvaluation
from opsd_rollout.train.setup import Models, build_student_engine
from opsd_rollout.train.sft import sft_step
from opsd_rollout.train.task_eval import Problem
from opsd_rollout.train.teacher_spec import described

logger = logging.getLogger(__name__)

@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    """The last optimizer step reached."""
    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Path | None = None
    model_dir: Path | None = None
    plot: Path | None = None
    merged_dir: Path | None = None
    """A LoRA run's merged model (``--merge-lora``): the adapters folded into the base weights."""
    best: Any = None
    """With ``save_best``: the best evaluation (``best.Best``: its step and value), whose model is in ``best/``."""
    interrupted: bool = False
    """Stopped by Ctrl-C or a stop signal (``signal``), with the checkpoint of its last completed step."""
    signal: int | None = None
    """The stop signal's number (SIGINT for Ctrl-C)."""
    stopped: str | None = None
    """Why the run stopped before its last step other than a signal, in a line (``fault`` names the kind); a
    checkpoint of the last completed step was saved (but when the fault is that one could not be), and ``--resume``
    continues from it."""
    fault: str | None = None
    """``teacher`` (a served teacher failed), ``checkpoint`` (a checkpoint not written; the latest is the one
    before), ``skipped`` (too many non-finite steps in a row); ``faults.exit_status`` maps it to an exit status."""

    def eval_curve(self, name: str = "eval_reverse_kl") -> list[tuple[int, float]]:
        return [(r["step"], r[name]) for r in self.records if name in r]


class _Fixed:
    """A "rollout" that returns a batch made beforehand (the references), for ``OPSDStep.start(rollout=...)``."""

    def __init__(self, batch: Any):
        self.batch = batch

    def generate(self, request: Any, sampling: Any, seed: int | None = None) -> Any:
        return self.batch

    def get_last_profile(self) -> None:
        return None


def model_label(model: str) -> str:
    """A model's name for people: a preset's, or a checkpoint directory's (its parent's when it is ``model/``)."""
    path = Path(str(model))
    return path.parent.name if path.name == "model" and path.parent.name else path.name


class _Run:
    """One training run's state: models, engine, data, logs."""

    def __init__(self, config: TrainConfig, models: Models, train: list[Example], held_out: list[Example],
                 problems: list[Problem] | None = None):
        from opsd_rollout.distributed import host_group, rank_info
        from opsd_rollout.rollout import HybridEngineRollout

        self.config, self.models, self.train = config, models, train
        self.labelled = [e for e in train if e.reference is not None]
        """What SFT trains on (a warm start's labelled set)."""
        self.out = Path(config.run_dir)
        self.checkpoints = self.out / "checkpoints"
        self.engine = build_student_engine(config, models.student)
        self.rank = rank_info()  # once the group exists
        self.signals = StopSignals()
        self.agreement = Agreement(self.signals, self.rank.rank, self.rank.world_size, host_group())
        """Where every rank decides alike, once a micro-batch, whether to go on (``train.faults``)."""
        guard_writes(self.engine)  # a failed checkpoint write stops every rank alike, never hangs one
        self.accumulation = int(self.engine.gradient_accumulation_steps())
        self.device = torch.device(self.engine.device)
        self.encoder = Encoder(models.tokenizer, max_prompt_tokens=models.max_prompt_tokens,
                               max_reference_tokens=config.sampling.max_new_tokens)
        merged = config.rollout.merge_adapters or (config.lora.enabled and config.lora.merge_rollouts)
        self.rollout = HybridEngineRollout(self.engine, models.tokenizer, config.rollout.replace(merge_adapters=merged))
        self.teacher = place_teachers(models.teacher, {spec.name: spec.zero_stage for spec in config.teachers},
                                      self.engine)  # where the student runs, in its dtype
        self.reprompt = any(spec.context is not None for spec in config.teachers)
        """The teachers see their own prompts (a context: the reference), built from each example's."""
        self.references = config.off_policy == "references" or (
            config.off_policy == "auto" and all(e.reference is not None for e in train))
        self.teacher_rollout = (HybridEngineRollout(self.teacher, models.tokenizer, config.rollout)
                                if self.teacher is not None and config.lmbda < 1 and not self.references else None)
        self.opsd = (OPSDStep(engine=self.engine, teacher=self.teacher, rollout=self.rollout, sampling=config.sampling,
                              divergence=config.divergence, teacher_cache=config.cache, grad_norm=True)
                     if config.objective == "opsd" else None)
        """The run's OPSD step, built once (its teachers checked, its host buffers kept across steps); each
        micro-batch calls it with its request and seed."""
        self.servers = [t for t in (self.teacher.values() if config.several else [self.teacher])
                        if isinstance(t, ServedTeacher)]
        self.ahead = (bool(self.servers) and all(s.overlap for s in self.servers) and self.accumulation > 1
                      and config.objective == "opsd")
        """Roll out a whole optimizer step's micro-batches before their updates (the weights they sample from are
        the same until the step): each served teacher request is then in flight behind the next rollout."""
        self.global_step = 0
        self.skipped_in_a_row = 0
        """Optimizer steps skipped one after another up to now (a finite one sets it back to 0)."""
        if config.resume is not None:  # a LoRA run's checkpoints hold the adapters alone: the base is the student's
            _, client = self.engine.load_checkpoint(str(find_checkpoint(config.resume)),
                                                    load_module_strict=not config.lora.enabled)
            state = (client or {}).get("train_state", {})
            self.global_step, self.skipped_in_a_row = int(state.get("step", 0)), int(state.get("skipped_in_a_row", 0))
        self.log = MetricsLog(self.out / "metrics.jsonl", resume_step=self.global_step if config.resume else None)
        if self.rank.rank == 0:
            write_text_atomic(self.out / "train_config.json", json.dumps(config.to_dict(), indent=2))
        self.saved_at: int | None = self.global_step if config.resume else None
        self.best = Best.of(config.save_best, self.out) if config.save_best else None
        self.evaluator = RunEvaluation(config=config, models=models, engine=self.engine, rollout=self.rollout,
                                       teacher=self.teacher, encoder=self.encoder, held_out=held_out,
                                       problems=problems, rank=self.rank, reprompt=self.reprompt)

    # ---- one optimizer step --------------------------------------------------------------------------------

    def examples(self, index: int, pool: list[Example] | None = None) -> list[Example]:
        """Micro-batch ``index``'s examples of ``pool`` (default: the training examples), this rank's share."""
        pool = self.train if pool is None else pool
        picked = batch_indices(len(pool), self.config.prompts_per_micro_batch, self.config.seed,
                               index * self.rank.world_size + self.rank.rank)
        return [pool[i] for i in picked]

    def sft_micro_batch(self, index: int) -> StepProfile:
        """Micro-batch ``index`` of SFT, done: cross-entropy on its references (a warm start's: the labelled
        examples')."""
        self.agreement.check()  # a stop signal on any rank stops every rank here
        with seeded(seed_of(self.config.seed, index), self.device):  # dropout's random numbers
            batch = self.encoder.with_references(self.examples(index, self.labelled), self.device)
            return sft_step(self.engine, batch, grad_norm=True)

    def warming(self, number: int) -> bool:
        """Whether optimizer step ``number`` is SFT: every step of ``objective="sft"``, a warm start's first ones."""
        return self.config.objective == "sft" or number <= self.config.warmup_sft_steps

    def set_phase_lr(self, number: int) -> None:
        """The phase's learning rate on the built config's optimizer (``warmup_sft_lr`` during a warm start)."""
        config = self.config
        if config.warmup_sft_lr is None or self.engine.lr_scheduler is not None:
            return
        lr = config.warmup_sft_lr if self.warming(number) else config.optimization.lr
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def start_micro_batch(self, index: int, on_policy: bool, slot: int = 0) -> StepInFlight:
        """Micro-batch ``index`` of distillation, begun: its samples (the student's own, or off-policy the
        references or the teacher's), the teachers' caches built or asked for."""
        config, examples = self.config, self.examples(index)
        rollout = None  # the student's own samples, the run's rollout
        if not on_policy:
            rollout = (_Fixed(self.encoder.with_references(examples, self.device, config.sampling.n_samples_per_prompt))
                       if self.references else self.teacher_rollout)
        default = cast(str, config.default_teacher_name)  # a name with several teachers; unused with one
        routes = [e.teacher or default for e in examples] if config.several else None
        teacher_request = self.encoder.teacher_request(examples, self.device) if self.reprompt else None
        if self.opsd is None:
            raise RuntimeError(f"objective {config.objective!r} runs no distillation step")
        return self.opsd.start(self.encoder.request(examples, self.device), seed=seed_of(config.seed, index),
                               routes=routes, rollout=rollout, teacher_request=teacher_request, slot=slot)

    def train_step(self, number: int) -> dict[str, Any]:
        """Optimizer step ``number`` (counted from 1): its micro-batches, and its record."""
        config, warming = self.config, self.warming(number)
        on_policy = not warming and bool(
            np.random.default_rng(seed_of(config.seed, number, 1)).random() < config.lmbda)
        self.set_phase_lr(number)
        start, skipped = time.perf_counter(), self.engine.skipped_steps
        first = (number - 1) * self.accumulation
        indices = range(first, first + self.accumulation)
        agree = self.agreement.check  # every rank's teachers answered, and no stop signal: before each loss
        if warming:
            profiles = [self.sft_micro_batch(i) for i in indices]
        elif self.ahead:  # every rollout first, each teacher request in flight behind the next one's rollout
            try:
                in_flight = [self.start_micro_batch(i, on_policy, slot=i - first) for i in indices]
                profiles = [each.finish(agree) for each in in_flight]
            except BaseException:  # the run stops: the answers still on their way are dropped
                for server in self.servers:
                    server.close()
                raise
        else:
            profiles = [self.start_micro_batch(i, on_policy).finish(agree) for i in indices]
        step_ms = (time.perf_counter() - start) * 1e3
        divergence = "cross_entropy" if warming else config.divergence.loss
        drawn = number * self.accumulation * config.prompts_per_micro_batch * self.rank.world_size  # every rank's
        teacher, context = described(config.teachers) if not warming else (None, None)
        record = step_record(number, profiles, step_ms=step_ms, learning_rate=float(self.engine.get_lr()[0]),
                             on_policy=None if warming else on_policy, divergence=divergence,
                             epoch=drawn / len(self.train), teacher=teacher, teacher_context=context)
        return self.count_skipped(record, profiles, self.engine.skipped_steps > skipped)

    def count_skipped(self, record: dict[str, Any], profiles: list[StepProfile], skipped: bool) -> dict[str, Any]:
        """The record with the run's skipped steps so far (``skipped_steps``: DeepSpeed's count, kept by its
        checkpoints) and, for a step skipped (a non-finite loss or gradient on some rank: no weight moved), the part
        that went non-finite first on any rank (``nonfinite``: one more agreement, on that step alone)."""
        record["skipped_steps"] = int(self.engine.skipped_steps)
        if not skipped:
            self.skipped_in_a_row = 0
            return record
        self.skipped_in_a_row += 1
        local = max((NONFINITE_PARTS.index(p.nonfinite) for p in profiles if p.nonfinite), default=0)
        record["nonfinite"] = NONFINITE_PARTS[self.agreement.values([local])[0]]
        return record

    def check_skipped(self, record: dict[str, Any]) -> None:
        """``TooManySkipped`` once ``max_skipped_steps`` steps in a row were skipped (alike on every rank)."""
        limit = self.config.max_skipped_steps
        if self.skipped_in_a_row >= limit:
            good = self.global_step - self.skipped_in_a_row
            raise TooManySkipped(f"{self.skipped_in_a_row} optimizer steps in a row skipped (--max-skipped-steps "
                                 f"{limit}), the last for a non-finite {record['nonfinite']}: the weights are step "
                                 f"{good}'s, the last good one")

    # ---- the loop --------------------------------------------------------------------------------------------

    def record(self, record: dict[str, Any], progress: Progress) -> None:
        if self.rank.rank == 0:
            self.log.write(record)
            progress.show(record)
        if self.engine.monitor.enabled:
            self.engine.monitor.write_events(monitor_events(record))
        self.keep_best(record)

    def keep_best(self, record: dict[str, Any]) -> None:
        """With ``save_best``: the student written to ``best/`` when ``record``'s evaluation is the best so far
        (every rank alike: the figures are reduced over them, and under ZeRO-3 the save gathers)."""
        if self.best is not None and self.best.improved(record):
            save_model(self.engine, self.models.tokenizer, self.out / BEST_DIR, self.rank,
                       files={NOTE: self.best.note()})

    def save(self) -> Path:
        config = self.config.to_dict()
        config["optimization"].pop("deepspeed")  # the engine's own checkpoint holds what DeepSpeed ran with
        state = {"step": self.global_step, "seed": self.config.seed, "micro_batches": self.global_step * self.accumulation,
                 "skipped_in_a_row": self.skipped_in_a_row, "config": config}
        saved = save_published(self.engine, self.checkpoints, f"step{self.global_step}", {"train_state": state},
                               rank=self.rank.rank, agree=self.agreement.values, first_text=self.agreement.first_text,
                               exclude_frozen_parameters=self.config.lora.enabled)
        self.saved_at = self.global_step
        self.prune()
        return saved

    def steps(self, result: TrainResult) -> None:
        """The evaluation at step 0 (a new run), then the steps left, each recorded, evaluated and saved when due."""
        config = self.config
        progress = Progress(config.steps, self.global_step, enabled=config.progress)
        if self.global_step == 0:
            trainable, _ = trainable_parameters(self.engine.module)
            self.record({"step": 0, "trainable_parameters": trainable, **self.evaluator.evaluate(teacher=True)}, progress)
        trained_s = next((r["time/steps_s"] for r in reversed(self.log.records) if "time/steps_s" in r), 0.0)
        while self.global_step < config.steps:
            record = self.train_step(self.global_step + 1)
            self.global_step += 1
            trained_s += record["time/step_ms"] / 1e3
            record["time/steps_s"] = trained_s  # the optimizer steps' wall time so far, evaluations apart
            try:
                if self.global_step % config.eval_every == 0 or self.global_step == config.steps:
                    record.update(self.evaluator.evaluate())
            finally:  # a step taken is a step recorded, even if Ctrl-C stops its evaluation
                self.record(record, progress)
            self.check_skipped(record)
            if config.save_every and self.global_step % config.save_every == 0:
                result.checkpoint = self.save()

    def prune(self) -> None:
        """With ``save_total_limit``: the oldest checkpoints removed past it, never the latest or the best's."""
        if self.config.save_total_limit and self.rank.rank == 0:
            best = {f"step{self.best.step}"} if self.best is not None and self.best.step is not None else set()
            prune_checkpoints(self.checkpoints, self.config.save_total_limit, keep=best)

    def run(self) -> TrainResult:
        config = self.config
        result = TrainResult(self.out, self.global_step)
        with self.signals:  # a stop signal is a flag from here on: no step or checkpoint is cut short by one
            try:
                self.steps(result)
            except BaseException as error:  # noqa: BLE001 - a stop every rank agreed on keeps what is done
                if not stopped_by(error, result):
                    raise
            finally:
                for server in self.servers:
                    server.close()
            self.last_checkpoint(result)
            result.steps, result.records, result.best = self.global_step, list(self.log.records), self.best
            if not result.interrupted and result.stopped is None:
                result.model_dir = save_model(self.engine, self.models.tokenizer, self.out / "model", self.rank)
                if config.lora.merge and self.rank.rank == 0:
                    result.merged_dir = save_merged(result.model_dir, self.out / "merged")
        if self.rank.rank == 0:
            teacher = ", ".join(spec.name if config.several else spec.source if spec.served else model_label(spec.source)
                                for spec in config.teachers)
            title = (f"{model_label(config.student)} distilled from {teacher}" if config.objective == "opsd"
                     else f"{model_label(config.student)} trained by SFT")
            result.plot = plot_eval(result.records, self.out / "eval.png", title)
        return result

    def last_checkpoint(self, result: TrainResult) -> None:
        """The checkpoint of the last completed step, saved unless it is already (or a checkpoint just failed:
        ``result.checkpoint`` is then the latest one, the one before)."""
        if result.fault == "checkpoint":
            tag = latest_tag(self.out)
            result.checkpoint = None if tag is None else self.checkpoints / tag
        elif self.saved_at != self.global_step:
            try:
                result.checkpoint = self.save()
            except CheckpointNotWritten as error:  # the last one not written: say so, keep the one before
                stopped_by(error, result)
                self.last_checkpoint(result)
        else:
            result.checkpoint = self.checkpoints / f"step{self.global_step}"


def train(config: TrainConfig) -> TrainResult:
    """Run ``config``: every input checked before any model work, then the loop. Ctrl-C or a stop signal (SIGTERM,
    SIGUSR1) saves the checkpoint of the last completed step and returns with ``interrupted`` set; a served teacher
    that stops answering, a checkpoint that cannot be written, or too many non-finite steps in a row return with
    ``stopped`` and ``fault`` set, every rank alike (``train.faults``; docs/TRAINING.md, "Faults"). Quiet as the
    command line is, unless ``config.verbose`` (``opsd_rollout.quiet``: DeepSpeed's CPU-fallback line,
    transformers' progress bars)."""
    with quiet(config.verbose):
        return _Run(config, *run_inputs(config)).run()
