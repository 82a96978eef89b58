"""``opsd-rollout step``: whole on-policy distillation steps (``opsd_step``) over a matrix of shapes, losses,
teacher caches and where the teacher runs (in process, or served by ``serve-teacher`` on loopback), each iteration
one step on a DeepSpeed engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rich.table import Table

from opsd_rollout.bench import contenders
from opsd_rollout.bench.axes import (ROLLOUT_PROFILING, STEP_AXES, TEACHER_OVERLAP, TEACHER_SERVING, axis_defaults,
                                     for_contender)
from opsd_rollout.bench.report import ConfigResult
from opsd_rollout.bench.tables import baseline_table, config_table, fmt, mib, stability_table
from opsd_rollout.bench.scenarios.base import Scenario
from opsd_rollout.bench.scenarios.rollout import RolloutConfig, RolloutSettings
from opsd_rollout.checks import boolean, choice, integer, number, rule, text
from opsd_rollout.deepspeed_config import LEARNING_RATE
from opsd_rollout.metrics import STEP_STAGES, hidden_share, label

OVER_BUDGET = ("error", "topk")
"""``TeacherCacheConfig.over_budget``'s values (this module imports no torch: see scenarios/base.py)."""
ESTIMATORS = ("k1", "k3")
"""``DivergenceConfig.estimator``'s values."""


@dataclass(frozen=True, kw_only=True)
class StepConfig(RolloutConfig):
    """One point of an OPSD step matrix: the rollout's axes plus the loss and the teacher cache."""

    loss: str
    beta: float | None
    """The generalized JSD's beta; ``None`` for the KLs (fixed at 0 and 1)."""
    teacher_cache: str
    """``full``, ``sampled`` or ``top<k>``."""
    rollout_profiling: bool | None = True
    """Our rollout profiled in each step (``None`` for DeepSpeed's rollout, which profiles itself)."""
    teacher_serving: str | None = "in-process"
    """``in-process``, or served answering ``json`` or ``compact`` (``None`` for DeepSpeed's step: in process)."""
    teacher_overlap: bool | None = None
    """A served teacher's request in flight behind the student's forward, or waited for (``None``: in process)."""

    @property
    def served(self) -> bool:
        return self.teacher_serving in ("json", "compact")

    @property
    def _loss_text(self) -> str:
        return self.loss + (f"{self.beta:g}" if self.beta is not None else "")

    @property
    def key(self) -> str:
        unprofiled = ROLLOUT_PROFILING.fragment(self.rollout_profiling)
        served = (TEACHER_SERVING.fragment(self.teacher_serving), TEACHER_OVERLAP.fragment(self.teacher_overlap))
        return "-".join(filter(None, (super().key, self._loss_text, self.teacher_cache, unprofiled, *served)))

    @property
    def label(self) -> str:
        beta = f"({self.beta:g})" if self.beta is not None else ""
        unprofiled = " unprofiled" if self.rollout_profiling is False else ""
        served = f" served {self.teacher_serving}{'' if self.teacher_overlap else ' waited'}" if self.served else ""
        return f"{super().label} {self.loss}{beta} {self.teacher_cache}{unprofiled}{served}"

    @property
    def engine_fields(self) -> dict[str, Any]:
        """The rollout's, with whether it is profiled."""
        fields = super().engine_fields
        if self.rollout_profiling is not None:
            fields["enable_profiling"] = self.rollout_profiling
        return fields

    @property
    def teacher_cache_options(self) -> dict[str, Any]:
        """``TeacherCacheConfig`` keyword arguments of ``teacher_cache``."""
        if self.teacher_cache in ("full", "sampled"):
            return {"mode": self.teacher_cache}
        return {"mode": "topk", "top_k": int(self.teacher_cache[3:])}


@dataclass(kw_only=True)
class StepSettings(RolloutSettings):
    """Everything about an OPSD step benchmark that is not an axis."""

    model: str = "llama-tiny"
    """The student: preset name or local checkpoint directory."""
    teacher: str = "llama-small"
    """The teacher (preset or local checkpoint; the student's vocabulary)."""
    lr: float = LEARNING_RATE
    """The student's AdamW learning rate (``train``'s default)."""
    fused_loss: bool = True
    """The loss fused with the student's LM head (``DivergenceConfig.fused``); ``False``: whole logits."""
    teacher_cache_budget_bytes: int | None = None
    """The teacher cache's host-memory budget (``TeacherCacheConfig.host_budget_bytes``); ``None``: half of the
    memory available when it is built."""
    teacher_cache_over_budget: str = "error"
    """A teacher cache over its budget: ``error`` or ``topk`` (``TeacherCacheConfig.over_budget``)."""
    estimator: str = "k1"
    """``sampled_reverse_kl``'s per-token estimate: ``k1`` or ``k3`` (``DivergenceConfig.estimator``)."""
    teacher_zero_stage: int = 0
    """0: the teacher is a plain module beside the student on every rank; 3: a DeepSpeed inference engine (no
    optimizer), its parameters partitioned across the ranks."""
    split_cores: bool = False
    """A served teacher's server on the last core (one thread), this run on the others, one thread a core each: the
    teacher's compute off the student's cores, as on a machine of its own; ``False``: both on every core."""

    rules: ClassVar = {**RolloutSettings.rules, "lr": rule(number, above=0),
                       "teacher": rule(text, what="a preset name or a checkpoint directory"),
                       "fused_loss": boolean, "teacher_cache_budget_bytes": rule(integer, optional=True),
                       "teacher_cache_over_budget": rule(choice, choices=OVER_BUDGET),
                       "estimator": rule(choice, choices=ESTIMATORS), "teacher_zero_stage": rule(choice, choices=(0, 3)),
                       "split_cores": boolean}


