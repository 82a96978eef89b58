"""Every figure a profile or a benchmark reports, defined once: its label, its unit, how ranks merge it and
which way is better. The profile's attributed phases, the stage breakdowns, the comparison's metrics and the
multi-rank merge rules are all read from here; a new figure is added here and nowhere else.

A kernel (``opsd-rollout kernels``) times two implementations of one piece of work in every iteration: ours
(``kernel_ms``) and a baseline (``baseline_ms``: the code we replaced or upstream's), and their ratio (``speedup``:
baseline / ours, per iteration); the baseline is not judged by ``compare`` (its speed is not this package's).

Three words, three meanings: an **attributed phase** is work probed inside a rollout (a ZeRO-3 gather,
LoRA fuse, ``gc.collect``); a **forward kind** is ``prefill`` or ``decode``; a **step part** is one part of an
OPSD step (rollout, teacher, student forward, loss, backward, optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

MERGES = ("max", "sum", "mean")


@dataclass(frozen=True)
class Metric:
    name: str
    """The profile field (``total_ms``) it is read from."""
    label: str
    """Short, for table columns and plot legends."""
    unit: str
    """``ms``, ``bytes``, ``tokens/s``, ``tokens``, ``count``, ``ratio`` or ``loss``."""
    merge: str = "max"
    """Across ranks of one run: ``max`` (the slowest rank's time, the largest rank's memory), ``sum``
    (throughput and token counts: each rank rolls out its own prompts) or ``mean`` (ratios, losses)."""
    lower_is_better: bool | None = True
    """For comparisons; ``None``: not a performance figure."""
    compared: bool = False
    """``opsd-rollout compare`` judges it by default."""


def _ms(name: str, label: str, *, compared: bool = False) -> Metric:
    return Metric(name, label, "ms", compared=compared)


METRICS: dict[str, Metric] = {m.name: m for m in [
    # rollout stages
    _ms("total_ms", "total", compared=True),
    _ms("prompt_expansion_ms", "expand"),
    _ms("generation_ms", "generation"),
    _ms("prefill_ms", "prefill", compared=True),
    _ms("decode_ms", "decode", compared=True),
    _ms("generation_overhead_ms", "gen-other"),
    _ms("post_processing_ms", "post", compared=True),
    _ms("attention_mask_ms", "mask"),
    _ms("ttft_ms", "TTFT", compared=True),
    _ms("tpot_ms", "TPOT", compared=True),
    # attributed phases (inside generation)
    _ms("param_gather_ms", "gather"),
    _ms("inference_cache_ms", "cache"),
    _ms("lora_fuse_ms", "fuse"),
    _ms("lora_unfuse_ms", "unfuse"),
    _ms("gc_ms", "gc"),
    _ms("empty_cache_ms", "empty_cache"),
    _ms("workspace_alloc_ms", "alloc"),
    _ms("compaction_ms", "compact"),
    _ms("compile_ms", "compile"),
    _ms("weight_layout_ms", "weights"),
    _ms("scheduler_ms", "schedule"),
    _ms("kv_placement_ms", "place KV"),
    _ms("cache_management_ms", "cache mgmt"),
    Metric("compiled_graphs", "graphs", "count", merge="sum", lower_is_better=None),
    Metric("param_gather_count", "gathers", "count", merge="sum", lower_is_better=None),
    Metric("param_gather_bytes", "gathered", "bytes", merge="sum", lower_is_better=None),
    # throughput and counts
    Metric("tokens_per_second", "tok/s", "tokens/s", merge="sum", lower_is_better=False, compared=True),
    Metric("decode_tokens_per_second", "decode tok/s", "tokens/s", merge="sum", lower_is_better=False,
           compared=True),
    Metric("prefill_tokens_per_second", "prefill tok/s", "tokens/s", merge="sum", lower_is_better=False),
    Metric("generated_tokens", "tokens", "tokens", merge="sum", lower_is_better=None),
    Metric("padded_tokens", "padding", "tokens", merge="sum", lower_is_better=None),
    Metric("prefill_tokens", "prefill tokens", "tokens", merge="sum", lower_is_better=None),
    Metric("response_tokens", "response tokens", "tokens", merge="sum", lower_is_better=None),
    Metric("effective_batch_size", "rows", "count", merge="sum", lower_is_better=None),
    Metric("batch_size", "prompts", "count", merge="sum", lower_is_better=None),
    Metric("row_steps", "row-steps", "count", merge="sum", lower_is_better=None),
    Metric("live_row_utilisation", "live rows %", "ratio", merge="mean", lower_is_better=False),
    Metric("compactions", "compactions", "count", merge="sum", lower_is_better=None),
    Metric("admission_rounds", "admissions", "count", lower_is_better=None),
    Metric("decode_slots", "slots", "count", merge="sum", lower_is_better=None),
    Metric("peak_active_rows", "peak rows", "count", merge="sum", lower_is_better=None),
    Metric("prefill_forwards", "prefills", "count", lower_is_better=None),
    _ms("row_latency_p50_ms", "row p50"),
    _ms("row_latency_p95_ms", "row p95"),
    _ms("row_latency_max_ms", "row max"),
    # memory
    Metric("peak_memory_bytes", "peak", "bytes", compared=True),
    Metric("kv_workspace_bytes", "KV", "bytes"),
    Metric("weight_layout_bytes", "weight copies", "bytes"),
    # OPSD step parts
    _ms("eval_ms", "eval"),
    _ms("rollout_ms", "rollout", compared=True),
    _ms("train_ms", "train"),
    _ms("teacher_forward_ms", "teacher", compared=True),
    _ms("cache_write_ms", "cache write"),
    _ms("student_forward_ms", "student"),
    _ms("loss_ms", "loss time", compared=True),
    _ms("backward_ms", "backward", compared=True),
    _ms("optimizer_ms", "optim"),
    Metric("rollout_share", "rollout %", "ratio", merge="mean", lower_is_better=None),
    Metric("loss", "loss", "loss", merge="mean", lower_is_better=None),
    Metric("teacher_cache_bytes", "cache", "bytes", lower_is_better=None),
    Metric("teacher_parameter_bytes", "teacher params", "bytes", merge="max", lower_is_better=None),
    # kernels (``opsd-rollout kernels``): ours against a baseline implementation, both in every iteration
    _ms("kernel_ms", "ours", compared=True),
    _ms("baseline_ms", "baseline"),
    Metric("speedup", "speed-up", "ratio", merge="mean", lower_is_better=False, compared=True),
    _ms("greedy_ms", "greedy"),
    _ms("call_ms", "ours call"),
    _ms("baseline_call_ms", "baseline call"),
    Metric("baseline_peak_memory_bytes", "baseline peak", "bytes"),
    Metric("baseline_kv_workspace_bytes", "baseline KV", "bytes"),
]}

ATTRIBUTED_PHASES = ("param_gather", "inference_cache", "lora_fuse", "lora_unfuse", "gc", "empty_cache",
                     "workspace_alloc", "compaction", "compile", "weight_layout", "scheduler", "kv_placement")
"""The attributed phases a rollout profile reports, each as ``<phase>_ms``."""
ROLLOUT_STAGES = ("prompt_expansion_ms", "prefill_ms", "decode_ms", *(f"{p}_ms" for p in ATTRIBUTED_PHASES),
                  "generation_overhead_ms", "post_processing_ms")
"""A rollout's time, broken down: disjoint parts that add up to (at most) ``total_ms``."""
STEP_PARTS = ("rollout", "teacher", "student_forward", "loss", "backward", "optimizer")
"""The parts of an OPSD step, in the order they run."""
STEP_STAGES = ("eval_ms", "rollout_ms", "train_ms", "teacher_forward_ms", "cache_write_ms", "student_forward_ms",
               "loss_ms", "backward_ms", "optimizer_ms")
