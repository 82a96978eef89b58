"""``RolloutProfile``: what one ``generate`` call spent, where, on what shapes.

A frozen dataclass that also reads as a mapping, with DeepSpeed's profile key names as aliases, so
code written against ``deepspeed.runtime.rollout.HybridEngineRollout.get_last_profile()`` keeps working.
``to_dict()`` is that mapping as one flat, JSON-safe record (a JSON line, a scalar logger's input), and a record
reads back as a profile; ``str()`` is a few lines for a person.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from opsd_rollout.files import json_safe
from opsd_rollout.metrics import ATTRIBUTED_PHASES, DEEPSPEED_ALIASES, ROLLOUT_STAGES, bytes_text, label
DERIVED_KEYS = ("generation_overhead_ms", "cache_management_ms")
CACHE_MANAGEMENT_PHASES = ("workspace_alloc_ms", "compaction_ms", "kv_placement_ms")
"""The attributed phases that manage the key/value cache (DeepSpeed's ``cache_management_overhead_ms``)."""
ATTRIBUTED_FIELDS = tuple(f"{phase}_ms" for phase in ATTRIBUTED_PHASES)


@dataclass(frozen=True, kw_only=True, eq=True)
class _ProfileFields:
    """The fields of ``RolloutProfile``, apart so that the dataclass's generated ``__init__`` lives here and
    ``RolloutProfile``'s own can take a ``to_dict()`` record, DeepSpeed's names and derived keys included."""

    # stages
    prompt_expansion_ms: float
    """Repeating each prompt ``samples_per_prompt`` times."""
    generation_ms: float
    """Everything between expansion and post-processing: forwards, sampling, cache work."""
    prefill_ms: float | None
    """Forward passes over the prompts (chunked prefill included), measured on the model that ran, less
    the attributed phases that ran inside them (e.g. ZeRO-3 gathers), so stages never double count.
    This and the other forward-derived fields are ``None`` when forward timing is off."""
    decode_ms: float | None
    """Forward passes that feed one token per row, less the attributed phases inside them."""
    decode_steps: int | None
    """Number of decode forwards."""
    prefill_forwards: int | None
    """Number of prefill forwards (more than one when prefill is chunked)."""
    ttft_ms: float | None
    """Time to first token: from the start of the call to the end of the last prefill forward before the first
    decode forward."""
    tpot_ms: float | None
    """Time per output token: the median decode forward, wall time (attributed phases inside included)."""
    prefill_tokens: int | None
    """Token positions the prefill forwards processed (rows x query tokens, padding included)."""
    post_processing_ms: float
    """EOS trimming, padding, masks and batch assembly."""
    attention_mask_ms: float
    """Building the attention mask, inside ``post_processing_ms``."""
    total_ms: float
    """The whole call, validation excluded."""
    # attributed phases, inside generation
    param_gather_ms: float | None = None
    """ZeRO-3 parameter gathering (DeepSpeed's fetches, waits included)."""
    param_gather_count: int | None = None
    """ZeRO-3 all-gathers launched (one per coalesced group of parameters)."""
    param_gather_bytes: int | None = None
    """Bytes of full parameters those all-gathers assembled."""
    inference_cache_ms: float | None = None
    """Hybrid engine inference workspace retake/release."""
    lora_fuse_ms: float | None = None
    """LoRA fuse (hybrid engine) or PEFT adapter merge."""
    lora_unfuse_ms: float | None = None
    """LoRA unfuse or PEFT adapter unmerge."""
    gc_ms: float | None = None
    """``gc.collect`` calls during the rollout."""
    empty_cache_ms: float | None = None
    """Accelerator ``empty_cache`` calls during the rollout."""
    workspace_alloc_ms: float | None = None
    """Allocating the static strategy's KV workspace (``None`` when it was reused or not used)."""
    compaction_ms: float | None = None
    """Moving the live rows to the front of a shrunken decode batch (``None`` when no row left the batch)."""
    compile_ms: float | None = None
    """``compile_decode``: the compiled step's first calls for shapes new to the process (compiling them, when
    torch had to), apart from ``decode_ms`` (``None`` when every shape was seen before)."""
    weight_layout_ms: float | None = None
    """CPU: writing the linear layers' weights into their transposed copies at the call's start (``weight_layout``
    ``transposed``; ``None`` otherwise)."""
    scheduler_ms: float | None = None
    """Static strategy: the decode batch's host scheduling (retiring finished rows, admitting pending ones into
    freed slots, planning a compaction), the reads of which rows still run excluded."""
    kv_placement_ms: float | None = None
    """Static strategy: giving admitted rows their prompts' keys/values (copied from the prefill into their slots, or
    pointed at the prefix store) and their slots' masks."""
    workspace: str | None = None
    """Static strategy: ``reused`` or ``allocated`` KV workspace for this call (``None`` for ``generate``)."""
    # throughput
    generated_tokens: int
    """Real response tokens (up to and including the first EOS); padding after EOS excluded."""
    padded_tokens: int
    """Response positions holding padding: ``effective_batch_size * response_length - generated_tokens``."""
    tokens_per_second: float
    """``generated_tokens / total_ms``."""
    decode_tokens_per_second: float | None
    """Tokens produced by decode forwards (``generated_tokens`` less each row's first token) over ``decode_ms``."""
    prefill_tokens_per_second: float | None
    """``prefill_tokens / prefill_ms``."""
    # how the decode batch was used
    row_steps: int | None = None
    """Row-steps computed: one per row for its first token (from its prefill), plus the rows every decode forward
    computed, finished rows still in the batch included."""
    live_row_utilisation: float | None = None
    """``generated_tokens / row_steps``: the share of computed row-steps that produced a real token."""
    compactions: int | None = None
    """Times finished rows left the decode batch (it shrank to a smaller size)."""
    compiled_graphs: int | None = None
    """``compile_decode``: graphs torch compiled during this call (0 once every shape was seen)."""
    admission_rounds: int | None = None
    """Prefill rounds that admitted pending prompts into freed slots (``continuous_batch_size``)."""
    decode_slots: int | None = None
    """Rows the decode batch could hold: ``continuous_batch_size`` (at most every row, and what ``kv_budget_bytes``
    holds), or every row."""
    peak_active_rows: int | None = None
    """The most rows decoding at once (admitted, not finished): DeepSpeed's ``active_batch_size``."""
    row_latency_p50_ms: float | None = None
    """Per row, the time from the call's start to its last token: the median over rows (forward timing on)."""
    row_latency_p95_ms: float | None = None
    row_latency_max_ms: float | None = None
    kv_workspace_bytes: int | None = None
    """The static strategy's key/value buffers (decode cache, prefill cache, prefix store), kept between calls."""
    kv_layout: str | None = None
    """Static strategy: ``shared_prefix`` (each prompt's keys/values once, each row's response in its slot) or
    ``copied`` (each row's slot holds its prompt's keys/values too); ``None`` for ``generate``."""
    weight_layout: str | None = None
    """Static strategy: ``transposed`` (on the CPU, every float32 ``nn.Linear`` multiplied by an ``[in, out]`` copy of
    its weight: ``cpu_transposed_weights``), ``row_kernel`` (on the CPU, one-row products by our kernel over the
    model's weights: ``cpu_row_kernel``) or ``model`` (the weights as the model keeps them); ``None`` for
    ``generate``."""
    weight_layout_bytes: int | None = None
    """Bytes the static strategy's weight copies hold after the call, kept for the next one like the KV workspace
    (0 when none are held: never used, ``cache_policy="release"``, or under ZeRO-3, which frees them after each
    call); ``None`` for ``generate``."""
    # memory
    peak_memory_bytes: int
    """Accelerator peak allocated on CUDA; peak process RSS on CPU."""
    peak_memory_source: str
    """Where ``peak_memory_bytes`` came from (see ``profiling.memory.PeakMemory``)."""
    # metadata
    batch_size: int
    samples_per_prompt: int
    effective_batch_size: int
    prompt_length: int
    response_length: int
    max_new_tokens: int
    dtype: str
    device: str
    decoding: str
    """``greedy`` or ``sampling``."""
    strategy: str
    """The generation strategy that ran."""
    zero_stage: int
    world_size: int
    rank: int
    timer: str
    """``cuda_events`` or ``synchronized_clock``."""


class RolloutProfile(_ProfileFields, Mapping):
    """Stage timings (ms), throughput, peak memory and metadata of one rollout.

    Nesting: ``prompt_expansion_ms + generation_ms + post_processing_ms <= total_ms``;
    ``prefill_ms + decode_ms <= generation_ms``; ``attention_mask_ms <= post_processing_ms``.
    Attributed phases are ``None`` when they did not occur in the call.
    """

    def __init__(self, **values: Any) -> None:
        """By field name. A ``to_dict()`` record (a JSON line, a benchmark's iteration) reads back as it is,
        ``RolloutProfile(**record)``: the fields win, a DeepSpeed name stands for its field only where the field is
        absent, and derived keys are recomputed, not trusted (ranks' merged records may disagree on them)."""
        for alias, name in DEEPSPEED_ALIASES.items():
            if alias in values:
                values.setdefault(name, values.pop(alias))
        for key in DERIVED_KEYS:
            values.pop(key, None)
        super().__init__(**values)

    @property
    def attributed_ms(self) -> float:
        """All attributed phases together."""
        return sum(getattr(self, name) or 0.0 for name in ATTRIBUTED_FIELDS)

    @property
    def cache_management_ms(self) -> float | None:
        """Key/value cache work outside forwards: allocating the workspace, placing admitted rows' prompts,
        compaction (``None`` when none of them happened)."""
        parts = [getattr(self, name) for name in CACHE_MANAGEMENT_PHASES if getattr(self, name) is not None]
        return sum(parts) if parts else None

    @property
    def generation_overhead_ms(self) -> float:
        """Generation time outside forward passes and attributed phases (sampling, cache updates, ...)."""
        accounted = (self.prefill_ms or 0.0) + (self.decode_ms or 0.0) + self.attributed_ms
        return max(0.0, self.generation_ms - accounted)

    # Mapping protocol: fields, DeepSpeed aliases and derived keys.
    def __getitem__(self, key: str) -> Any:
        key = DEEPSPEED_ALIASES.get(key, key)
        if key in _FIELD_NAMES or key in DERIVED_KEYS:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        yield from _FIELD_NAMES
        yield from DERIVED_KEYS
        yield from DEEPSPEED_ALIASES

    def __len__(self) -> int:
        return len(_FIELD_NAMES) + len(DERIVED_KEYS) + len(DEEPSPEED_ALIASES)

    def to_dict(self) -> dict[str, Any]:
        """Every key the mapping answers (fields, ``generation_overhead_ms``, DeepSpeed's names), flat and
        JSON-safe: one record per rollout for a JSON line or a scalar logger, under names that stay put."""
        return json_safe({key: self[key] for key in self})

    def __str__(self) -> str:
        """A few lines for a person (``repr`` keeps every field): shapes, stages in ms, tokens/s, memory."""
        stages = ", ".join(f"{label(name)} {self[name]:.1f}" for name in ROLLOUT_STAGES if self[name] is not None)
        speed = [f"{self.tokens_per_second:.1f} tok/s"] + [
            f"{name} {value:.1f}{unit}" for name, value, unit in (
                ("decode", self.decode_tokens_per_second, " tok/s"), ("TTFT", self.ttft_ms, " ms"),
                ("TPOT", self.tpot_ms, " ms")) if value is not None]
        kv = f", KV workspace {bytes_text(self.kv_workspace_bytes)} ({self.kv_layout})" if self.kv_layout else ""
        return "\n".join([
            f"RolloutProfile: {self.batch_size} prompts x {self.samples_per_prompt} samples, prompt "
            f"{self.prompt_length}, response {self.response_length} of {self.max_new_tokens} tokens, {self.decoding}, "
            f"{self.strategy}, {self.dtype} on {self.device}, ZeRO-{self.zero_stage}, rank {self.rank} of "
            f"{self.world_size}",
            f"  stages ms: total {self.total_ms:.1f} = {stages}",
            f"  {self.generated_tokens} tokens ({self.padded_tokens} padding), {', '.join(speed)}",
            f"  peak memory {bytes_text(self.peak_memory_bytes)} ({self.peak_memory_source}){kv}, timer {self.timer}"])

    def stage_shares(self) -> dict[str, float]:
        """Each top-level stage and attributed phase as a fraction of ``total_ms``."""
        if self.total_ms <= 0:
            return {}
        return {name: self[name] / self.total_ms for name in ROLLOUT_STAGES if self[name] is not None}


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RolloutProfile))


