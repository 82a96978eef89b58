"""The developers' kernel benchmarks (``python scripts/bench_kernels.py``, run by ``make perf``): the pieces that are
neither a whole rollout nor a whole OPSD step, each ours against a baseline (the code it replaced, or upstream's),
both in every iteration (``contest.Contest``), under the package's bench machinery (runner, statistics, result
schema, ``opsd-rollout compare``). They live beside the scripts, out of the installed package: a user runs
``bench``, ``step`` and ``compare``; these measure the pieces behind them, against baselines a user never calls.

One module a kernel, each with ``build(config, settings, built, device) -> Contest``; the scenario is
``scenario.py``, the command line ``cli.py``. This module is light (the command line reads ``KERNELS`` for its
help); ``prepare`` imports a kernel's module when it runs."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kernel:
    name: str
    reads: tuple[str, ...]
    """The config fields it reads besides ``kernel``; its configs hold ``None`` in the others (and ``fp32`` as their
    ``dtype`` when it does not read one), so axes it ignores add no configs."""
    what: str
    """One iteration, in words."""
    ours: str
    baseline: str
    model: bool = False
    """Whether it runs the settings' ``model`` (otherwise it makes its own tensors, at ``vocab_size``)."""


SHORT, LONG = 8, 40
"""The compile kernel's two calls per side and round: new tokens (their difference over ``LONG - SHORT`` is the
time per token); a prompt of that kernel must leave room for ``LONG`` of them."""

POSTPROCESS_STRATEGIES = ("generate", "static")
"""The generations the postprocess kernel replays for our side (``postprocess.py``)."""

ROLLOUT_SHAPE = ("dtype", "rows", "samples_per_prompt", "prompt_length", "response_length")

KERNELS: dict[str, Kernel] = {k.name: k for k in [
    Kernel("sampling", ("dtype", "rows", "vocab_size", "top_k", "top_p"),
           "one decode step's token selection from random logits [rows, vocab] (T = --temperature)",
           "rollout.sampling.sample (top-k candidates, inverse-CDF draw); greedy: its argmax path",
           "transformers' temperature/top-k/top-p warpers + multinomial (what generate(do_sample=True) runs)"),
    Kernel("postprocess", ("rows", "samples_per_prompt", "prompt_length", "response_length", "postprocess_strategy",
                           "response_width"),
           "one rollout's post-processing (EOS, padding, masks) of a precomputed batch, half its rows ending early",
           "our HybridEngineRollout's post_processing_ms, after strategy generate's output (the EOS searched for) or "
           "static's (each row's length handed over by the decode loop)",
           "DeepSpeed 0.19's HybridEngineRollout's post_processing_ms, on the same batch"),
    Kernel("attention", ROLLOUT_SHAPE,
           "one greedy rollout per layout, fixed length: decode ms per token, KV workspace bytes",
           "shared-prefix attention (each prompt's keys/values stored and read once for its n rows)",
           "every row's copy of its prompt's keys/values (shared_prefix=False)", model=True),
    Kernel("fused_loss", ("dtype", "rows", "response_length", "vocab_size", "teacher_cache"),
           "the JSD loss forward + backward from a student's hidden states [rows, response, --hidden-size] and head",
           "opsd.fused.fused_divergence (the LM head and the loss a chunk of tokens at a time, logits never whole)",
           "DeepSpeed 0.19's generalized_jsd_loss over materialized logits [rows, response, vocab] (backward to "
           "the logits)"),
    Kernel("weight_layout", ("dtype", "rows", "weight_shape"),
           "one pass over the model's nn.Linear layers (or one [out, in] weight) at rows x 1 tokens",
           "F.linear over an [in, out] copy (what RolloutOptions(cpu_transposed_weights=True) multiplies by)",
           "F.linear over the weight as the model keeps it, [out, in]", model=True),
    Kernel("compile", ("dtype", "rows", "prompt_length"),
           "ms per decode token: greedy calls of 40 and 8 new tokens (EOS ignored) differenced, over 32",
           "the compiled decode step (compile_decode=True: inductor, CUDA graphs on CUDA)",
           "the eager decode step", model=True),
    Kernel("profiling", ROLLOUT_SHAPE,
           "one greedy rollout, fixed length, timed from outside generate",
           "profiling on (HybridEngineRolloutConfig(enable_profiling=True))", "profiling off", model=True),
]}

DEFAULT_KERNELS = ("sampling", "postprocess", "attention", "fused_loss", "weight_layout", "profiling")
"""What a run with no ``--kernels`` measures: every kernel but ``compile`` (tens of seconds of compiling per
config on a CPU, and a C++ compiler)."""


def prepare(config: Any, settings: Any, built: Any, device: Any) -> Any:
    """The ``Contest`` of ``config``: its kernel's module, imported now (torch and what it measures)."""
    module = importlib.import_module(f"kernel_bench.{config.kernel}")
    return module.build(config, settings, built, device)