class StepMeasurement:
    """One config's OPSD step, built: each ``run()`` is one step, the contender's (``bench/contenders/``)."""

    def __init__(self, engine: Any, teacher: Any, rollout: Any, request: Any, sampling: Any, config: StepConfig,
                 settings: StepSettings, state: Any = None):
        from opsd_rollout.opsd import DivergenceConfig, StepState, TeacherCacheConfig  # heavy: see scenarios/base.py

        divergence = DivergenceConfig(loss=config.loss, beta=config.beta if config.beta is not None else 0.5,
                                      fused=settings.fused_loss, estimator=settings.estimator)
        cache = TeacherCacheConfig(**config.teacher_cache_options, host_budget_bytes=settings.teacher_cache_budget_bytes,
                                   over_budget=settings.teacher_cache_over_budget)
        self.state = state if state is not None else StepState()
        """The step's ``StepState``, kept across this config's steps (and shared with others: the scenario's)."""
        self.step = contenders.module(config.strategy).build_step(engine, teacher, rollout, sampling, divergence,
                                                                  cache, self.state)
        self.rollout, self.request = rollout, request
        self._last = None

    def run(self) -> dict[str, Any]:
        self._last = self.step(self.request)
        return self._last.to_dict()

    def timeline(self) -> list[Any]:
        """The last step's parts, with the rollout's own spans inside its part."""
        from opsd_rollout.profiling.recorder import Span

        p = self._last
        durations = {"rollout": p.rollout_ms, "teacher": p.teacher_forward_ms + p.cache_write_ms + p.teacher_wait_ms,
                     "student_forward": p.student_forward_ms, "loss": p.loss_ms, "backward": p.backward_ms,
                     "optimizer": p.optimizer_ms}
        offset = p.part_start_ms.get("rollout", 0.0)
        spans = [Span("step", 0.0, p.total_ms, None)]
        spans += [Span(name, start, durations[name], "step") for name, start in p.part_start_ms.items()]
        return spans + [Span(s.name, offset + s.start_ms, s.duration_ms, s.parent or "rollout")
                        for s in self.rollout.get_last_timeline() or []]


