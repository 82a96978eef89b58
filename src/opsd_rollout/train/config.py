"""``TrainConfig``: a training run, as sections that belong to the code that uses them.

The run's own fields (models, data, how long, when to evaluate and save) sit at the top; the rest are the owners'
configs, nested, never restated: the rollouts' sampling is DeepSpeed's ``SamplingConfig`` (what ``generate``
takes), the student's rollout engine ``HybridEngineRolloutConfig``, the loss ``DivergenceConfig``, the teacher's
logit cache ``TeacherCacheConfig``, the optimisation (DeepSpeed config, ZeRO stage, learning rate,
accumulation) ``OptimizationConfig`` beside the code that builds the engine, and the student's LoRA adapters
``AdapterConfig``. ``TrainConfig.from_flat`` takes the command line's flat names (``sections.FLAT``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any, cast

from deepspeed.runtime.rollout.base import SamplingConfig

from opsd_rollout import checks
from opsd_rollout.opsd.divergence import DivergenceConfig
from opsd_rollout.placement import device_choice, dtype_choice
from opsd_rollout.opsd.served import refuse_full_cache
from opsd_rollout.opsd.step import check_pairing
from opsd_rollout.opsd.teacher import TeacherCacheConfig
from opsd_rollout.rollout.config import HybridEngineRolloutConfig
from opsd_rollout.rollout.validation import check_sampling
from opsd_rollout.train.best import check_save_best
from opsd_rollout.train.collective import check_collective_timeout, default_collective_timeout
from opsd_rollout.train.eval_file import TaskEvalConfig
from opsd_rollout.train.lora import AdapterConfig
from opsd_rollout.train.preflight import check_teacher_given
from opsd_rollout.train.run_dir import resumed_output_dir
from opsd_rollout.train.sections import (FLAT, OPTIONAL_SECTIONS, SECTIONS, default_cache_mode, is_flat,
                                         section_from_json)
from opsd_rollout.train.teacher_spec import FLAGS as TEACHER_FLAGS
from opsd_rollout.train.teacher_spec import (UNNAMED, TeacherSpec, as_specs, check_self, check_specs, routed,
                                             specs_from_flags)
from opsd_rollout.train.optimization import OptimizationConfig

OBJECTIVES = ("opsd", "sft")
OFF_POLICY = ("auto", "references", "teacher")
def _default_sampling() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=32, top_k=0)


def _profiled() -> HybridEngineRolloutConfig:
    return HybridEngineRolloutConfig(enable_profiling=True)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run; ``opsd-rollout train``'s flags map onto these fields and their sections' (``FLAT``)."""

    output_dir: str | None = None
    """Where ``metrics.jsonl``, ``checkpoints/``, ``model/`` (the final student, loadable as a local checkpoint)
    and ``eval.png`` go; ``None``: the run ``resume`` continues. A directory that holds another run is refused
    unless ``overwrite``."""
    student: str = "llama-tiny"
    """Preset name or local checkpoint directory."""
    teachers: tuple[TeacherSpec, ...] = ()
    """Who teaches (``train/teacher_spec.py``): each a ``TeacherSpec`` (a name, a preset, checkpoint directory or
    server address, and its own options), or just a source string; needed unless ``objective="sft"``. With several
    (or one given a name), each example goes to the teacher its ``teacher`` field names, or to ``default_teacher``."""
    default_teacher: str | None = None
    """With several teachers, the one of examples without a ``teacher`` field; ``None``: the one given without a name
    (``default``), else the first."""
    prompts: str | None = None
    """JSON lines (``prompt`` or chat ``messages``, optional ``reference``) or one prompt a line; ``None``: the
    built-in corpus (the Python documentation's topics, with references)."""
    task: str | None = None
    """A built-in task's examples instead of ``prompts``: ``arithmetic`` (addition word problems made from a seed,
    worked solutions ending in ``#### N`` as references, its own held-out problems; ``opsd_rollout.train.tasks``),
    or its harder setting ``arithmetic-5d`` (five-digit terms: six lines of work, where an early slip compounds)."""
    task_labelled: int | None = None
    """With ``task``: how many of its training problems keep their worked solution (the labelled set: what a warm
    start and SFT train on); the others are prompts alone, as in practice references are scarce and prompts
    plentiful. ``None``: every one keeps its solution."""
    task_unlabelled: int | None = None
    """With ``task``: how many prompts without a solution follow the labelled set (``None``: the rest of the task's
    training problems)."""
    warmup_sft_steps: int = 0
    """A warm start: the first this many optimizer steps are SFT on the examples that have a reference (the
    labelled set), then the run distils (``objective="opsd"``): the recipe practitioners run, a student that starts
    competent. The steps count in ``steps``; the record's ``divergence`` says ``cross_entropy`` during the warm
    start."""
    warmup_sft_lr: float | None = None
    """The warm start's learning rate (``None``: ``optimization.lr``), set on the built config's optimizer at each
    phase; a DeepSpeed config with its own scheduler keeps its schedule."""
    prompts_per_micro_batch: int = 8
    """Prompts of one micro-batch (each rank's, with several ranks); DeepSpeed's micro-batch is this x
    ``sampling.n_samples_per_prompt`` rows."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted (tokens); ``None``: the models' positions less ``sampling.max_new_tokens``. A longer
    prompt is refused before any work."""
    objective: str = "opsd"
    """``opsd``: distil the teacher; ``sft``: cross-entropy on the references."""
    lmbda: float = 1.0
    """Fraction of optimizer steps on the student's own samples (TRL's GKD ``lmbda``)."""
    off_policy: str = "auto"
    """What the other steps train on: ``references`` (the data's), ``teacher`` (the teacher's samples: supervised
    KD) or ``auto`` (the references when every example has one, else the teacher's samples)."""
    steps: int = 100
    """Optimizer steps to reach (counted from the start, also when resuming)."""
    seed: int = 0
    """Every random choice (data order, samples, ``lmbda``'s draws) is a function of it and the micro-batch."""
    eval_every: int = 10
    """Held-out evaluation every this many steps, and at step 0 and the last step."""
    eval_prompts: int = 64
    """Held-out prompts evaluated (the first of the held-out set)."""
    save_every: int | None = None
    """A checkpoint every this many steps (one is always written at the end and on Ctrl-C)."""
    save_total_limit: int | None = None
    """At most this many checkpoints kept in ``checkpoints/``, the oldest removed first, never the latest nor the
    best model's step (transformers' Trainer's ``save_total_limit``); ``None``: every one."""
    save_best: str | None = None
    """An evaluation figure (``eval_accuracy``, ``eval_reverse_kl``, ...; its direction ``metrics.TRAINING``'s
    ``lower_is_better``): after each evaluation better by it than every earlier one, the student is written to
    ``best/``, with ``best.json`` naming the step and the value. ``None``: no ``best/``."""
    resume: str | None = None
    """A previous run's output directory (or its ``checkpoints/``): continue from its latest checkpoint, into that
    directory unless ``output_dir`` names another."""
    overwrite: bool = False
    """Start over in an ``output_dir`` that holds a run: what that run wrote is removed first (``run_dir.WRITTEN``),
    never mixed with the new one."""
    max_skipped_steps: int = 20
    """Optimizer steps skipped in a row (a non-finite loss or gradient: no weight moves) after which the run stops,
    with a checkpoint of its weights, the last good step's. 20: above the 17 a fresh fp16 run may skip in a row while
    DeepSpeed's loss scaler halves its scale from 2^16 to 1 (hysteresis 2), and few enough that a poisoned run
    stops within minutes."""
    collective_timeout: float | None = None
    """How long a collective waits for another rank before it fails (the process group's timeout): how soon the
    ranks left stop when one dies or hangs. Above the longest a rank may legitimately keep the others waiting: a
    served teacher's retries (``default_collective_timeout``). ``None``: ``default_collective_timeout``."""
    progress: bool = True
    """A progress line on the terminal."""
    verbose: bool = False
    """Let DeepSpeed's CPU-fallback line and transformers' progress bars (loading and saving checkpoints) show
    during the run; hidden by default, as the command line hides them without ``-v`` (``opsd_rollout.quiet``)."""
    dtype: str = "auto"
    """The run's precision, the student's and every teacher's: ``fp32``, ``bf16``, ``fp16``, or ``auto`` (the
    DeepSpeed config's bf16/fp16 section when it turns one on, else bf16 on a GPU and fp32 on the CPU). A DeepSpeed
    config that says otherwise is refused; one that says nothing gets the section."""
    device: str = "auto"
    """Where the student and its teachers run: ``auto`` (DeepSpeed's accelerator: a GPU when there is one, each
    rank its own), ``cpu``, ``cuda`` or ``cuda:N`` (one process)."""
    sampling: SamplingConfig = field(default_factory=_default_sampling)
    """The rollouts' sampling (the evaluation's too), as DeepSpeed's ``generate`` takes it: ``max_new_tokens``
    (response tokens per sample, and the references' length), ``n_samples_per_prompt``, ``temperature``,
    ``top_k`` (<= 0 disables it), ``top_p``."""
    rollout: HybridEngineRolloutConfig = field(default_factory=_profiled)
    """The student's rollout engine (and the teacher's, for supervised KD). Profiling on by default: the step
    record's ``time/rollout/*`` come from its profile, which costs no wait for the device (docs/PROFILING.md); off,
    the record has none of them."""
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    """The loss: ``jsd`` (generalized, with ``beta``), ``forward_kl`` or ``reverse_kl`` over the teacher's
    distribution, or ``sampled_reverse_kl`` (with ``estimator``) over its log-probability of each sampled token
    (on-policy only)."""
    teacher_cache: TeacherCacheConfig | None = None
    """The teacher's logits cached whole (``full``), their top-k (``topk``), or the sampled tokens'
    log-probabilities (``sampled``); ``None``: ``sampled`` for ``sampled_reverse_kl``, else ``full``. ``cache``
    reads the one in use."""
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    """The student's DeepSpeed config (the user's, or one built from ZeRO stage, learning rate and accumulation)."""
    task_eval: TaskEvalConfig | None = None
    """Task evaluation at every evaluation (an eval file with answers, a scorer, K samples per problem), the
    teacher scored once at step 0; its samples use ``sampling``'s temperature, top-k and top-p, and its completions
    ``task_eval.max_new_tokens`` (``None``: ``sampling.max_new_tokens``). ``None``: none."""
    gradient_checkpointing: bool = False
    """transformers' gradient checkpointing on the student (``gradient_checkpointing_enable``, non-reentrant): its
    layers' activations recomputed in the backward pass instead of kept, for long responses; under ZeRO 0-3 and
    LoRA alike. Rollouts are not affected (eval mode, cache on)."""
    lora: AdapterConfig = field(default_factory=AdapterConfig)
    """LoRA adapters on the student (PEFT's), the only parameters trained and optimised, when ``lora.rank`` is set;
    full fine-tuning otherwise."""

    def __post_init__(self) -> None:
        if self.output_dir is None:
            if self.resume is None:
                raise ValueError("output_dir: name the directory the run writes (--output-dir DIR), or resume a run "
                                 "into its own (--resume DIR)")
            object.__setattr__(self, "output_dir", resumed_output_dir(self.resume))
        checks.boolean("overwrite", self.overwrite)
        checks.boolean("verbose", self.verbose)
        checks.boolean("gradient_checkpointing", self.gradient_checkpointing)
        dtype_choice(self.dtype)
        device_choice(self.device)
        checks.choice("objective", self.objective, OBJECTIVES)
        object.__setattr__(self, "teachers", as_specs(self.teachers))
        if self.task is not None:
            _check_task(self)
        check_teacher_given(self.objective, self.teachers)
        check_specs(self.teachers, self.default_teacher)
        check_self(self.teachers, self.objective, self.lmbda, teacher_samples=self.off_policy == "teacher")
        if self.served:
            _check_served(self)
        for name, kind in SECTIONS.items():
            value = getattr(self, name)
            if not (value is None and name in OPTIONAL_SECTIONS) and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__}; got {type(value).__name__}")
        for name in ("steps", "prompts_per_micro_batch", "eval_every", "eval_prompts"):
            checks.integer(name, getattr(self, name))
        for name in ("save_every", "max_prompt_tokens", "save_total_limit", "task_labelled"):
            checks.integer(name, getattr(self, name), optional=True)
        checks.integer("max_skipped_steps", self.max_skipped_steps)
        check_collective_timeout(self.collective_timeout, self.teachers)
        checks.integer("task_unlabelled", self.task_unlabelled, minimum=0, optional=True)
        checks.integer("warmup_sft_steps", self.warmup_sft_steps, minimum=0)
        checks.number("warmup_sft_lr", self.warmup_sft_lr, above=0, optional=True)
        _check_warm_start(self)
        from opsd_rollout.train.tasks import check_split  # light

        check_split(self.task, self.task_labelled, self.task_unlabelled)
        for name in ("max_new_tokens", "n_samples_per_prompt"):
            checks.integer(f"sampling.{name}", getattr(self.sampling, name))
        check_sampling(self.sampling)
        checks.number("lmbda", self.lmbda, at_least=0, at_most=1)
        checks.choice("off_policy", self.off_policy, OFF_POLICY)
        check_pairing(self.divergence, self.cache)
        check_save_best(self.save_best, objective=self.objective, task_eval=self.task_eval is not None,
                        eval_samples=self.task_eval.samples if self.task_eval else 1,
                        teachers=tuple(spec.name for spec in self.teachers) if self.several else ())
        if self.task_eval is not None and self.task_eval.samples > 1 and self.sampling.temperature <= 0:
            raise ValueError(f"--eval-samples {self.task_eval.samples} samples at the run's temperature "
                             f"{self.sampling.temperature!r}, which is greedy: K identical completions say nothing of "
                             "pass@k; sample (--temperature > 0) or drop --eval-samples")
        if self.divergence.loss == "sampled_reverse_kl" and self.lmbda < 1 and self.objective == "opsd":
            raise ValueError("sampled_reverse_kl is an on-policy policy gradient over the student's own samples: "
                             f"lmbda must be 1 (got {self.lmbda!r})")

    @property
    def cache(self) -> TeacherCacheConfig:
        """The teacher cache in use: ``teacher_cache``, or the loss's default."""
        if self.teacher_cache is not None:
            return self.teacher_cache
        return TeacherCacheConfig(mode=default_cache_mode(self.divergence.loss, served=self.served))

    @property
    def group_timeout_s(self) -> float:
        """The process group's timeout in seconds: ``collective_timeout``, or ``default_collective_timeout``."""
        return self.collective_timeout or default_collective_timeout(self.teachers)

    @property
    def served(self) -> bool:
        """Whether a teacher is served."""
        return any(spec.served for spec in self.teachers)

    @property
    def several(self) -> bool:
        """Whether examples are routed to teachers by name (several teachers, or one given a name)."""
        return routed(self.teachers)

    @property
    def default_teacher_name(self) -> str | None:
        """The teacher of examples without a ``teacher`` field, when examples are routed."""
        if not self.several:
            return None
        names = [spec.name for spec in self.teachers]
        return self.default_teacher or (UNNAMED if UNNAMED in names else names[0])

    @property
    def run_dir(self) -> str:
        """Where the run writes: ``output_dir``, which ``__post_init__`` sets to a resume's own directory when none is
        given."""
        if self.output_dir is None:  # unreachable past __post_init__
            raise ValueError("output_dir: name the directory the run writes (--output-dir DIR)")
        return self.output_dir

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> TrainConfig:
        """A config from flat names (``FLAT``'s, the teacher flags' and the top-level fields'): the command line's
        flags. A teacher cache's mode not given is the loss's default (as with ``None``)."""
        known = {*FLAT, *TEACHER_FLAGS, *(f.name for f in fields(cls))}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown train config field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known - set(SECTIONS)))}")
        flags = {name: values[name] for name in TEACHER_FLAGS if values.get(name) is not None}
        values = {name: value for name, value in values.items() if name not in TEACHER_FLAGS}
        if flags:
            if values.get("teachers"):
                raise ValueError("teachers are given by their specs or by the teacher flags, not both")
            values["teachers"] = specs_from_flags(flags)
        top = {name: value for name, value in values.items() if not is_flat(name, value)}
        sections: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            if is_flat(name, value):
                section, leaf = FLAT[name].split(".")
                sections.setdefault(section, {})[leaf] = value
        loss = sections.get("divergence", {}).get("loss", DivergenceConfig().loss)
        served = any(spec.served for spec in as_specs(values.get("teachers", ())))
        if "teacher_cache" in sections:
            sections["teacher_cache"].setdefault("mode", default_cache_mode(loss, served=served))
        if served and loss != "sampled_reverse_kl":  # the served top-k's rest of the mass as one bucket
            sections.setdefault("divergence", {}).setdefault("top_k_rest", "tail")
        defaults = cls.__dataclass_fields__
        for section, changes in sections.items():
            base = top.pop(section, None)
            if base is None and section in OPTIONAL_SECTIONS:  # not named: made of the flat fields alone
                top[section] = SECTIONS[section](**changes)
            else:
                default = cast(Callable[[], Any], defaults[section].default_factory)  # every section has one
                top[section] = replace(base or default(), **changes)
        return cls(**top)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The config a ``train_config.json`` holds: sections as objects. A flat file of an older release is
        refused, not read."""
        values = dict(values)
        flat = [name for name, value in values.items() if is_flat(name, value)]
        if flat:
            raise ValueError("a flat train config of an older release: this release keeps "
                             f"{', '.join(f'{name} in {FLAT[name]}' for name in flat)}; move each into its section, "
                             "or start a new run")
        for name, kind in SECTIONS.items():
            if isinstance(values.get(name), dict):
                values[name] = section_from_json(kind, values[name])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """What ``train_config.json`` holds: every field, sections as objects (``from_dict`` reads it back), but the
        served teacher's key."""
        values = json.loads(json.dumps(asdict(self), default=str))
        values["teachers"] = [spec.to_dict() for spec in self.teachers]
        return values


