"""``HybridEngineRolloutConfig``: the rollout's knobs, validated when built.

Top level: DeepSpeed's fields (or ours they map onto) and what users tune. ``options`` (a ``RolloutOptions``)
holds the engine's finer knobs, each with the default measured to be the right one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from opsd_rollout import checks
from opsd_rollout.rollout.deepspeed_fields import NAMES as DEEPSPEED_NAMES
from opsd_rollout.rollout.deepspeed_fields import DeepSpeedFields, ReadBack, contradiction, implied_fields

STRATEGIES = ("static", "generate")
RESPONSE_WIDTHS = ("max_new_tokens", "longest")
ZERO3_GATHER = ("once", "per_layer")
CACHE_POLICIES = ("retain", "release")
SHARED_PREFIX_MIN_PROMPT = 128
"""The shortest prompt (columns, padding included) for which ``shared_prefix`` is used by default: measured on
``llama-small`` (benchmarks/RESULTS.md, "Shared-prefix attention")."""
CHOICES = {"strategy": STRATEGIES, "zero3_gather": ZERO3_GATHER, "cache_policy": CACHE_POLICIES,
           "response_width": RESPONSE_WIDTHS}
"""The text fields of ``HybridEngineRolloutConfig`` and the values each takes."""


@dataclass(kw_only=True)
class RolloutOptions:
    """The engine's finer knobs (``HybridEngineRolloutConfig.options``); the defaults are the measured choices."""

    shared_prefix: bool = True
    """``static``, with ``n_samples_per_prompt > 1`` and ``shared_prefill``: store each prompt's keys/values once for
    its n samples and attend to them once per step for all n (shared-prefix attention: the prompt part and each
    row's own response part merged exactly by their log-sum-exps), when the prompt is at least
    ``shared_prefix_min_prompt`` columns long. Off, or below that length, or for an attention other than
    ``sdpa``/``eager``: each row's slot holds a copy of its prompt's keys/values. The tokens are the same either
    way (up to the dtype's rounding); the profile's ``kv_layout`` says which ran. On, the model's attention
    implementation is its shared-prefix twin (``opsd_shared_prefix:sdpa``: SDPA itself in every other forward)."""
    shared_prefix_min_prompt: int = SHARED_PREFIX_MIN_PROMPT
    """The shortest prompt (columns of the prompt batch, padding included) that uses ``shared_prefix``; below it
    the copied layout is as fast. 1 uses it for every prompt."""
    stop_check_interval: int | None = None
    """``static``: check for finished rows every k decode steps (one host read; an all-reduce under ZeRO-3 with
    several ranks). ``None``: every step on CPU, every 8 on CUDA."""
    cpu_transposed_weights: bool = False
    """``static``, opt-in, a float32 model on the CPU, at least 16 decode rows, at most 256 MiB of linear weights:
    multiply each plain ``nn.Linear`` by an ``[in, out]`` copy of its weight, written at each call's start. Some
    CPUs' oneMKL multiplies small matrices in the model's ``[out, in]`` layout several times slower at a few dozen
    rows; elsewhere (GPUs, bfloat16, other BLAS) it gains nothing. Costs the linear weights' bytes once more and a
    copy per call (``weight_layout_ms``); the profile's ``weight_layout`` says which ran."""
    cpu_row_kernel: bool = False
    """``static``, opt-in, a float32 or bfloat16 model on the CPU: every one-row product (a decode step at batch 1)
    by our own kernel, which streams each weight row once and splits the rows across the cores
    (``rollout/row_kernel.py``; built on first use with a C++ compiler and ninja, cached by torch, skipped with a
    warning where it cannot be). The same products up to float32 rounding (summed in another order than oneMKL's);
    ``cpu_transposed_weights``, where it applies, comes first. The profile's ``weight_layout`` says ``row_kernel``."""
    gather_memory_budget_bytes: int | None = None
    """Most bytes the one-time ZeRO-3 gather may materialize; ``None``: 80% of the device's free memory plus
    what torch's caching allocator holds unused (CUDA), or of available RAM (CPU). Above it, per-layer
    gathering is used, with a warning."""
    profile_forwards: bool = True
    """With profiling on, also time every forward (the prefill/decode split). Off leaves the model unhooked
    and the forward-derived profile fields ``None``."""

    def __post_init__(self) -> None:
        for name in ("shared_prefix", "cpu_transposed_weights", "cpu_row_kernel", "profile_forwards"):
            checks.boolean(f"options.{name}", getattr(self, name))
        checks.integer("options.shared_prefix_min_prompt", self.shared_prefix_min_prompt)
        checks.integer("options.stop_check_interval", self.stop_check_interval, optional=True)
        checks.integer("options.gather_memory_budget_bytes", self.gather_memory_budget_bytes, optional=True)


