"""Strategy ``static``: our own decode loop over a preallocated, reusable KV workspace.

``StaticDecode.generate`` sizes one rollout (slots, cache length, KV layout), takes the buffers from the
workspace and runs a ``DecodeLoop`` (``rollout/decode/``): admit (prefill each new prompt once) -> decode steps
-> a check every ``k`` steps (retire, admit pending rows, compact), until every row has finished. A row's random
numbers depend only on the seed, its index in the request and its step, so the schedule never changes a token.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from opsd_rollout.rollout.compiled import LENGTH_BUCKET_MIN, CompiledStep, WarmShapes, bucket
from opsd_rollout.rollout.config import RolloutOptions
from opsd_rollout.rollout.counter_rng import rollout_key
from opsd_rollout.rollout.decode.layouts import CopiedLayout, KVLayout, SharedPrefixLayout
from opsd_rollout.rollout.decode.lockstep import lockstep_for
from opsd_rollout.rollout.decode.loop import Checks, DecodeLoop, Forwards, Sampling, SlotState, decode_one_token
from opsd_rollout.rollout.processors import RowLogitsProcessor
from opsd_rollout.rollout.scheduler import RowScheduler
from opsd_rollout.rollout.shared_prefix import (SharedPrefix, install, installed, prefix_slots,
                                                shared_prefix_problem, slots_within)
from opsd_rollout.rollout.decode.stats import DecodeStats
from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.row_kernel import RowKernelLinears
from opsd_rollout.rollout.weight_layout import TransposedLinears
from opsd_rollout.rollout.workspace import KVWorkspace


class StaticDecode:
    """Prefill once per prompt (B prompts, not B*n, with ``shared_prefill``), then a decode loop over slots."""

    name = "static"

    def __init__(self, *, shared_prefill: bool = True, seed: int | None = None, compile_decode: bool = False,
                 compact_rows: bool = True, kv_budget_bytes: int | None = None, cache_capacity: int | None = None,
                 options: RolloutOptions | None = None, compile_options: dict[str, Any] | None = None):
        self.shared_prefill, self.seed, self.compact_rows = shared_prefill, seed, compact_rows
        self.kv_budget_bytes, self.cache_capacity = kv_budget_bytes, cache_capacity
        self.options = options or RolloutOptions()
        # only the one-token step is compiled (CUDA-graph friendly); prefill stays eager
        self.compiled = CompiledStep(decode_one_token, compile_options) if compile_decode else None
        self.decode_step: Any = self.compiled or decode_one_token
        """What one decode step runs: ``decode_one_token``, or its ``CompiledStep``."""
        self.whole_cache = False
        """Decode steps see the whole cache, masked, also eagerly (derived: on with ``compile_decode`` or flex
        attention; tests set it to run the compiled step's layout eagerly)."""
        self.warmed = WarmShapes()
        """The bucket shapes the compiled step has been warmed for (each compiled once, apart from decode)."""
        self.workspace = KVWorkspace()
        self.linears = TransposedLinears()
        """CPU, opt-in: the linear layers' weights in the layout oneMKL multiplies fast (``rollout/weight_layout.py``)."""
        self.row_linears = RowKernelLinears()
        """CPU, opt-in: one-row products by our own kernel (``rollout/row_kernel.py``)."""
        self.last_stats = DecodeStats()
        self._calls = 0

    def release_workspace(self) -> None:
        self.workspace.release()
        self.linears.release()

    def unsupported_reason(self, target: RolloutTarget) -> str | None:
        """Why this strategy cannot run ``target`` (the rollout then uses ``generate``), or ``None``."""
        if target.hybrid_engine:
            return "the hybrid engine generates through its own patched generate()"
        if target.spec.static_cache_problem:
            return target.spec.static_cache_problem
        if target.spec.generation_processors:
            return (f"the model's generation_config sets {list(target.spec.generation_processors)}, which only "
                    "generate() applies")
        return None

    def prepare(self, target: RolloutTarget) -> None:
        """Once, when the rollout is built: the model's attention becomes its shared-prefix-capable twin (the
        same attention in every other forward), so no call ever changes the model's config."""
        if self.options.shared_prefix and self.shared_prefill and shared_prefix_problem(target.spec) is None:
            install(target.forward_module.config)

    def _key(self, call_seed: int | None = None) -> int:
        """This call's random key: from the call's own seed alone when it has one; else from ``seed`` and a count of
        calls (the same seed gives a repeatable sequence of different rollouts), or without a seed from torch's
        global RNG (``torch.manual_seed`` repeats it)."""
        if call_seed is not None:
            return rollout_key(call_seed, 0)
        self._calls += 1
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()))
        return rollout_key(seed, self._calls if self.seed is not None else 0)

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan, recorder: Any, processor: RowLogitsProcessor | None = None,
                 seed: int | None = None) -> torch.Tensor:
        """prompt_ids, prompt_mask: [N, P] expanded prompts. Returns [N, P + R'] (a fresh tensor)."""
        rows, P = prompt_ids.shape
        if self.cache_capacity is not None and P + plan.max_new_tokens > self.cache_capacity:
            raise ValueError(f"continuous_cache_capacity {self.cache_capacity} is below prompt length {P} + "
                             f"max_new_tokens {plan.max_new_tokens}: each row's slot needs "
                             f"{P + plan.max_new_tokens} columns")
        compiled = self.compiled is not None and not plan.layerwise_gather  # DeepSpeed's per-layer hooks: eager
        layout = self._layout(target, prompt_ids, prompt_mask, plan, compiled)
        stats = DecodeStats(slots=layout.scheduler.slots, kv_layout=layout.name, cache_capacity=layout.positions,
                            cache_bytes=layout.nbytes)
        self.last_stats = stats
        transposed = self._transposed_weights(target, plan, layout.scheduler.slots)
        row_kernel = not transposed and self._row_kernel(target, plan)
        stats.weight_layout = "transposed" if transposed else "row_kernel" if row_kernel else "model"
        if transposed:  # the weights may have changed since the last call (training): copied again
            with recorder.phase("weight_layout"):
                self.linears.refresh(target.model)
        if processor is not None:
            processor.start(prompt_ids, prompt_mask, plan.samples_per_prompt)
        out = self.workspace.tokens(rows + 1, plan.max_new_tokens + 1, plan.pad_token_id, prompt_ids.device)
        loop = DecodeLoop(
            plan=plan, layout=layout,
            state=SlotState(rows, layout.scheduler.slots, plan.max_new_tokens, out, layout.cache.length),
            forwards=Forwards(model=target.model, cache_keyword=target.cache_keyword, warmed=self.warmed,
                              step=decode_one_token if self.compiled is not None and not compiled else self.decode_step),
            sampling=Sampling(key=self._key(seed) if not plan.greedy else 0, processor=processor),
            checks=Checks(every=self.options.stop_check_interval or (8 if prompt_ids.device.type == "cuda" else 1),
                          compact=self.compact_rows, lockstep=lockstep_for(plan.lockstep, prompt_ids.device)),
            recorder=recorder, stats=stats)
        try:
            with (self.linears.decoding() if transposed else self.row_linears.decoding(target.model) if row_kernel
                  else contextlib.nullcontext()):
                tokens = loop.run()
        finally:
            if target.zero_stage == 3:  # whole weights kept between calls would undo ZeRO-3's partitioning
                self.linears.release()
        return torch.cat([prompt_ids, tokens], dim=1)

    def _layout(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                plan: RolloutPlan, compiled: bool) -> KVLayout:
        """The rollout's slots, cache length and KV layout, its buffers taken from the workspace."""
        config, device, dtype = target.forward_module.config, prompt_ids.device, target.cache_dtype
        rows, P = prompt_ids.shape
        n = plan.samples_per_prompt
        shared = self.shared_prefix_applies(target, n, P)
        length, stored = (plan.max_new_tokens if shared else P + plan.max_new_tokens), P
        if compiled:  # a bounded set of cache lengths: one graph per bucket, not per length
            length, stored = bucket(length, LENGTH_BUCKET_MIN), bucket(P, LENGTH_BUCKET_MIN)
            self.compiled.prepare(device)
        slots = self.slots(target, rows, length, dtype, plan.continuous_batch_size,
                           prompt_length=P if shared else 0, prompts=rows // n)
        # a compiled step needs the same shapes every step (the whole cache, masked); so does flex attention,
        # which compiles its kernel for each key length. Eager steps attend to the filled columns only
        whole = compiled or self.whole_cache or target.spec.attention == "flex_attention"
        cache = self.workspace.cache(config, slots, length, dtype, device, whole=whole)
        scheduler = RowScheduler(rows, n if self.shared_prefill else 1, slots)
        continuous = slots < rows
        common = dict(cache=cache, workspace=self.workspace, scheduler=scheduler, prompt_ids=prompt_ids,
                      prompt_mask=prompt_mask, config=config, dtype=dtype, sdpa=target.spec.attention == "sdpa")
        if not shared:
            # masks: none when every row started together over unpadded prompts (attention reads only what was
            # written); else each slot's own row of what it may see
            return CopiedLayout(masked=continuous or whole or not bool(prompt_mask.all()), **common)
        store = self.workspace.prefix_store(config, prefix_slots(rows // n, slots), stored, dtype, device)
        prefix = SharedPrefix(store, n, slots, continuous=continuous,
                              padded=stored > P or not bool(prompt_mask.all()), narrow=not compiled)
        return SharedPrefixLayout(prefix=prefix, masked=continuous or whole, **common)

    def shared_prefix_applies(self, target: RolloutTarget, samples_per_prompt: int, prompt_length: int) -> bool:
        """Whether this rollout stores each prompt's keys/values once (``shared_prefix``): n > 1 samples share a
        prompt of at least ``shared_prefix_min_prompt`` columns, prefilled once, decoded by an attention the
        layout can replace (eager or compiled), selected when the rollout was built."""
        return (self.options.shared_prefix and self.shared_prefill and samples_per_prompt > 1
                and prompt_length >= self.options.shared_prefix_min_prompt
                and shared_prefix_problem(target.spec) is None and installed(target.forward_module.config))

    def _transposed_weights(self, target: RolloutTarget, plan: RolloutPlan, slots: int) -> bool:
        """Whether this call multiplies by the CPU weight copies (opt-in: ``cpu_transposed_weights``)."""
        return (self.options.cpu_transposed_weights and not plan.layerwise_gather
                and self.linears.applies(target.model, target.dtype, target.device, slots))

    def _row_kernel(self, target: RolloutTarget, plan: RolloutPlan) -> bool:
        """Whether this call sends one-row products to the CPU kernel (opt-in: ``cpu_row_kernel``)."""
        return (self.options.cpu_row_kernel and not plan.layerwise_gather
                and self.row_linears.applies(target.model, target.device))

    def slots(self, target: RolloutTarget, rows: int, length: int, dtype: torch.dtype,
              continuous_batch_size: int | None, *, prompt_length: int = 0, prompts: int = 1) -> int:
        """Rows decoding at once: every row, or ``continuous_batch_size``, or what ``kv_budget_bytes`` holds
        (``length`` columns per slot, plus ``prompt_length`` per prefix slot in the shared-prefix layout)."""
        slots = min(rows, continuous_batch_size or rows)
        if self.kv_budget_bytes is not None:
            per_position = target.spec.kv.bytes_per_token(dtype.itemsize)
            fit = slots_within(self.kv_budget_bytes, per_position, slots, prompts, prompt_length, length,
                               shared=prompt_length > 0)
            if fit < 1:
                need = per_position * (length + prompt_length)
                raise ValueError(f"kv_budget_bytes {self.kv_budget_bytes} holds no row: one row's keys and values "
                                 f"over {length + prompt_length} positions take {need} bytes")
            slots = fit
        return slots

    @property
    def weight_layout_bytes(self) -> int:
        """The CPU weight copies held after the call (0 when none are)."""
        return self.linears.nbytes

    def probe_points(self) -> list[tuple[Any, str, str]]:
        return [(self.workspace, "allocate", "workspace_alloc")]