def _ttft(forwards: list) -> float | None:
    """End of the last prefill forward before the first decode forward (later prefills admit other prompts)."""
    first = [f for f in forwards[:next((i for i, f in enumerate(forwards) if f.kind == "decode"), len(forwards))]]
    return first[-1].offset_ms + first[-1].ms if first else None


def _row_latencies(forwards: list | None, decode: Any, lengths: Any) -> dict[str, float | None]:
    """Percentiles over rows of the end of the forward that produced each row's last token."""
    fields = dict.fromkeys(("row_latency_p50_ms", "row_latency_p95_ms", "row_latency_max_ms"))
    if not forwards or decode is None or lengths is None:
        return fields
    index = decode.finish_forward if decode.finish_forward is not None else lengths - 1
    ends = torch.tensor([f.offset_ms + f.ms for f in forwards], dtype=torch.float64)
    latency = ends[index.to("cpu").clamp(0, len(forwards) - 1)]
    p50, p95 = torch.quantile(latency, torch.tensor([0.5, 0.95], dtype=torch.float64)).tolist()
    fields.update(row_latency_p50_ms=p50, row_latency_p95_ms=p95, row_latency_max_ms=float(latency.max()))
    return fields


def build_profile(*, stages: dict[str, float], forwards: list | None, phases: dict, peak_memory: tuple[int, str],
                  lengths: torch.Tensor, effective_batch_size: int, response_length: int, decode_stats: Any = None,
                  **metadata: Any) -> RolloutProfile:
    """Assemble a profile from resolved stage times (``StageRecorder.resolve``) and the call's facts.

    ``forwards`` is the list of ``ForwardTime`` (``None`` when forward timing was off); ``decode_stats`` the
    strategy's ``DecodeStats``; ``lengths`` [N] each row's response length. Tensors here are on the host (the
    rollout's copies, ``Clock.host_copy``): building a profile never waits for the device.
    """
    generated_tokens = int(lengths.sum())
    total_ms = stages["total"]
    forward_fields: dict[str, Any] = dict.fromkeys(
        ("prefill_ms", "decode_ms", "decode_steps", "prefill_forwards", "ttft_ms", "tpot_ms", "prefill_tokens",
         "decode_tokens_per_second", "prefill_tokens_per_second"))
    if forwards is not None:
        prefill = [f for f in forwards if f.kind == "prefill"]
        decode = [f for f in forwards if f.kind == "decode"]
        prefill_ms, decode_ms = sum(f.exclusive_ms for f in prefill), sum(f.exclusive_ms for f in decode)
        prefill_tokens = sum(f.rows * f.query_tokens for f in prefill)
        forward_fields.update(
            prefill_ms=prefill_ms, decode_ms=decode_ms, decode_steps=len(decode), prefill_forwards=len(prefill),
            ttft_ms=_ttft(forwards),
            tpot_ms=statistics.median(f.ms for f in decode) if decode else None, prefill_tokens=prefill_tokens,
            decode_tokens_per_second=((generated_tokens - effective_batch_size) / (decode_ms / 1e3)
                                      if decode_ms > 0 else None),
            prefill_tokens_per_second=prefill_tokens / (prefill_ms / 1e3) if prefill_ms > 0 else None)
    attributed: dict[str, Any] = {f"{phase}_ms": phases[phase].ms for phase in ATTRIBUTED_PHASES
                                  if phase in phases and (phases[phase].calls or phases[phase].events)}
    if "param_gather" in phases:
        attributed.update(param_gather_count=phases["param_gather"].events,
                          param_gather_bytes=phases["param_gather"].bytes)
    if decode_stats is not None:
        stats = decode_stats
        attributed.update(row_steps=stats.row_steps, compactions=stats.compactions, compiled_graphs=stats.compiled_graphs,
                          admission_rounds=stats.admission_rounds, decode_slots=stats.slots,
                          peak_active_rows=stats.peak_active_rows,
                          kv_layout=stats.kv_layout, weight_layout=stats.weight_layout,
                          live_row_utilisation=generated_tokens / stats.row_steps if stats.row_steps else None,
                          **_row_latencies(forwards, stats, lengths))
    return RolloutProfile(
        prompt_expansion_ms=stages["prompt_expansion"], generation_ms=stages["generation"],
        post_processing_ms=stages["post_processing"], attention_mask_ms=stages["attention_mask"],
        total_ms=total_ms, **attributed, **forward_fields,
        generated_tokens=generated_tokens, padded_tokens=effective_batch_size * response_length - generated_tokens,
        tokens_per_second=generated_tokens / (total_ms / 1e3) if total_ms > 0 else 0.0,
        peak_memory_bytes=peak_memory[0], peak_memory_source=peak_memory[1],
        effective_batch_size=effective_batch_size, response_length=response_length, **metadata)
