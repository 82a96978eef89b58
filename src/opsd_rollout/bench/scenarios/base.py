"""The ``Scenario`` base: what one kind of benchmark must say (see the package's docstring).

Scenario modules are read to build the command line, so they import nothing heavy at their top (no torch,
DeepSpeed or transformers: ``opsd-rollout bench --help`` must answer at once); what runs a benchmark is imported
by the methods that run it (``prepare``, ``derive``, ``table``, ``timeline``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from rich.table import Table

from opsd_rollout import checks
from opsd_rollout.bench.axes import Axis, for_contender
from opsd_rollout.bench.contenders import check_contenders
from opsd_rollout.presets import DEFAULT_MODEL

if TYPE_CHECKING:
    from opsd_rollout.bench.report import ConfigResult
    from opsd_rollout.bench.engines import EnginePool
    from opsd_rollout.profiling.recorder import Span


def threads_phrase(environment: dict[str, Any], world_size: int) -> str:
    """How many threads each rank used and why, for a title: ``1 thread per rank: 2 cores / 2 local ranks``.
    Results written before ``threads_source`` was recorded give the count alone."""
    threads = environment["threads"]
    phrase = f"{threads} thread{'s' * (threads != 1)}{' per rank' if world_size > 1 else ''}"
    source, local = environment.get("threads_source"), environment.get("local_ranks") or 1
    if source == "shared":
        return f"{phrase}: {environment['cpu_count']} cores / {local} local ranks"
    if source == "kept":
        kept = len(environment.get("kept_cores") or ())
        return f"{phrase}: {environment['cpu_count'] - kept} cores, {kept} kept for the served teacher"
    if source == "OMP_NUM_THREADS":
        return f"{phrase} from OMP_NUM_THREADS" + (f", {local} local ranks" if local > 1 else "")
    return phrase


class Settings:
    """Base of a scenario's settings dataclass: ``rules`` (field -> a check of ``opsd_rollout.checks``, the same
    the configs use) are checked together when it is built, every failure listed in one ``ValueError``."""

    rules: ClassVar[dict[str, Callable[[str, Any], Any]]] = {}

    def __post_init__(self) -> None:
        errors = checks.failures(self.rules, self)
        if errors:
            raise ValueError("invalid benchmark settings:\n  " + "\n  ".join(errors))


@dataclass(kw_only=True)
class MeasuringSettings(Settings):
    """What every kind of benchmark has: the model, how a config is warmed up and measured, the seed. An
    iteration is one call (``bench``, ``step``) or one round of both sides (the developers' kernels)."""

    model: str = DEFAULT_MODEL
    """Preset name or local checkpoint directory."""
    warmup: int | None = None
    """Unrecorded iterations per config before measuring: ``None`` (``--warmup auto``) warms up until two
    consecutive iterations agree within ``steady_tolerance``, within the two budgets below; a number makes exactly
    that many."""
    warmup_max_iterations: int = 10
    """Most warm-up iterations per config with ``warmup=None``."""
    warmup_max_seconds: float = 60.0
    """Most seconds of warm-up per config with ``warmup=None``."""
    steady_tolerance: float = 0.05
    """Two consecutive warm-up iterations within this relative difference: the config is steady."""
    iterations: int = 5
    """Measured iterations per config."""
    seed: int = 0
    """Seeds the prompts and random tensors and, before each config, torch's RNG (sampling)."""

    rules: ClassVar = {
        "warmup": checks.rule(checks.integer, minimum=0, optional=True),
        "warmup_max_iterations": checks.rule(checks.integer, minimum=2),
        "warmup_max_seconds": checks.rule(checks.number, at_least=0, hint="seconds"),
        "steady_tolerance": checks.rule(checks.number, above=0, below=1), "iterations": checks.rule(checks.integer)}

    def __post_init__(self) -> None:
        if isinstance(self.warmup, str) and self.warmup.strip().lower() == "auto":  # the flag's spelling of None
            self.warmup = None
        super().__post_init__()


class Measurement(Protocol):
    """One config, ready to measure: ``run()`` measures one iteration and returns its figures."""

    def run(self) -> dict[str, Any]:
        ...

    def timeline(self) -> list[Span]:
        """Spans of the last ``run()`` (stages, forwards, attributed phases), for traces."""
        ...


class Scenario:
    """What one kind of benchmark measures; subclasses fill in the class attributes and the methods."""

    kind: ClassVar[str]
    """``rollout``, ``step``: the result file's ``kind`` and the CLI subcommand's name."""
    axes: ClassVar[tuple[Axis, ...]]
    config_type: ClassVar[type]
    """A frozen dataclass with one field per axis (``key``, ``label``, ``engine_key`` properties)."""
    settings_type: ClassVar[type]
    """A dataclass of everything about a run that is not an axis, with its defaults."""
    defaults: ClassVar[dict[str, list[Any]]]
    """The matrix a run with no axis given measures."""
    stages: ClassVar[tuple[str, ...]]
    """Metric names that break one iteration's time down (disjoint, in order): the stages plot and shares."""
    what: ClassVar[str]
    """``rollout`` or ``step``: what one iteration is, for labels (``step latency (ms)``)."""
    throughput_label: ClassVar[str]

    def __init__(self, settings: Any):
        self.settings = settings

    @classmethod
    def make_config(cls, **fields: Any) -> Any:
        """The config of one combination of axis values (``None``: the scenario has none); a knob that does not
        apply to the contender is ``None`` (``axes.for_contender``)."""
        return cls.config_type(**for_contender(cls.axes, fields))

    def check(self, matrix: Any, max_positions: Any) -> None:
        """Refuse what the axes alone cannot (e.g. lengths beyond a model, a baseline that is not a contender);
        ``max_positions(name)`` reads a model's position limit without building it."""
        check_contenders(matrix, self.settings.baseline)
        matrix.check_positions(max_positions(self.settings.model))

    def cores_to_keep(self) -> int:
        """Cores the run keeps off for another process (the step's served teacher, ``--split-cores``): 0, none."""
        return 0

    def skip_reason(self, config: Any) -> str | None:
        """Why ``config`` cannot be measured (its contender lacks what it asks for), or ``None``; such a config is
        recorded ``skipped`` with the reason, and the run goes on."""
        return None

    def prepare(self, pool: "EnginePool", config: Any) -> Measurement:
        raise NotImplementedError

    def derive(self, result: "ConfigResult", spec: Any, ceilings: dict[str, Any] | None,
               world_size: int) -> dict[str, Any]:
        """Figures derived from the config's iterations (medians, utilisation)."""
        raise NotImplementedError

    def tables(self, results: list["ConfigResult"]) -> list[Table]:
        """The tables a person reads after a run (below the ``title`` line)."""
        raise NotImplementedError

    def warmup_phrase(self, unit: str = "call") -> str:
        """``warm-up until steady`` or ``3 warm-up calls`` (``unit``: what one warm-up iteration is)."""
        warmup = self.settings.warmup
        return "warm-up until steady" if warmup is None else f"{warmup} warm-up {unit}{'s' * (warmup != 1)}"

    def title(self, environment: dict[str, Any], world_size: int) -> str:
        """The line above the tables: model, device, threads, iterations."""
        s = self.settings
        title = (f"{s.model} on {environment['device_name']} ({threads_phrase(environment, world_size)}), "
                 f"{s.iterations} iterations after {self.warmup_phrase()}")
        if getattr(s, "interleave", False):
            title += "; contenders interleaved round by round"
        if world_size > 1:
            title += (f"; {world_size} ranks: batch sizes are per rank, times are the slowest rank's, "
                      "tokens/s the sum over ranks")
        return title