"""An OPSD step's time, broken down: disjoint parts that add up to (at most) its ``total_ms``."""


DEEPSPEED_ALIASES: dict[str, str] = {
    "prefill_forward_ms": "prefill_ms",
    "decode_forward_ms": "decode_ms",
    "num_decode_forwards": "decode_steps",
    "num_generated_tokens": "generated_tokens",
    "num_samples_per_prompt": "samples_per_prompt",
    "num_prefill_forwards": "prefill_forwards",
    "scheduler_overhead_ms": "scheduler_ms",
    "cache_management_overhead_ms": "cache_management_ms",
    "active_batch_size": "peak_active_rows",
    "continuous_batch_size": "decode_slots",
}
"""DeepSpeed's profile keys -> ours (a profile answers to both; records carry both)."""

ROLLOUT_PREFIX = "rollout/"
"""A step's flat record names its rollout's figures ``rollout/<key>``."""


def metric(name: str) -> Metric:
    """The registered metric (also under DeepSpeed's name, or a step record's ``rollout/`` name, so ranks merge
    every spelling of a figure by its rule), or a default one for an unregistered field (a time if it ends in
    ``_ms``)."""
    own = DEEPSPEED_ALIASES.get(name.removeprefix(ROLLOUT_PREFIX), name.removeprefix(ROLLOUT_PREFIX))
    if name in METRICS:
        return METRICS[name]
    if own in METRICS:
        return METRICS[own]
    unit = "ms" if name.endswith("_ms") else ("bytes" if name.endswith("_bytes") else "")
    return Metric(name, name.removesuffix("_ms"), unit, lower_is_better=True if unit else None)


def label(name: str) -> str:
    return metric(name).label