@dataclass(kw_only=True)
class _ConfigFields:
    """The fields of ``HybridEngineRolloutConfig``, apart so that the dataclass's generated ``__init__`` lives here
    and ``HybridEngineRolloutConfig``'s own can take DeepSpeed's field names too."""

    enable_profiling: bool = False
    """Record a ``RolloutProfile`` per call (``get_last_profile()``). Off: no synchronization, no hooks."""
    strategy: str = "static"
    """``static`` (default): our decode loop over a preallocated, reusable KV cache; models it cannot run fall back
    to ``generate`` with a logged reason. ``generate``: transformers' ``generate`` (through the hybrid engine's
    patched ``generate`` when the engine has one)."""
    seed: int | None = None
    """``static`` sampling: seed of the rollout's random numbers (same seed, same tokens, whatever the schedule).
    ``None`` draws each call's seed from torch's global RNG, so ``torch.manual_seed`` makes runs repeatable."""
    compile_decode: bool = False
    """``static``: compile the one-token decode step with ``torch.compile``: inductor with CUDA graphs on CUDA,
    inductor's C++ kernels on CPU (a C++ compiler is needed). Cache lengths round up to powers of two (at least 64)
    and the batch moves through compaction's size buckets, so a training run compiles a few graphs, each once per
    process (its time is the profile's ``compile_ms``, never in ``decode_ms``). Greedy tokens and seeded samples
    equal the eager loop's. Under ZeRO-3 with per-layer gathering the step stays eager. DeepSpeed's
    ``use_graph_capture`` maps here."""
    shared_prefill: bool = True
    """``static``: with ``n_samples_per_prompt > 1``, prefill each prompt once for its n samples, instead of
    prefilling B*n identical rows. DeepSpeed's ``use_shared_prefill`` maps here."""
    kv_budget_bytes: int | None = None
    """``static``: most bytes the decode batch's key/value cache may take; the number of rows decoding at once
    (the slots) is chosen from it, so a long prompt or a large batch runs as continuous batching within the
    budget instead of running out of memory. ``None``: one slot per row (or ``continuous_batch_size``)."""
    compact_rows: bool = True
    """``static``: rows that finished leave the decode batch; at a check, when no prompt waits and the live rows
    fit a smaller batch size (1, 2, 3, 4, 6, 8, 12, 16, ...), they move to the front and the batch shrinks, so a
    step costs what its live rows cost. Off: every row is computed until the last one finishes. DeepSpeed's
    ``enable_cache_trimming`` maps here."""
    continuous_cache_capacity: int | None = None
    """``static``: most key/value columns one slot may hold (DeepSpeed's field of the same name); a rollout whose
    prompt length plus ``max_new_tokens`` exceeds it is refused. ``None``: no limit."""
    zero3_gather: str = "once"
    """ZeRO-3 without the hybrid engine: ``once`` gathers every parameter once for the whole rollout (when
    it fits ``options.gather_memory_budget_bytes``), ``per_layer`` leaves DeepSpeed gathering layer by layer at
    every forward."""
    cache_policy: str = "retain"
    """``retain`` keeps inference workspaces and the accelerator's cached memory between calls; ``release``
    frees them at the end of every call (``release_workspace()``), timed as ``inference_cache_ms`` (the workspaces)
    and ``empty_cache_ms`` (the accelerator's cached blocks)."""
    merge_adapters: bool = False
    """For a PEFT model: merge the LoRA adapters into the base weights for generation and unmerge them
    after (timed as ``lora_fuse_ms``/``lora_unfuse_ms``)."""
    response_width: str = "max_new_tokens"
    """The batch's response columns: ``max_new_tokens`` (DeepSpeed's width: ``P + max_new_tokens`` columns whatever
    the rows did, so batches stack across steps and gather across ranks) or ``longest`` (the longest response;
    under ZeRO-3 with several ranks, the longest on any rank, so every rank's batch has the same width). Columns
    past a row's end are padding with mask 0 either way; ``opsd_step`` and ``train`` compute only on the columns
    that hold tokens."""
    options: RolloutOptions = field(default_factory=RolloutOptions)
    """The engine's finer knobs: shared-prefix attention, stop-check interval, CPU weight copies, ZeRO-3 gather
    budget, forward timing."""
    deepspeed: DeepSpeedFields = field(default_factory=DeepSpeedFields)
    """DeepSpeed's own field names (``use_graph_capture``, ``use_shared_prefill``, ``align_decode_fronts``,
    ``enable_cache_trimming``) as they were given, as keywords of this config or by ``from_any``; each maps onto
    the fields above (docs/MIGRATING.md) and reads back as given."""

    def __post_init__(self) -> None:
        for name in ("enable_profiling", "compile_decode", "shared_prefill", "compact_rows", "merge_adapters"):
            checks.boolean(name, getattr(self, name))
        for name, choices in CHOICES.items():
            checks.choice(name, getattr(self, name), choices)
        for name in ("kv_budget_bytes", "continuous_cache_capacity"):
            checks.integer(name, getattr(self, name), optional=True)
        if not isinstance(self.options, RolloutOptions):
            raise TypeError(f"options must be a RolloutOptions; got {type(self.options).__name__}")
        if not isinstance(self.deepspeed, DeepSpeedFields):
            raise TypeError(f"deepspeed must be a DeepSpeedFields; got {type(self.deepspeed).__name__}")
        problem = contradiction(self.deepspeed, self)
        if problem:
            raise ValueError(problem)