def _check_task(config: TrainConfig) -> None:
    """A built-in task named, alone (it brings its own examples), with responses long enough for its worked
    solutions (a reference cut short would train no answer and no EOS)."""
    from opsd_rollout.train.tasks import TASKS, response_tokens

    task = checks.choice("task", config.task, tuple(TASKS))
    if config.prompts is not None:
        raise ValueError(f"task {config.task!r} brings its own examples; prompts {config.prompts!r} would be another "
                         "set: give one of them")
    needed = response_tokens(task)
    if config.sampling.max_new_tokens < needed:
        raise ValueError(f"max_new_tokens {config.sampling.max_new_tokens} cuts task {config.task!r}'s worked "
                         f"solutions, up to {needed} tokens with the EOS: give at least {needed}")


def _check_warm_start(config: TrainConfig) -> None:
    """A warm start belongs to a distillation, shorter than the run; the task's split to a task."""
    if config.warmup_sft_steps and config.objective != "opsd":
        raise ValueError(f"--warmup-sft-steps {config.warmup_sft_steps} warm-starts a distillation by SFT; objective "
                         f"{config.objective} is SFT all along: drop --warmup-sft-steps")
    if config.warmup_sft_steps >= config.steps:
        raise ValueError(f"--warmup-sft-steps {config.warmup_sft_steps} leaves no step of the {config.steps} "
                         "(--steps counts both phases) to distil: raise --steps")
    if config.warmup_sft_lr is not None and not config.warmup_sft_steps:
        raise ValueError("--warmup-sft-lr is the warm start's learning rate: give --warmup-sft-steps too")


def _check_served(config: TrainConfig) -> None:
    """What a served teacher cannot do, refused before any work: it scores tokens, it neither trains nor generates,
    and it sends no whole vocabulary."""
    if config.objective != "opsd":
        raise ValueError("a served teacher scores rollouts to distil from; objective sft trains on references alone")
    refuse_full_cache(config.cache)  # a full cache: the reason, and what to use


def load_train_config(path: str | Path) -> TrainConfig:
    """A run's saved ``train_config.json`` (a flat one, of an older release, is refused: ``from_dict``)."""
    return TrainConfig.from_dict(json.loads(Path(path).read_text()))
