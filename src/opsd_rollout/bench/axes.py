"""Benchmark matrix axes: what each one is called, how its values are read from a flag or a config file, what a
valid value is, and how it reads in a config's key. A scenario lists the axes it has; nothing else parses axis
values.

The engine's axes are not written here one by one: ``engine_axes`` makes one of every field of
``HybridEngineRolloutConfig`` and its ``RolloutOptions`` (the name, flag, parser, default and help from the field, its
type, its values and its docstring), so a new engine option is an axis with no edit here. ``SPELLINGS`` holds only
what a result file or a flag already spells otherwise (an axis's name, its key fragment, its word for ``None``, the
strategies it acts on) and ``NOT_AXES`` the fields that are none; the engine's config knows nothing of either. The
``strategies`` axis names the contenders (``bench/contenders/``). An axis says which contenders it applies to
(``Axis.applies_to``: the engine's, ours only); for the others its value is ``None`` (n/a) in the config, so its
values do not multiply their configs (``for_contender``)."""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from functools import cache
from typing import Any

from opsd_rollout import checks
from opsd_rollout.bench.contenders import CONTENDERS, OURS
from opsd_rollout.bench.lengths import KINDS, LengthModel
from opsd_rollout.metrics import parse_size, size_text
from opsd_rollout.rollout.config import CHOICES, HybridEngineRolloutConfig

DTYPES = ("fp32", "fp16", "bf16")
DECODINGS = ("greedy", "sampling")
ZERO_STAGES = ("none", 0, 1, 2, 3)
LOSSES = ("forward_kl", "reverse_kl", "jsd", "sampled_reverse_kl")


# An axis value comes from a flag or a config file (text or a number): read it, then the checks every config
# uses (``opsd_rollout.checks``); a matrix lists what each refused value should have been (``Axis.expected``).


def positive_int(value: Any) -> int:
    return checks.integer("value", checks.from_text(value, int))


def choice(options: Sequence[Any]) -> Callable[[Any], Any]:
    spelled = {str(option): option for option in options}

    def parse(value: Any) -> Any:
        return spelled[checks.choice("value", str(value).strip().lower(), tuple(spelled))]

    return parse


def unit_float(value: Any) -> float:
    return checks.number("value", checks.from_text(value, float), at_least=0, at_most=1)


def teacher_cache(value: Any) -> str:
    """``full``, ``sampled`` or ``top<k>`` (k >= 1), e.g. ``top64``."""
    text = str(value).strip().lower()
    if text in ("full", "sampled") or (text.startswith("top") and text[3:].isdigit() and int(text[3:]) >= 1):
        return text
    raise ValueError


def length_model(value: Any) -> str:
    """A response-length model's spec, normalized (``lognormal:median=48,sigma=1``)."""
    return LengthModel.parse(str(value)).spec


def split_specs(text: str) -> list[str]:
    """A comma list whose items may hold commas of their own (``fixed,lognormal:median=48,sigma=1.0``): a piece
    that names no kind continues the item before it."""
    items: list[str] = []
    for piece in text.split(","):
        if items and piece.strip().split(":")[0].strip().lower() not in KINDS:
            items[-1] += "," + piece
        else:
            items.append(piece)
    return items


def or_none(parse: Callable[[Any], Any], *words: str) -> Callable[[Any], Any]:
    """``parse``, or ``None`` for null (a result file's) or one of ``words`` (``none``, ``auto``)."""
    def parse_or_none(value: Any) -> Any:
        if value is None or str(value).strip().lower() in words:
            return None
        return parse(value)

    return parse_or_none


def on_off(value: Any) -> bool:
    return checks.on_off("value", value)


