"""``HybridEngineRolloutConfig``: the rollout's knobs, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from opsd_rollout.rollout.lengths import LengthModel

STRATEGIES = ("static", "generate")
ZERO3_GATHER = ("once", "per_layer")
CACHE_POLICIES = ("retain", "release")
SHARED_PREFIX_MIN_PROMPT = 128
"""The shortest prompt (columns, padding included) for which ``shared_prefix`` is used by default: measured on
``llama-small`` (benchmarks/RESULTS.md, "Shared-prefix attention")."""


@dataclass(kw_only=True)
class HybridEngineRolloutConfig:
    """Configuration of :class:`opsd_rollout.HybridEngineRollout`.

    Accepts DeepSpeed's own ``HybridEngineRolloutConfig`` / ``RolloutConfig`` through :meth:`from_any`.
    """

    enable_profiling: bool = False
    """Record a ``RolloutProfile`` per call (``get_last_profile()``). Off: no synchronization, no hooks."""
    strategy: str = "static"
    """``static`` (default): our decode loop over a preallocated, reusable KV cache (shared prefill, sync-free sampling,
    early exit checked every ``stop_check_interval`` steps); models it cannot run fall back to ``generate``
    with a logged reason. ``generate``: transformers' ``generate`` (through the hybrid engine's patched
    ``generate`` when the engine has one)."""
    shared_prefill: bool = True
    """``static``: with ``n_samples_per_prompt > 1``, prefill each prompt once and copy its KV cache into its
    n sample rows, instead of prefilling B*n identical rows."""
    shared_prefix: bool = True
    """``static``, with ``n_samples_per_prompt > 1`` and ``shared_prefill``: store each prompt's keys/values once for
    its n samples and attend to them once per step for all n (shared-prefix attention: the prompt part and each
    row's own response part merged exactly by their log-sum-exps), when the prompt is at least
    ``shared_prefix_min_prompt`` columns long (eager or compiled). Off, or below that length, or for an
    attention other than ``sdpa``/``eager``: each row's slot holds a copy of its prompt's keys/values. The tokens
    are the same either way (up to the dtype's rounding); the profile's ``kv_layout`` says which ran."""
    shared_prefix_min_prompt: int = SHARED_PREFIX_MIN_PROMPT
    """The shortest prompt (columns of the prompt batch, padding included) that uses ``shared_prefix``; below it
    the copied layout is as fast (measured on ``llama-small``). 1 uses it for every prompt."""
    stop_check_interval: int | None = None
    """``static``: check for "every row finished" every k decode steps (one host read; an all-reduce under
    ZeRO-3 with several ranks). ``None``: every step on CPU, every 8 on CUDA."""
    seed: int | None = None
    """``static`` sampling: seed of the rollout's generator (same seed, same tokens). ``None`` draws each
    call's seed from torch's global RNG, so ``torch.manual_seed`` makes runs repeatable."""
    compile_decode: bool = False
    """``static``: compile the one-token decode step with ``torch.compile``: inductor with CUDA graphs on CUDA
    (``mode="reduce-overhead"``), inductor's C++ kernels on CPU (a C++ compiler is needed). Cache lengths round up
    to powers of two (at least 64) and the batch moves through compaction's size buckets, so a training run
    compiles a few graphs, each once per process (its time is the profile's ``compile_ms``, never in
    ``decode_ms``); inductor's on-disk cache spares most of it in the next process. Greedy tokens and seeded
    samples equal the eager loop's. Under ZeRO-3 with per-layer gathering the step stays eager. DeepSpeed's
    ``use_graph_capture`` maps here."""
    static_shapes: bool = False
    """``static``: every decode step sees the whole preallocated cache, masked (the same shapes at every step,
    what a CUDA graph needs; implied by ``compile_decode``). Off, each step attends only to the positions
    written so far, with no mask at all when no prompt is padded."""
    compact_rows: bool = True
    """``static``: rows that finished leave the decode batch; at a check, when no prompt waits and the live rows
    fit a smaller batch size (1, 2, 3, 4, 6, 8, 12, 16, ...: powers of two and 1.5x them), they move to the
    front and the batch shrinks, so a step costs what its live rows cost. Off: every row is computed until the
    last one finishes."""
    cpu_transposed_weights: bool = True
    """``static``, a float32 model on the CPU, at least 16 decode rows, at most 256 MiB of linear weights: multiply
    each plain ``nn.Linear`` (not a subclass) by an ``[in, out]`` copy of its weight, written at each call's start
    (oneMKL multiplies small matrices in the model's own ``[out, in]`` layout several times slower at a few dozen
    rows: a decode step of ``llama-small`` 1.66x faster at 16 rows, 1.37x at 32, equal at 64; a larger model's
    step, bound by reading its weights, gains little: ``qwen2-0.5b`` 0.99x at 16 rows). Costs the linear weights'
    bytes once more, kept between calls (freed after each call under ZeRO-3 or ``cache_policy="release"``; skipped
    with a warning when they would take over half the available RAM; per-layer ZeRO-3 gathering has no whole
    weight to copy), and a copy per call (``weight_layout_ms``); the profile's ``weight_layout`` says which ran.
    Off: the model's own layout."""
    kv_budget_bytes: int | None = None
    """``static``: most bytes the decode batch's key/value cache may take; the number of rows decoding at once
    (the slots) is chosen from it, so a long prompt or a large batch runs as continuous batching within the
    budget instead of running out of memory. ``None``: one slot per row (or ``continuous_batch_size``)."""
    continuous_cache_capacity: int | None = None
    """``static``: most key/value columns one slot may hold (DeepSpeed's field of the same name); a rollout whose
    prompt length plus ``max_new_tokens`` exceeds it is refused. ``None``: no limit."""
    zero3_gather: str = "once"
    """ZeRO-3 without the hybrid engine: ``once`` gathers every parameter once for the whole rollout (when
    it fits ``gather_memory_budget_bytes``), ``per_layer`` leaves DeepSpeed gathering layer by layer at
    every forward."""
    gather_memory_budget_bytes: int | None = None
    """Most bytes the one-time ZeRO-3 gather may materialize; ``None``: 80% of the device's free memory plus
    what torch's caching allocator holds unused (CUDA), or of available RAM (CPU). Above it, per-layer
    gathering is used, with a warning."""
    profile_forwards: bool = True
    """With profiling on, also time every forward (the prefill/decode split). Off leaves the model unhooked
    and the forward-derived profile fields ``None``."""
    cache_policy: str = "retain"
    """``retain`` keeps inference workspaces and the accelerator's cached memory between calls; ``release``
    frees them at the end of every call (``release_workspace()``), timed as ``inference_cache_ms``."""
    ignore_eos: bool = False
    """Benchmark mode: generation does not stop at EOS, so every row runs ``max_new_tokens`` steps. The
    returned batch still follows the contract (trimmed and padded after the first EOS)."""

    response_lengths: str | None = None
    """Benchmark workloads: force a synthetic response-length distribution on the rollout, e.g.
    ``lognormal:median=48,sigma=1.0`` or ``geometric:mean=64`` (capped at ``max_new_tokens``), decided by a
    hash of each row's own content so every engine and schedule gets the same lengths (``rollout/lengths.py``).
    ``None``: the model's own EOS (or none with ``ignore_eos``)."""

    merge_adapters: bool = False
    """For a PEFT model: merge the LoRA adapters into the base weights for generation and unmerge them
    after (timed as ``lora_fuse_ms``/``lora_unfuse_ms``). Greedy tokens match unmerged generation within
    the dtype's rounding; an unmerged adapter costs extra matmuls at every step."""

    def __post_init__(self) -> None:
        for name in ("enable_profiling", "profile_forwards", "ignore_eos", "merge_adapters", "shared_prefill",
                     "compile_decode", "static_shapes", "compact_rows", "shared_prefix", "cpu_transposed_weights"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {list(STRATEGIES)}; got {self.strategy!r}")
        if self.zero3_gather not in ZERO3_GATHER:
            raise ValueError(f"zero3_gather must be one of {list(ZERO3_GATHER)}; got {self.zero3_gather!r}")
        if self.stop_check_interval is not None and (isinstance(self.stop_check_interval, bool) or not isinstance(
                self.stop_check_interval, int) or self.stop_check_interval < 1):
            raise ValueError(f"stop_check_interval must be an int >= 1 or None; got {self.stop_check_interval!r}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {list(CACHE_POLICIES)}; got {self.cache_policy!r}")
        if self.response_lengths is not None:
            if not LengthModel.parse(self.response_lengths).synthetic:
                raise ValueError(f"response_lengths must be a synthetic distribution "
                                 f"(lognormal:..., geometric:..., uniform:...); "
                                 f"got {self.response_lengths!r}: 'fixed' is ignore_eos=True, 'natural' the default")
            if self.ignore_eos:
                raise ValueError("response_lengths forces EOS at each row's length: it cannot go with ignore_eos=True")
        for name in ("kv_budget_bytes", "continuous_cache_capacity"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None; got {value!r}")
        value = self.shared_prefix_min_prompt
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"shared_prefix_min_prompt must be an int >= 1; got {value!r}")

    @classmethod
    def from_any(cls, cfg: Any) -> "HybridEngineRolloutConfig":
        """Ours as is; ``None`` gives the defaults; a DeepSpeed config object is read by field name (the README
        says how each of its fields maps onto ours).

        DeepSpeed's continuous-batching layout options need no counterpart here: each slot's decode front is its
        own column (``align_decode_fronts``: aligned either way), and a slot never holds more than its prompt
        plus ``max_new_tokens`` columns (nothing to trim); ``enable_cache_trimming=True`` asks for finished rows'
        memory back, which is our row compaction (``compact_rows``, on by default).
        """
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        known = {f.name for f in fields(cls)}
        values = {name: getattr(cfg, name) for name in known if hasattr(cfg, name)}
        if getattr(cfg, "use_graph_capture", False):  # DeepSpeed's CUDA-graph decode is our compiled decode
            values.update(strategy="static", compile_decode=True)
        if getattr(cfg, "use_shared_prefill", False):
            values.update(strategy="static", shared_prefill=True)
        if getattr(cfg, "enable_cache_trimming", False):
            values.update(compact_rows=True)
        return cls(**values)
