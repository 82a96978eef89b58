"""Benchmark matrix axes: what each one is called, how its values are read from a flag or a config file, and
what a valid value is. A scenario lists the axes it has; nothing else parses axis values.

The ``strategies`` axis names the contenders: our rollout's strategies (``static``, ``generate``) and
``deepspeed``, DeepSpeed's own ``HybridEngineRollout`` on the same engine. A knob axis that only one engine has
says so (``Axis.applies_to``): for a contender it does not apply to, its value is ``None`` (n/a) in the config,
so its values do not multiply that contender's configs (``for_contender``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opsd_rollout.rollout.config import CACHE_POLICIES, STRATEGIES
from opsd_rollout import checks
from opsd_rollout.bench.lengths import KINDS, LengthModel

CONTENDERS = (*STRATEGIES, "deepspeed")
"""The ``strategies`` axis: our rollout's strategies, and DeepSpeed's own ``HybridEngineRollout`` (``deepspeed``)."""
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


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(value: Any) -> int:
    """Bytes, or a number with KiB, MiB, GiB or TiB (``8GiB``, ``1.5GiB``), at least 1."""
    if isinstance(value, bool):
        raise ValueError
    text = str(value).strip().lower()
    number = text.rstrip("kmgtib")
    size = int(float(number) * _UNITS[text[len(number):]]) if text[len(number):] in _UNITS else 0
    if size < 1:
        raise ValueError
    return size


def size_text(size: int) -> str:
    """``8388608`` -> ``8MiB``: the largest unit that divides it exactly."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


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
    help: str
    """The flag's help."""
    split: Callable[[str], list[str]] = lambda text: text.split(",")
    """How a flag's comma list splits into values."""
    applies_to: tuple[str, ...] = CONTENDERS
    """The contenders (``strategies``) the knob exists for; for the others the config holds ``None`` (n/a)."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


ROLLOUT_AXES = (
    Axis("batch_sizes", "batch_size", positive_int, "an integer >= 1", "batch sizes (prompts per rollout)"),
    Axis("samples_per_prompt", "samples_per_prompt", positive_int, "an integer >= 1", "samples per prompt (n)"),
    Axis("prompt_lengths", "prompt_length", positive_int, "an integer >= 1", "prompt lengths in tokens"),
    Axis("response_lengths", "response_length", positive_int, "an integer >= 1",
         "response lengths (max_new_tokens)"),
    Axis("dtypes", "dtype", choice(DTYPES), f"one of {', '.join(DTYPES)}",
         "fp32, fp16, bf16 (a dtype the device cannot run is reported as skipped)"),
    Axis("decoding", "decoding", choice(DECODINGS), f"one of {', '.join(DECODINGS)}",
         "greedy, sampling (temperature/top-k/top-p below)"),
    Axis("zero_stages", "zero_stage", choice(ZERO_STAGES), "none (bare model) or a ZeRO stage 0-3",
         "0-3 (a DeepSpeed engine built from the model) or none (the bare model)"),
    Axis("strategies", "strategy", choice(CONTENDERS), f"one of {', '.join(CONTENDERS)}",
         "the contenders: static (default: our decode loop, shared prefill), generate (transformers' generate "
         "behind our rollout), deepspeed (DeepSpeed's own HybridEngineRollout on the same engine: ZeRO 0-3); with "
         "several, each config's ratio to --baseline"),
    Axis("cache_policies", "cache_policy", choice(CACHE_POLICIES), f"one of {', '.join(CACHE_POLICIES)}",
         "retain (keep inference workspaces between calls) or release (free after each call); static, generate",
         applies_to=STRATEGIES),
    Axis("forward_timing", "forward_timing", on_off, "on or off", "on, off: time every forward pass "
         "(prefill/decode split); static, generate (deepspeed always times its forwards)", applies_to=STRATEGIES),
    Axis("compile_decode", "compile_decode", on_off, "on or off", "off (default), on: the compiled decode step "
         "(strategy static; inductor, CUDA graphs on CUDA), compiled during warm-up (warmup_compile_ms)",
         applies_to=("static",)),
    Axis("continuous_batch_sizes", "continuous_batch_size", or_none(positive_int, "none", "off"),
         "none or an integer >= 1", "none (default): every row decodes at once; or the rows decoding at once "
         "(SamplingConfig.continuous_batch_size: pending prompts fill the slots rows leave); static",
         applies_to=("static",)),
    Axis("kv_budgets", "kv_budget_bytes", or_none(byte_size, "none", "off"), "none or a size such as 64MiB",
         "none (default) or the most bytes the decode batch's KV cache may take, e.g. 64MiB (kv_budget_bytes: the "
         "slots are chosen from it); static", applies_to=("static",)),
    Axis("compaction", "compact_rows", on_off, "on or off", "on (default), off: finished rows leave the decode "
         "batch and it shrinks (compact_rows); static", applies_to=("static",)),
    Axis("shared_prefix", "shared_prefix", on_off, "on or off", "on (default), off: n samples read their "
         "prompt's keys/values once (options.shared_prefix; prompts of at least shared_prefix_min_prompt "
         "columns); static", applies_to=("static",)),
    Axis("weight_copies", "cpu_transposed_weights", on_off, "on or off", "off (default), on: the CPU weight copies "
         "(options.cpu_transposed_weights, opt-in: float32 on the CPU, 16 or more decode rows); static",
         applies_to=("static",)),
    Axis("stop_check_intervals", "stop_check_interval", or_none(positive_int, "auto", "none"),
         "auto or an integer >= 1", "auto (default): every step on CPU, every 8 on CUDA; or k: check for finished "
         "rows every k decode steps (options.stop_check_interval); static", applies_to=("static",)),
    Axis("length_models", "lengths", length_model,
         "fixed, natural, lognormal:median=M,sigma=S, geometric:mean=M or uniform:low=L,high=H",
         "response lengths: fixed (EOS ignored: every row runs to the cap), natural (the model's EOS), or a synthetic "
         "distribution forced alike on every engine, e.g. lognormal:median=48,sigma=1.0 or geometric:mean=64 (capped "
         "at the response length)", split_specs),
)


def for_contender(axes: Sequence[Axis], fields: dict[str, Any]) -> dict[str, Any]:
    """A config's fields with every knob that does not apply to its contender (``fields["strategy"]``) set to
    ``None`` (n/a): the knob's values then give that contender one config, not one each."""
    return {**fields, **{axis.field: None for axis in axes
                         if axis.field in fields and fields["strategy"] not in axis.applies_to}}


STEP_AXES = ROLLOUT_AXES + (
    Axis("losses", "loss", choice(LOSSES), f"one of {', '.join(LOSSES)}", "forward_kl, reverse_kl, jsd over the "
         "teacher's distribution, or sampled_reverse_kl (the sampled tokens' log-probabilities: --estimator, the "
         "sampled teacher cache)"),
    Axis("betas", "beta", unit_float, "a number in [0, 1]",
         "generalized JSD beta in [0, 1] (0 = forward KL, 1 = reverse KL; jsd only)"),
    Axis("teacher_caches", "teacher_cache", teacher_cache, "full, sampled or top<k> (e.g. top64)",
         "full (every logit), top<k> (e.g. top64) or sampled (each sampled token's log-probability, the cache "
         "sampled_reverse_kl reads): the host teacher cache"),
)
