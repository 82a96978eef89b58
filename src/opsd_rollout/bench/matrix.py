"""The benchmark matrix: axes as the user gave them, validated all at once, expanded and ordered.

Configs share a built engine when they share (dtype, ZeRO stage); engines are built in the order the user
first names them, and within one engine the largest effective batch (then the longest sequence) runs
first, so workspaces are sized once. Results are always reported in the user's order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from opsd_rollout.models import DEFAULT_MODEL
from opsd_rollout.rollout.config import CACHE_POLICIES, STRATEGIES

DTYPES = ("fp32", "fp16", "bf16")
DECODINGS = ("greedy", "sampling")
ZERO_STAGES = ("none", 0, 1, 2, 3)
PROMPT_KINDS = ("synthetic", "variable")


def _positive_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    number = int(str(value).strip())
    if number < 1:
        raise ValueError
    return number


def _choice(options: Sequence[Any]) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        text = str(value).strip().lower()
        for option in options:
            if text == str(option):
                return option
        raise ValueError

    return parse


def _unit_float(value: Any) -> float:
    number = float(str(value).strip())
    if not 0.0 <= number <= 1.0:
        raise ValueError
    return number


def _teacher_cache(value: Any) -> str:
    """``full`` or ``top<k>`` (k >= 1), e.g. ``top64``."""
    text = str(value).strip().lower()
    if text == "full" or (text.startswith("top") and text[3:].isdigit() and int(text[3:]) >= 1):
        return text
    raise ValueError


def _on_off(value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("on", "true", "1", "yes"):
        return True
    if text in ("off", "false", "0", "no"):
        return False
    raise ValueError


# axis name -> (parser, what a valid value is)
AXES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "batch_sizes": (_positive_int, "an integer >= 1"),
    "samples_per_prompt": (_positive_int, "an integer >= 1"),
    "prompt_lengths": (_positive_int, "an integer >= 1"),
    "response_lengths": (_positive_int, "an integer >= 1"),
    "dtypes": (_choice(DTYPES), f"one of {', '.join(DTYPES)}"),
    "decoding": (_choice(DECODINGS), f"one of {', '.join(DECODINGS)}"),
    "zero_stages": (_choice(ZERO_STAGES), "none (bare model) or a ZeRO stage 0-3"),
    "strategies": (_choice(STRATEGIES), f"one of {', '.join(STRATEGIES)}"),
    "cache_policies": (_choice(CACHE_POLICIES), f"one of {', '.join(CACHE_POLICIES)}"),
    "forward_timing": (_on_off, "on or off"),
    # OPSD step axes (``opsd-rollout step``); None in a rollout benchmark
    "losses": (_choice(("forward_kl", "reverse_kl", "jsd")), "one of forward_kl, reverse_kl, jsd"),
    "betas": (_unit_float, "a number in [0, 1]"),
    "teacher_caches": (_teacher_cache, "full or top<k> (e.g. top64)"),
}
STEP_AXES = ("losses", "betas", "teacher_caches")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One point of the matrix."""

    batch_size: int
    samples_per_prompt: int
    prompt_length: int
    response_length: int
    dtype: str
    decoding: str
    zero_stage: int | str
    strategy: str
    cache_policy: str
    forward_timing: bool
    loss: str | None = None
    """OPSD step only: the divergence."""
    beta: float | None = None
    """OPSD step only, ``loss=jsd``: the generalized JSD's beta."""
    teacher_cache: str | None = None
    """OPSD step only: ``full`` or ``top<k>``."""

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size * self.samples_per_prompt

    @property
    def engine_key(self) -> tuple[str, int | str]:
        return (self.dtype, self.zero_stage)

    @property
    def key(self) -> str:
        """Stable identity, used to match results across runs (``--resume``, ``compare``)."""
        key = (f"B{self.batch_size}-n{self.samples_per_prompt}-P{self.prompt_length}-R{self.response_length}-"
               f"{self.dtype}-{self.decoding}-zero{self.zero_stage}-{self.strategy}-{self.cache_policy}-"
               f"fwd{'on' if self.forward_timing else 'off'}")
        if self.loss is not None:
            key += f"-{self.loss}" + (f"{self.beta:g}" if self.beta is not None else "") + f"-{self.teacher_cache}"
        return key

    @property
    def label(self) -> str:
        """Short, for tables and plots: the axes that usually vary."""
        label = f"B{self.batch_size} n{self.samples_per_prompt} P{self.prompt_length} R{self.response_length}"
        if self.loss is not None:
            label += f" {self.loss}" + (f"({self.beta:g})" if self.beta is not None else "") + f" {self.teacher_cache}"
        return label

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class BenchMatrix:
    """Lists of values per axis; the matrix is their product. Defaults are the smoke matrix."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    samples_per_prompt: list[int] = field(default_factory=lambda: [1, 4])
    prompt_lengths: list[int] = field(default_factory=lambda: [128])
    response_lengths: list[int] = field(default_factory=lambda: [32])
    dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    decoding: list[str] = field(default_factory=lambda: ["greedy"])
    zero_stages: list[int | str] = field(default_factory=lambda: [0])
    strategies: list[str] = field(default_factory=lambda: ["static"])
    cache_policies: list[str] = field(default_factory=lambda: ["retain"])
    forward_timing: list[bool] = field(default_factory=lambda: [True])
    losses: list[str | None] = field(default_factory=lambda: [None])
    betas: list[float | None] = field(default_factory=lambda: [None])
    teacher_caches: list[str | None] = field(default_factory=lambda: [None])

    @classmethod
    def for_steps(cls) -> "BenchMatrix":
        """The step benchmark's defaults: a small matrix that runs in a couple of minutes on CPU."""
        return cls(batch_sizes=[2], samples_per_prompt=[2], prompt_lengths=[32], response_lengths=[32],
                   zero_stages=[0, 3], losses=["jsd"], betas=[0.5], teacher_caches=["full"])

    @property
    def is_step(self) -> bool:
        return self.losses != [None]

    @classmethod
    def parse(cls, raw: dict[str, Iterable[Any]], base: "BenchMatrix | None" = None) -> "BenchMatrix":
        """Axis values from strings or numbers (the CLI's comma lists, a config file's lists) over ``base``.

        Every bad value is collected into one ``ValueError``.
        """
        values = {f.name: list(getattr(base or cls(), f.name)) for f in fields(cls)}
        errors = []
        for name, items in raw.items():
            if name not in AXES:
                errors.append(f"unknown axis {name!r} (axes: {', '.join(AXES)})")
                continue
            parser, expected = AXES[name]
            items = list(items)
            if not items:
                errors.append(f"{name}: needs at least one value")
            parsed = []
            for item in items:
                if item is None and name in STEP_AXES:  # "not a step benchmark", as saved in a result file
                    parsed.append(None)
                    continue
                try:
                    parsed.append(parser(item))
                except (ValueError, TypeError):
                    errors.append(f"{name}: {item!r} is not {expected}")
            values[name] = list(dict.fromkeys(parsed))  # drop repeats, keep order
        if errors:
            raise ValueError("invalid benchmark matrix:\n  " + "\n  ".join(errors))
        return cls(**values)

    def check_positions(self, max_positions: int | None) -> None:
        """Refuse prompt + response lengths beyond the model's positions, listing every offending pair."""
        if max_positions is None:
            return
        bad = [f"prompt {p} + response {r} = {p + r}" for p in self.prompt_lengths for r in self.response_lengths
               if p + r > max_positions]
        if bad:
            raise ValueError(f"invalid benchmark matrix: beyond the model's {max_positions} positions: "
                             + "; ".join(bad))

    def expand(self) -> list[BenchConfig]:
        """Every config, in the user's order (the product of the axes, first axis slowest). ``beta`` only
        varies ``jsd``; the KLs appear once."""
        configs = [BenchConfig(batch_size=b, samples_per_prompt=n, prompt_length=p, response_length=r, dtype=d,
                               decoding=dec, zero_stage=z, strategy=s, cache_policy=c, forward_timing=f, loss=loss,
                               beta=beta if loss == "jsd" else None, teacher_cache=cache)
                   for b, n, p, r, d, dec, z, s, c, f, loss, beta, cache in itertools.product(
                       self.batch_sizes, self.samples_per_prompt, self.prompt_lengths, self.response_lengths,
                       self.dtypes, self.decoding, self.zero_stages, self.strategies, self.cache_policies,
                       self.forward_timing, self.losses, self.betas, self.teacher_caches)]
        return list({c.key: c for c in configs}.values())

    def to_dict(self) -> dict[str, list[Any]]:
        return asdict(self)


