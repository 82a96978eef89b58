"""Benchmark matrix axes: what each one is called, how its values are read from a flag or a config file, and
what a valid value is. A scenario lists the axes it has; nothing else parses axis values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opsd_rollout.rollout.config import CACHE_POLICIES, STRATEGIES
from opsd_rollout import checks
from opsd_rollout.bench.lengths import KINDS, LengthModel

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
    Axis("strategies", "strategy", choice(STRATEGIES), f"one of {', '.join(STRATEGIES)}",
         "static (default: our decode loop, shared prefill) or generate (transformers' generate)"),
    Axis("cache_policies", "cache_policy", choice(CACHE_POLICIES), f"one of {', '.join(CACHE_POLICIES)}",
         "retain (keep inference workspaces between calls) or release (free after each call)"),
    Axis("forward_timing", "forward_timing", on_off, "on or off", "on, off: time every forward pass "
         "(prefill/decode split)"),
    Axis("compile_decode", "compile_decode", on_off, "on or off", "off (default), on: the compiled decode step "
         "(strategy static; inductor, CUDA graphs on CUDA), compiled during warm-up (warmup_compile_ms)"),
    Axis("length_models", "lengths", length_model,
         "fixed, natural, lognormal:median=M,sigma=S, geometric:mean=M or uniform:low=L,high=H",
         "response lengths: fixed (EOS ignored: every row runs to the cap), natural (the model's EOS), or a synthetic "
         "distribution forced alike on every engine, e.g. lognormal:median=48,sigma=1.0 or geometric:mean=64 (capped "
         "at the response length)", split_specs),
)
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