class StepScenario(Scenario):
    kind = "step"
    axes = STEP_AXES
    config_type = StepConfig
    settings_type = StepSettings
    defaults: ClassVar[dict[str, list[Any]]] = {
        **axis_defaults(STEP_AXES), "batch_sizes": [2], "samples_per_prompt": [2], "prompt_lengths": [32],
        "response_lengths": [32], "zero_stages": [0, 3]}
    stages = STEP_STAGES
    what = "step"
    throughput_label = "trained response tokens/s (p50)"
    columns = tuple(stage for stage in STEP_STAGES if stage not in ("eval_ms", "train_ms"))  # the switches: JSON

    def __init__(self, settings: Any):
        super().__init__(settings)
        self.step_state: Any = None
        """The ``StepState`` every config's steps share, made at the first ``prepare`` (this module imports no torch):
        one set of teacher-cache host buffers for the run (configs run interleaved, each step done with its cache
        before the next builds), and each warning said once per student."""

    @classmethod
    def make_config(cls, **fields: Any) -> StepConfig | None:
        fields = for_contender(cls.axes, fields)
        if fields["loss"] != "jsd":  # beta only varies the generalized JSD; the KLs appear once
            fields["beta"] = None
        if fields["loss"] == "sampled_reverse_kl":  # the one cache it reads
            fields["teacher_cache"] = "sampled"
        elif fields["teacher_cache"] == "sampled":  # the other losses need the teacher's distribution
            return None
        if fields["teacher_serving"] in (None, "in-process"):  # in process, nothing is awaited or overlapped
            fields["teacher_overlap"] = None
        elif fields["teacher_cache"] == "full":  # no server sends every logit
            return None
        return StepConfig(**fields)

    def check(self, matrix: Any, max_positions: Any) -> None:
        if "none" in matrix["zero_stages"]:
            raise ValueError("an OPSD step trains a DeepSpeed engine: --zero-stages takes 0-3 here, not none")
        super().check(matrix, max_positions)
        matrix.check_positions(max_positions(self.settings.teacher))
        asked = [value for value in matrix["teacher_serving"] if value != "in-process"]
        if asked and not any(config.served for config in matrix.expand()):
            raise ValueError(f"--teacher-serving {','.join(asked)}: a served teacher sends top-k or sampled "
                             "log-probabilities, never every logit: add a top<k> teacher cache (--teacher-caches "
                             "top64) or the sampled one (--losses sampled_reverse_kl)")
        if self.settings.split_cores and not asked:
            raise ValueError("--split-cores keeps a core for a served teacher's server: add --teacher-serving json "
                             "or compact")

    def cores_to_keep(self) -> int:
        return 1 if self.settings.split_cores else 0

    def skip_reason(self, config: StepConfig) -> str | None:
        return contenders.module(config.strategy).skip_reason(config)

    def prepare(self, pool: Any, config: StepConfig) -> StepMeasurement:
        from opsd_rollout.bench.prompts import rollout_inputs  # heavy: see scenarios/base.py

        rollout, built = pool.rollout(config)
        request, sampling = rollout_inputs(config, self.settings, built.tokenizer, built.spec.vocab_size,
                                           pool.rank, pool.device)
        if config.served:
            from opsd_rollout.opsd import ServedTeacher  # heavy: see scenarios/base.py

            top_k = int(config.teacher_cache[3:]) if config.teacher_cache.startswith("top") else 0
            url = pool.served(self.settings.teacher, config.dtype, compact=config.teacher_serving == "compact",
                              top_k=top_k)
            teacher = ServedTeacher(url, tokenizer=built.tokenizer, overlap=config.teacher_overlap)
        else:
            teacher = pool.frozen(self.settings.teacher, config.dtype, self.settings.teacher_zero_stage)
        prepared = StepMeasurement(built.engine, teacher, rollout, request, sampling, config, self.settings,
                                   self.step_state)
        self.step_state = prepared.state
        return prepared

    def derive(self, result: ConfigResult, spec: Any, ceilings: dict[str, Any] | None,
               world_size: int) -> dict[str, Any]:
        """Medians a step benchmark reader wants first."""
        step_ms, rollout_ms = result.p50("total_ms"), result.p50("rollout_ms")
        wait, latency = result.p50("teacher_wait_ms"), result.p50("teacher_latency_ms")
        served = {"teacher_wait_ms": wait, "teacher_latency_ms": latency,
                  "teacher_hidden_share": hidden_share(wait, latency) if latency else None}
        return {**(served if result.config.served else {}), "rollout_share": result.p50("rollout_share"),
                "loss": result.p50("loss"), "step_ms": step_ms,
                "rollout_ms": rollout_ms, "teacher_cache_bytes": result.p50("teacher_cache_bytes"),
                "teacher_cache_budget_bytes": result.p50("teacher_cache_budget_bytes"),
                "trained_tokens_per_second": result.p50("tokens_per_second"),
                "step_ms_without_rollout": (step_ms - rollout_ms) if step_ms and rollout_ms is not None else None}

    def title(self, environment: dict[str, Any], world_size: int) -> str:
        return f"OPSD steps: student {super().title(environment, world_size)}; teacher {self.settings.teacher}"

    def tables(self, results: list[ConfigResult]) -> list[Table]:
        """The step and its loss; where the step's time goes (median ms per part); warm-up and noise."""

        def figures(result: ConfigResult) -> list[str]:
            total = result.metric("total_ms")
            return [fmt(total.p50) + result.spread_flag, fmt(total.p95), f"{100 * result.p50('rollout_share'):.0f}",
                    fmt(result.p50("loss"), 4), mib(result.p50("peak_memory_bytes")),
                    fmt(result.p50("teacher_cache_bytes") / 2**20, 2)]

        def teacher(result: ConfigResult) -> list[str]:
            share = result.derived.get("teacher_hidden_share")
            return [fmt(result.p50("teacher_latency_ms")), fmt(result.p50("teacher_wait_ms")),
                    f"{100 * share:.0f}" if share is not None else "-"]

        served = [r for r in results if r.config.served]
        ratios = baseline_table(results)
        return [config_table(results, "steps (medians over the iterations)",
                             ["step ms", "p95 ms", "rollout %", "loss", "peak MiB", "cache MiB"],
                             figures, caption="rollout share = (eval + rollout + train) / step"),
                config_table(results, "where the step's time goes (median ms; eval/train switches in the JSON)",
                             [label(k) for k in self.columns], lambda r: [fmt(r.p50(k)) for k in self.columns]),
                *([config_table(served, "the served teacher (medians)", ["latency ms", "wait ms", "hidden %"],
                                teacher, caption="latency: its requests, sent to cache written; wait: the step "
                                "blocked on it; hidden = 1 - wait / latency")] if served else []),
                *([ratios] if ratios is not None else []), stability_table(results)]