def run_order(configs: Sequence[BenchConfig]) -> list[BenchConfig]:
    """Engines in order of first appearance; within one engine, largest effective batch then longest
    sequence first (ties keep the user's order)."""
    engines = list(dict.fromkeys(config.engine_key for config in configs))
    return sorted(configs, key=lambda c: (engines.index(c.engine_key), -c.effective_batch_size,
                                          -(c.prompt_length + c.response_length)))


@dataclass(kw_only=True)
class BenchSettings:
    """Everything about a run that is not an axis."""

    model: str = DEFAULT_MODEL
    """Preset name or local checkpoint directory."""
    warmup: int = 1
    """Unrecorded iterations per config before measuring."""
    iterations: int = 5
    """Measured iterations per config."""
    seed: int = 0
    """Seeds the prompts and, before each config, torch's RNG (sampling)."""
    prompts: str = "synthetic"
    """``synthetic``: every prompt exactly ``prompt_length`` tokens; ``variable``: left-padded, lengths vary."""
    pad_fraction: float = 0.25
    """With ``prompts=variable``, the mean fraction of the prompt grid that is padding."""
    fixed_length: bool = True
    """EOS ignored during generation so every row generates ``response_length`` tokens (as benchmark tools
    do); off: real stopping, with response lengths reported."""
    temperature: float = 1.0
    """Sampling temperature (decoding=sampling)."""
    top_k: int = 50
    """Sampling top-k (decoding=sampling; -1 or 0 disables)."""
    top_p: float = 1.0
    """Sampling top-p (decoding=sampling)."""
    teacher: str | None = None
    """OPSD step only: the teacher (preset or local checkpoint; same vocabulary as the student ``model``)."""
    lr: float = 1e-4
    """OPSD step only: the student's AdamW learning rate."""

    def __post_init__(self) -> None:
        errors = []
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            errors.append(f"warmup must be an integer >= 0; got {self.warmup!r}")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 1:
            errors.append(f"iterations must be an integer >= 1; got {self.iterations!r}")
        if self.prompts not in PROMPT_KINDS:
            errors.append(f"prompts must be one of {', '.join(PROMPT_KINDS)}; got {self.prompts!r}")
        if not 0.0 <= self.pad_fraction < 1.0:
            errors.append(f"pad_fraction must be in [0, 1); got {self.pad_fraction!r}")
        if not self.temperature > 0:
            errors.append(f"temperature must be > 0 for sampling (greedy is decoding=greedy); got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            errors.append(f"top_k must be an integer >= -1; got {self.top_k!r}")
        if errors:
            raise ValueError("invalid benchmark settings:\n  " + "\n  ".join(errors))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