@dataclass(frozen=True)
class Axis:
    """One axis of a matrix: ``name`` in the matrix (and ``--name`` as a flag), ``field`` in each config."""

    name: str
    field: str
    parse: Callable[[Any], Any]
    expected: str
    """What a valid value is, for error messages."""
    about: str | Callable[[], str]
    """The flag's help, or what makes it when it is first asked for (an engine axis's reads the field's docstring)."""
    split: Callable[[str], list[str]] = lambda text: text.split(",")
    """How a flag's comma list splits into values."""
    applies_to: tuple[str, ...] = tuple(CONTENDERS)
    """The contenders (``strategies``) it exists for; for the others the config holds ``None`` (n/a)."""
    default: Any = None
    """The config's value when the axis is not given."""
    key: str | None = None
    """Its fragment of a config's key (``{}``: the value's text), there only away from ``default`` unless
    ``always`` (so a key written before the axis existed is unchanged); ``None``: none."""
    always: bool = False
    display: str | None = None
    """How it reads in a display label (``{}``: the value's text); ``None``: ``field=value``."""
    none: str = "none"
    """The word for ``None``."""
    engine: str | None = None
    """The ``HybridEngineRolloutConfig.from_flat`` name it sets, for an engine axis."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        """The flag's help."""
        return self.about() if callable(self.about) else self.about

    def text(self, value: Any) -> str:
        if value is None:
            return self.none
        if isinstance(value, bool):
            return "on" if value else "off"
        return size_text(value) if self.field.endswith("_bytes") else str(value)

    def fragment(self, value: Any) -> str:
        shown = value is not None and self.key is not None and (self.always or value != self.default)
        plain = not isinstance(value, bool) and not self.field.endswith("_bytes")  # a number keeps its format
        return self.key.format(value if plain else self.text(value)) if shown else ""

    def describe(self, value: Any) -> str:
        return (self.display or f"{self.field}={{}}").format(self.text(value))


def shape_axis(name: str, field: str, key: str, help: str) -> Axis:
    return Axis(name, field, positive_int, "an integer >= 1", help, key=key, always=True)


def choice_axis(name: str, field: str, options: Sequence[Any], help: str, default: Any, **kwargs: Any) -> Axis:
    return Axis(name, field, choice(options), f"one of {', '.join(map(str, options))}", help, default=default,
                **kwargs)


@dataclass(frozen=True)
class Spelling:
    """How the bench spells an engine field that a result file or a flag already spells otherwise than the field's
    name and the defaults below say."""

    name: str | None = None
    """The axis and its flag (``--kv-budgets``); ``None``: the field's name."""
    key: str | None = None
    """Its fragment of a config's key (``{}``: the value's text), there only away from the default unless
    ``always``; ``None``: ``field=value``."""
    always: bool = False
    none: str = "none"
    """The word for ``None``."""
    config: str | None = None
    """Its name in result files' configs; ``None``: the field's."""
    applies_to: tuple[str, ...] = OURS
    """The strategies it acts on (DeepSpeed's rollout has none of our knobs)."""


STATIC = ("static",)
SPELLINGS: dict[str, Spelling] = {
    "compile_decode": Spelling(key="compiled", applies_to=STATIC),
    "shared_prefill": Spelling(applies_to=STATIC),
    "kv_budget_bytes": Spelling("kv_budgets", key="kv{}", applies_to=STATIC),
    "compact_rows": Spelling("compaction", key="nocompact", applies_to=STATIC),
    "continuous_cache_capacity": Spelling(applies_to=STATIC),
    "cache_policy": Spelling("cache_policies", key="{}", always=True),
    "shared_prefix": Spelling(key="noshared", applies_to=STATIC),
    "shared_prefix_min_prompt": Spelling(applies_to=STATIC),
    "stop_check_interval": Spelling("stop_check_intervals", key="stop{}", none="auto", applies_to=STATIC),
    "cpu_transposed_weights": Spelling("weight_copies", key="wcopies", applies_to=STATIC),
    "cpu_row_kernel": Spelling("row_kernel", key="rowkernel", applies_to=STATIC),
    "profile_forwards": Spelling("forward_timing", key="fwd{}", always=True, config="forward_timing"),
}
"""By engine field (of ``HybridEngineRolloutConfig`` or its ``RolloutOptions``): its spelling, where it is not the
default ``Spelling()``. The key fragments are those of every committed result (``tests/test_bench_axes.py``
recomputes them), so a name here changes only with a conversion of those files."""
NOT_AXES = {
    "enable_profiling": "the rollout bench profiles every call; the step bench has its own rollout_profiling axis",
    "strategy": "the contenders axis, strategies",
    "seed": "--seed seeds every call",
    "deepspeed": "DeepSpeed's own names, mapped onto the fields that are axes",
}
"""Engine fields that are no axis, and why."""


def engine_fields(config_type: type) -> Iterator[tuple[str, Field]]:
    """(where, field) of every field of ``config_type`` that is an axis (not in ``NOT_AXES``), a field holding a
    dataclass (``options``) giving its own fields', in order."""
    for f in fields(config_type):
        if f.name in NOT_AXES:
            continue
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            yield from ((f"{f.name}.{where}", g) for where, g in engine_fields(f.default_factory))
        else:
            yield f.name, f