class HybridEngineRolloutConfig(_ConfigFields):
    """Configuration of :class:`opsd_rollout.HybridEngineRollout`.

    Takes DeepSpeed's six field names as keywords beside ours (``HybridEngineRolloutConfig(use_shared_prefill=True,
    seed=0)``) and reads them back; DeepSpeed's own ``HybridEngineRolloutConfig`` / ``RolloutConfig`` objects are
    read by :meth:`from_any`.
    """

    def __init__(self, **values: Any) -> None:
        """By field name, and DeepSpeed's names (``use_graph_capture``, ``use_shared_prefill``,
        ``align_decode_fronts``, ``enable_cache_trimming``): each kept in ``deepspeed`` and mapped onto the field
        of ours that does its work; a contradiction between the two is a ``ValueError``."""
        given = {name: values.pop(name) for name in DEEPSPEED_NAMES if name in values}
        if given:
            if "deepspeed" in values:
                raise ValueError(f"give DeepSpeed's fields {sorted(given)} as keywords or in deepspeed=, not both")
            values = {**implied_fields(given, values), **values, "deepspeed": DeepSpeedFields(**given)}
        super().__init__(**values)

    def replace(self, **changes: Any) -> "HybridEngineRolloutConfig":
        """This config with ``changes`` (fields of ours or DeepSpeed's names) applied, validated again: a DeepSpeed
        name sets the field of ours it maps onto unless ``changes`` sets that field too."""
        given = {name: changes.pop(name) for name in DEEPSPEED_NAMES if name in changes}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "deepspeed"}
        values.update(changes, **implied_fields(given, changes))
        return type(self)(**values, deepspeed=DeepSpeedFields(**{**self.deepspeed.given(), **given}))

    # DeepSpeed's names, read back as given (or, not given, as what this config does: deepspeed_fields.read_back)
    use_graph_capture = ReadBack()
    use_shared_prefill = ReadBack()
    align_decode_fronts = ReadBack()
    enable_cache_trimming = ReadBack()

    @classmethod
    def from_flat(cls, **values: Any) -> "HybridEngineRolloutConfig":
        """A config from the names of its fields and of ``RolloutOptions``' fields side by side (how a script or a
        command line gives them): ``from_flat(seed=0, stop_check_interval=4)``."""
        option_names = {f.name for f in fields(RolloutOptions)}
        options = RolloutOptions(**{name: values.pop(name) for name in list(values) if name in option_names})
        return cls(options=options, **values)

    @classmethod
    def from_any(cls, cfg: Any) -> "HybridEngineRolloutConfig":
        """Ours as is; ``None`` gives the defaults; a DeepSpeed config object (``HybridEngineRolloutConfig``,
        ``RolloutConfig``) is read by field name: the names both configs have as they are, DeepSpeed's others as
        keywords (kept, and mapped onto ours as docs/MIGRATING.md says)."""
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        names = [f.name for f in fields(_ConfigFields) if f.name not in ("options", "deepspeed")]
        return cls(**{name: getattr(cfg, name) for name in (*names, *DEEPSPEED_NAMES) if hasattr(cfg, name)})