@cache
def field_docs(config_type: type) -> dict[str, str]:
    """The docstring under each field of ``config_type``, its bases' and its nested dataclasses', from their modules'
    source (none where the source cannot be read). Python keeps no attribute docstrings, so the source is where
    they are; read once, when a flag's help is first asked for, not at import."""
    classes = [*config_type.__mro__, *(f.default_factory for f in fields(config_type)
                                       if f.default_factory is not MISSING and is_dataclass(f.default_factory))]
    docs: dict[str, str] = {}
    for module in dict.fromkeys(sys.modules.get(cls.__module__) for cls in classes):
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or node.name not in {cls.__name__ for cls in classes}:
                continue
            for field_node, after in zip(node.body, node.body[1:]):
                if (isinstance(field_node, ast.AnnAssign) and isinstance(after, ast.Expr)
                        and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                    docs.setdefault(field_node.target.id, " ".join(after.value.value.split()))
    return docs


def field_help(config_type: type, where: str, name: str, applies_to: tuple[str, ...]) -> str:
    """An engine flag's help: the first sentence of the field's docstring, the field and the strategies."""
    doc = field_docs(config_type).get(name, "")
    sentence = (doc.split(". ")[0].rstrip(".") if doc else name).replace("``", "").replace("%", "%%")
    return f"{sentence} ({where}; {', '.join(applies_to)})"


def engine_axis(config_type: type, where: str, f: Field) -> Axis:
    """The axis of one engine field: parsed by its type (``bool`` on/off, ``int`` >= 1 or a size for ``*_bytes``,
    ``str`` one of the engine's ``CHOICES`` for it, ``| None`` also its ``none`` word), spelled by ``SPELLINGS``."""
    spelling = SPELLINGS.get(f.name, Spelling())
    kind = str(f.type).split("|")[0].strip()
    if kind == "bool":
        parse, expected = on_off, "on or off"
    elif kind == "int":
        parse, expected = ((parse_size, "a size such as 64MiB") if f.name.endswith("_bytes")
                           else (positive_int, "an integer >= 1"))
    else:
        options = CHOICES.get(f.name, ())
        parse, expected = (choice(options), f"one of {', '.join(options)}") if options else (str, "text")
    if "None" in str(f.type):
        parse, expected = or_none(parse, spelling.none, "none", "off"), f"{spelling.none} or {expected}"
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    return Axis(spelling.name or f.name, spelling.config or f.name, parse, expected,
                lambda: field_help(config_type, where, f.name, spelling.applies_to),
                applies_to=spelling.applies_to, default=default, key=spelling.key or f"{f.name}={{}}",
                always=spelling.always, none=spelling.none, engine=f.name)


def engine_axes(config_type: type = HybridEngineRolloutConfig) -> tuple[Axis, ...]:
    """One axis per engine field (``engine_fields``), in the config's order."""
    return tuple(engine_axis(config_type, where, f) for where, f in engine_fields(config_type))


SHAPE_AXES = (
    shape_axis("batch_sizes", "batch_size", "B{}", "batch sizes (prompts per rollout)"),
    shape_axis("samples_per_prompt", "samples_per_prompt", "n{}", "samples per prompt (n)"),
    shape_axis("prompt_lengths", "prompt_length", "P{}", "prompt lengths in tokens"),
    shape_axis("response_lengths", "response_length", "R{}", "response lengths (max_new_tokens)"),
)
"""The shape, in every config's ``label``."""
WORKLOAD_AXES = SHAPE_AXES + (
    choice_axis("dtypes", "dtype", DTYPES, "fp32, fp16, bf16 (a dtype the device cannot run is reported as "
                "skipped)", "fp32", key="{}", always=True, display="{}"),
    choice_axis("decoding", "decoding", DECODINGS, "greedy, sampling (temperature/top-k/top-p below)", "greedy",
                key="{}", always=True, display="{}"),
    Axis("zero_stages", "zero_stage", choice(ZERO_STAGES), "none (bare model) or a ZeRO stage 0-3",
         "0-3 (a DeepSpeed engine built from the model) or none (the bare model)", default=0, key="zero{}",
         always=True, display="zero{}"),
    choice_axis("strategies", "strategy", tuple(CONTENDERS), "the contenders: static (default: our decode loop, "
                "shared prefill), generate (transformers' generate behind our rollout), deepspeed (DeepSpeed's own "
                "HybridEngineRollout on the same engine: ZeRO 0-3); with several, each config's ratio to --baseline",
                "static", key="{}", always=True, display="{}"),
    Axis("length_models", "lengths", length_model,
         "fixed, natural, lognormal:median=M,sigma=S, geometric:mean=M or uniform:low=L,high=H",
         "response lengths: fixed (EOS ignored: every row runs to the cap), natural (the model's EOS), or a synthetic "
         "distribution forced alike on every engine, e.g. lognormal:median=48,sigma=1.0 or geometric:mean=64 (capped "
         "at the response length)", split_specs, default="fixed", key="len{}", display="{}"),
)
"""The work itself: the same for every contender."""
CONTINUOUS_BATCH = Axis(
    "continuous_batch_sizes", "continuous_batch_size", or_none(positive_int, "none", "off"), "none or an integer >= 1",
    "none (default): every row decodes at once; or the rows decoding at once (SamplingConfig.continuous_batch_size: "
    "pending prompts fill the slots rows leave); static", applies_to=("static",), key="cb{}")
"""A field of the request's ``SamplingConfig`` (DeepSpeed's), not of the engine's config; its key fragment comes
after ``compile_decode``'s, as in every result file."""
_ENGINE = engine_axes()
_AFTER = next(i for i, axis in enumerate(_ENGINE) if axis.field == "compile_decode") + 1
ROLLOUT_AXES = WORKLOAD_AXES + _ENGINE[:_AFTER] + (CONTINUOUS_BATCH,) + _ENGINE[_AFTER:]
KEY_AXES = sorted(ROLLOUT_AXES, key=lambda axis: not axis.always)
"""A rollout config's key: the fragments every key has, then the others, each in axis order."""
VARIANT_AXES = tuple(axis for axis in ROLLOUT_AXES if axis not in SHAPE_AXES)
"""The axes a display label adds to a config's ``label`` where they vary."""


def axis_defaults(axes: Sequence[Axis]) -> dict[str, list[Any]]:
    return {axis.name: [axis.default] for axis in axes}


def for_contender(axes: Sequence[Axis], fields: dict[str, Any]) -> dict[str, Any]:
    """A config's fields with every knob that does not apply to its contender (``fields["strategy"]``) set to
    ``None`` (n/a): the knob's values then give that contender one config, not one each."""
    return {**fields, **{axis.field: None for axis in axes
                         if axis.field in fields and fields["strategy"] not in axis.applies_to}}


ROLLOUT_PROFILING = Axis(
    "rollout_profiling", "rollout_profiling", on_off, "on or off",
    "on (default, as in train) or off: the rollout's own profile inside each step (HybridEngineRolloutConfig."
    "enable_profiling); off measures what profiling costs the step, whose parts are timed either way (static, "
    "generate)", applies_to=OURS, default=True, key="unprofiled", display="rollout profile {}")
"""An OPSD step's knob of our engine: its rollout profiled or not (the rollout bench reads every figure from the
profile, so it is always on there)."""
STEP_AXES = ROLLOUT_AXES + (ROLLOUT_PROFILING,) + (
    choice_axis("losses", "loss", LOSSES, "forward_kl, reverse_kl, jsd over the teacher's distribution, or "
                "sampled_reverse_kl (the sampled tokens' log-probabilities: --estimator, the sampled teacher cache)",
                "jsd"),
    Axis("betas", "beta", unit_float, "a number in [0, 1]",
         "generalized JSD beta in [0, 1] (0 = forward KL, 1 = reverse KL; jsd only)", default=0.5),
    Axis("teacher_caches", "teacher_cache", teacher_cache, "full, sampled or top<k> (e.g. top64)",
         "full (every logit), top<k> (e.g. top64) or sampled (each sampled token's log-probability, the cache "
         "sampled_reverse_kl reads): the host teacher cache", default="full"),
)
TEACHER_SERVINGS = ("in-process", "json", "compact")
TEACHER_SERVING = choice_axis(
    "teacher_serving", "teacher_serving", TEACHER_SERVINGS, "in-process (default): the teacher runs in this process; "
    "json or compact: the teacher served by opsd-rollout serve-teacher, started on loopback in its own process "
    "(--split-cores gives it a core of its own), answering vLLM's JSON or the compact answer; a served teacher needs a "
    "top<k> or sampled teacher cache (static, generate)", "in-process", applies_to=OURS, key="served{}")
"""Where an OPSD step's teacher runs (a knob of our step: DeepSpeed's pieces score with the teacher in process)."""
TEACHER_OVERLAP = Axis(
    "teacher_overlaps", "teacher_overlap", on_off, "on or off", "a served teacher's request in flight while the "
    "student's forward runs (on, default: ServedTeacher(overlap=True)) or waited for before it (off); served "
    "teachers only", applies_to=OURS, default=True, key="waited")
"""Whether a served teacher's answer is awaited or overlapped (``None`` for a teacher in process)."""
STEP_AXES += (TEACHER_SERVING, TEACHER_OVERLAP)
