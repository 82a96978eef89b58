"""Strategy ``static``: our own decode loop over a preallocated, reusable KV workspace.

admit (prefill each new prompt once; its keys/values copied to its samples' slots; first tokens sampled) ->
decode_one_token + sample for the rows in the batch, until every row has finished. At a check every ``k``
steps (one host read; under ZeRO-3 with several ranks, an all-reduce so every rank agrees) finished rows
retire: pending rows take their slots (continuous batching), or once none is pending the live rows move to
the front and the batch shrinks to a smaller size bucket (compaction). A row's random numbers depend only on
the seed, its index in the request and its step, so none of this changes a sampled token.

With ``shared_prefix`` (n > 1, prompts long enough) each prompt's keys/values live once in a prefix store and
the decode cache holds only the responses (``rollout/shared_prefix.py``): responses start at column 0 of a slot
(``_Run.start``) instead of after the prompt's ``P`` columns, and nothing is copied to a row's slot.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from opsd_rollout.modeling import position_ids
from opsd_rollout.rollout.compiled import LENGTH_BUCKET_MIN, CompiledStep, bucket
from opsd_rollout.rollout.config import SHARED_PREFIX_MIN_PROMPT
from opsd_rollout.rollout.counter_rng import rollout_key, uniforms
from opsd_rollout.rollout.length_forcing import LengthForcing
from opsd_rollout.rollout.sampling import precise_dtype, sample
from opsd_rollout.rollout.scheduler import Admission, RowScheduler
from opsd_rollout.rollout.shared_prefix import SharedPrefix, prefix_slots, shared_prefix_problem, slots_within
from opsd_rollout.rollout.strategies.base import DecodeStats
from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.weight_layout import TransposedLinears
from opsd_rollout.rollout.workspace import CacheFront, KVWorkspace, check_written

UNBOUNDED = 2**62  # a step budget no rollout reaches: rows wait for slots, the checks end the loop


def prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache_mask: torch.Tensor | None,
            cache: Any, cache_keyword: str) -> torch.Tensor:
    """ids, mask: [B, P] left-padded prompts; cache_mask: [B, cache width] or None (no padding).
    Fills ``cache`` (passed as ``cache_keyword``, the name the model's forward takes it by); returns the last
    logits [B, V]."""
    out = model(input_ids=ids, attention_mask=cache_mask, position_ids=position_ids(mask), use_cache=True,
                logits_to_keep=1, **{cache_keyword: cache})
    return out.logits[:, -1]


def decode_one_token(model: torch.nn.Module, token: torch.Tensor, position: torch.Tensor,
                     mask: torch.Tensor | None, cache: Any, cache_keyword: str) -> torch.Tensor:
    """token, position: [A, 1]; mask: [A, kv], [A, 1, 1, kv] or None. Returns logits [A, V] for the next token."""
    out = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                **{cache_keyword: cache})
    return out.logits[:, -1]


class StaticDecode:
    """Prefill once per prompt (B prompts, not B*n, with ``shared_prefill``), then a decode loop over slots."""

    name = "static"

    def __init__(self, *, shared_prefill: bool = True, stop_check_interval: int | None = None,
                 seed: int | None = None, compile_decode: bool = False, static_shapes: bool = False,
                 compact_rows: bool = True, kv_budget_bytes: int | None = None, cache_capacity: int | None = None,
                 shared_prefix: bool = True, shared_prefix_min_prompt: int = SHARED_PREFIX_MIN_PROMPT,
                 cpu_transposed_weights: bool = True, compile_options: dict[str, Any] | None = None):
        self.shared_prefill = shared_prefill
        self.shared_prefix, self.shared_prefix_min_prompt = shared_prefix, shared_prefix_min_prompt
        # A compiled step needs the same shapes every step: the whole cache, masked (``static_shapes``).
        # Eager decoding attends to the filled positions only, which is cheaper.
        self.static_shapes = static_shapes or compile_decode
        # only the one-token step is compiled (CUDA-graph friendly); prefill stays eager
        self.compiled = CompiledStep(decode_one_token, compile_options) if compile_decode else None
        self._decode_step = self.compiled or decode_one_token
        self.stop_check_interval = stop_check_interval
        self.compact_rows = compact_rows
        self.kv_budget_bytes, self.cache_capacity = kv_budget_bytes, cache_capacity
        self.seed = seed
        self.workspace = KVWorkspace()
        self.cpu_transposed_weights = cpu_transposed_weights
        self.linears = TransposedLinears()
        """CPU: the linear layers' weights in the layout oneMKL multiplies fast (``rollout/weight_layout.py``)."""
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

    def _key(self) -> int:
        """This call's random key: from ``seed`` and a count of calls (the same seed gives a repeatable sequence
        of different rollouts), or without a seed from torch's global RNG (``torch.manual_seed`` repeats it)."""
        self._calls += 1
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()))
        return rollout_key(seed, self._calls if self.seed is not None else 0)

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan) -> torch.Tensor:
        """prompt_ids, prompt_mask: [N, P] expanded prompts. Returns [N, P + R'] (a fresh tensor)."""
        config, device = target.forward_module.config, prompt_ids.device
        rows, P = prompt_ids.shape
        length = P + plan.max_new_tokens
        if self.cache_capacity is not None and length > self.cache_capacity:
            raise ValueError(f"continuous_cache_capacity {self.cache_capacity} is below prompt length {P} + "
                             f"max_new_tokens {plan.max_new_tokens}: each row's slot needs {length} columns")
        shared = self.shared_prefix_applies(target, plan.samples_per_prompt, P)
        stored = P  # the prefix store's columns
        if shared:
            length -= P  # a slot holds its response only: the prompt is in the prefix store, once
        if self.compiled is not None:  # a bounded set of cache lengths: one graph per bucket, not per length
            length = bucket(length, LENGTH_BUCKET_MIN)
            stored = bucket(P, LENGTH_BUCKET_MIN)  # the columns past the prompt stay masked
            self.compiled.prepare(device)
        dtype = target.cache_dtype
        slots = self.slots(target, rows, length, dtype, plan.continuous_batch_size,
                           prompt_length=P if shared else 0, prompts=rows // plan.samples_per_prompt)
        # flex attention compiles its kernel for each key length: the whole-cache layout keeps one length
        whole = self.static_shapes or target.spec.attention == "flex_attention"
        cache, front = self.workspace.cache(config, slots, length, dtype, device, whole=whole)
        prefix = None
        if shared:
            store = self.workspace.prefix_store(config, prefix_slots(rows // plan.samples_per_prompt, slots),
                                                stored, dtype, device)
            prefix = SharedPrefix(store, target.spec.config, plan.samples_per_prompt, slots,
                                  continuous=slots < rows, padded=stored > P or not bool(prompt_mask.all()),
                                  narrow=self.compiled is None)
        transposed = self.cpu_transposed_weights and not plan.layerwise_gather and self.linears.applies(
            target.model, target.dtype, device, slots)
        if transposed:  # the weights may have changed since the last call (training): copied again
            self.linears.refresh(target.model)
        run = _Run(self, target, prompt_ids, prompt_mask, plan, cache, front, slots, prefix)
        self.last_stats = run.stats
        run.stats.weight_layout = "transposed" if transposed else "model"
        try:
            with self.linears.decoding() if transposed else contextlib.nullcontext():
                tokens = run.loop()
        finally:
            if target.zero_stage == 3:  # whole weights kept between calls would undo ZeRO-3's partitioning
                self.linears.release()
        return torch.cat([prompt_ids, tokens], dim=1)

    def shared_prefix_applies(self, target: RolloutTarget, samples_per_prompt: int, prompt_length: int) -> bool:
        """Whether this rollout stores each prompt's keys/values once (``shared_prefix``): n > 1 samples share a
        prompt of at least ``shared_prefix_min_prompt`` columns, prefilled once, decoded by an attention the layout
        can replace (eager or compiled)."""
        return (self.shared_prefix and self.shared_prefill and samples_per_prompt > 1
                and prompt_length >= self.shared_prefix_min_prompt
                and shared_prefix_problem(target.spec) is None)

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

    def compile_step(self, *args: Any) -> None:
        """The compiled step's first call for a new shape, apart from the decode steps (probed: a profiled
        rollout times it as ``compile_ms``, and the forward inside is not a decode step)."""
        self.last_stats.compiled_graphs += self.compiled.first_call(*args)

    def compact(self, run: "_Run", order: list[int]) -> None:
        """Move the batch's rows ``order`` to its front (probed: a profiled rollout times it as compaction)."""
        run.compact(order)

    def probe_points(self) -> list[tuple[Any, str, str]]:
        return [(self.workspace, "allocate", "workspace_alloc"), (self, "compact", "compaction"),
                (self, "compile_step", "compile"), (self.linears, "refresh", "weight_layout")]


class _Run:
    """One rollout's decode loop: the per-slot tensors, the scheduler, and the steps."""

    def __init__(self, strategy: StaticDecode, target: RolloutTarget, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor, plan: RolloutPlan, cache: Any, front: CacheFront, slots: int,
                 prefix: SharedPrefix | None = None):
        self.strategy, self.target, self.plan, self.cache, self.front = strategy, target, plan, cache, front
        self.prefix = prefix
        self.start = 0 if prefix is not None else prompt_ids.shape[1]
        """The decode cache's column where responses begin: after the prompt, or 0 when prompts are shared."""
        self.model, self.keyword = target.model, target.cache_keyword
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        device = prompt_ids.device
        rows, self.P = prompt_ids.shape
        self.rows, self.max_new = rows, plan.max_new_tokens
        group = plan.samples_per_prompt if strategy.shared_prefill else 1
        self.group = group
        self.scheduler = RowScheduler(rows, group, slots)
        self.sdpa = target.spec.attention == "sdpa"
        self.continuous = slots < rows
        # masks: none at all when every row started together over unpadded prompts (attention reads only what
        # was written); else each slot's own row of what it may see
        self.masked = self.continuous or front.whole or (prefix is None and not bool(prompt_mask.all()))
        self.mask = strategy.workspace.mask(slots, front.length, device) if self.masked else None
        self.greedy = plan.greedy
        self.key = strategy._key() if not plan.greedy else 0
        self.eos = torch.tensor(plan.eos_token_ids, dtype=torch.int64, device=device)
        self.lockstep = plan.lockstep
        self.check_every = strategy.stop_check_interval or (8 if device.type == "cuda" else 1)
        self.checks = self.continuous or not plan.ignore_eos
        # steps after which every row has finished: a fixed budget, unless rows wait for slots
        self.budget = self.own_budget = UNBOUNDED if self.continuous else self.max_new - 1
        if self.lockstep:  # ranks may differ in both: they leave the loop and check on one schedule
            self.budget, self.checks = self._agree_on_schedule()
        self.sink = rows  # finished or empty slots write their tokens to this extra row and column
        self.out = strategy.workspace.tokens(rows + 1, self.max_new + 1, plan.pad_token_id, device)
        self.slot_row = torch.full((slots,), self.sink, dtype=torch.int64, device=device)
        self.gen = torch.zeros(slots, dtype=torch.int64, device=device)
        self.position = torch.zeros(slots, 1, dtype=torch.int64, device=device)
        self.token = torch.zeros(slots, dtype=torch.int64, device=device)
        self.running = torch.zeros(slots, dtype=torch.bool, device=device)
        self.finish = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
        self.prompt_logits: dict[int, torch.Tensor] = {}
        self.prefill_source: Any = None
        self.forcing = None
        if plan.response_lengths is not None:  # a benchmark workload's synthetic lengths
            self.forcing = LengthForcing(plan.response_lengths, plan.max_new_tokens, plan.eos_token_ids[0],
                                         plan.length_seed, device)
            self.forcing.start(prompt_ids, prompt_mask, plan.samples_per_prompt)
        self.stats = DecodeStats(slots=slots, kv_layout="copied" if prefix is None else "shared_prefix")
        module = target.forward_module  # a compiled step's graphs differ by model and hooks (the forward timer's)
        self.hooks = (id(module), len(module._forward_pre_hooks), len(module._forward_hooks))
        self.step_count = 0

    # ---- the loop ------------------------------------------------------------------------------------------

    def loop(self) -> torch.Tensor:
        """Returns the generated tokens [N, R']."""
        self.admit(self.scheduler.admit(0), first=True)
        while True:
            if self.checks and (self.step_count + 1) % self.check_every == 0 and self.check():  # every k tokens
                break
            if self.step_count >= self.budget:
                break
            self.step()
        self.stats.finish_forward = self.finish[:self.rows]
        width = self.step_count + 1 if not self.continuous else self.max_new
        return self.out[:self.rows, :min(width, self.max_new)].clone()

    def check(self) -> bool:
        """One host read of which rows still run (an all-reduce with several ranks); retire, admit, compact.
        Returns whether the rollout is done (on every rank)."""
        scheduler = self.scheduler
        live = self.running[:scheduler.active].tolist()
        scheduler.retire(live)
        admissions = scheduler.admit(self.step_count) if scheduler.pending else []
        done = scheduler.done and not admissions
        if self.lockstep:
            done, anyone_admits = self._agree(done, bool(admissions))
        else:
            anyone_admits = bool(admissions)
        if done:
            return True
        if anyone_admits:
            self.admit(admissions)
        elif self.strategy.compact_rows:
            order = scheduler.compaction(live)
            if order is not None:
                self.strategy.compact(self, order)
        return False

    def _agree_on_schedule(self) -> tuple[int, bool]:
        """With several ranks: the largest step budget and whether any rank checks. A rank whose rows are done
        earlier keeps stepping (``idle``) until all leave together."""
        flags = torch.tensor([self.budget, int(self.checks)], dtype=torch.int64, device=self.prompt_ids.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), bool(flags[1])

    def _agree(self, done: bool, admits: bool) -> tuple[bool, bool]:
        """Ranks stop together (all done) and admit together (any admits: the others run a prefill of their
        own when forwards gather parameters collectively)."""
        flags = torch.tensor([int(not done), int(admits)], device=self.running.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return not bool(flags[0]), bool(flags[1])

    # ---- admission -----------------------------------------------------------------------------------------

    def admit(self, admissions: list[Admission], first: bool = False) -> None:
        """Prefill the admitted rows' new prompts (once each), give each row its prompt's keys/values in its slot,
        and sample its first token."""
        if not admissions:
            self._join_prefill()  # the other ranks prefill
            return
        if self.prefix is None:
            prompts = self.scheduler.new_prompts(admissions)
        else:  # the rows read their prompts from the store: prefill those not in it yet
            prompts = [p for p in dict.fromkeys(a.prompt for a in admissions) if p not in self.prefix]
        representatives = torch.tensor([p * self.group for p in prompts], dtype=torch.int64,
                                       device=self.prompt_ids.device)
        direct = first and self.group == 1 and not self.continuous  # row i into slot i: prefill in place
        if prompts:
            logits = self._prefill(self.prompt_ids[representatives], self.prompt_mask[representatives],
                                   into_slots=direct, prompts=prompts)
            self.prompt_logits.update(zip(prompts, logits))
        else:  # every prompt already prefilled here; other ranks may prefill
            self._join_prefill()
        if self.prefix is None and first and not direct and len(admissions) == self.rows and self.group > 1:
            self._replicate_prompts()  # every row of every prompt, in order: one broadcast copy
        elif self.prefix is None and not direct:
            self._copy_prompts(admissions)
        if first:
            self.front.reset(self.start)  # every row's next key/value goes right after its prompt
        else:
            self.stats.admission_rounds += 1
            self.front.aligned = False  # admitted rows start behind the others: each slot its own column
        self._start_rows(admissions)
        # rows are admitted in request order: only the prompt of the next pending row still needs its logits
        waiting = self.scheduler.pending[0] // self.group if self.scheduler.pending else None
        self.prompt_logits = {p: v for p, v in self.prompt_logits.items() if p == waiting}

    def _join_prefill(self) -> None:
        """When forwards gather parameters collectively, a placeholder prefill joins the other ranks' prefill."""
        if self.plan.collective_forwards:
            self._prefill(self.prompt_ids[:1], self.prompt_mask[:1], into_slots=False)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, *, into_slots: bool,
                 prompts: list[int] | None = None) -> torch.Tensor:
        """One prefill forward of ``ids`` [k, P], into the decode cache's first rows (``into_slots``), the prefix
        store (shared prefix: the request's ``prompts``) or the prefill cache; returns the last logits [k, V]."""
        config, device = self.target.forward_module.config, ids.device
        dtype = self.target.cache_dtype
        masked = self.masked
        if self.prefix is not None and prompts is not None:
            cache = self.prefix.assign(prompts, mask, self.scheduler.prompts_in_use())
            front, width, masked = self.prefix.store.front, self.P, False  # attends to its own prompt only
        elif into_slots:
            cache, front = self.cache, self.front
            width = front.length if front.whole else self.P
        else:
            capacity = min(self.scheduler.slots, -(-self.rows // self.group))
            cache, front = self.strategy.workspace.prefill_cache(config, ids.shape[0], self.P, dtype, device,
                                                                 capacity=capacity)
            width = self.P
        front.begin(self.P)
        cache_mask = None
        if masked or not bool(mask.all()):
            cache_mask = mask.new_zeros(ids.shape[0], width, dtype=torch.bool)
            cache_mask[:, :self.P] = mask.bool()
        logits = prefill(self.model, ids, mask, cache_mask, cache, self.keyword)
        front.advance()
        check_written(cache, self.P, "prefill")
        self.stats.forwards += 1
        self.prefill_source = cache
        return logits

    def _replicate_prompts(self) -> None:
        """Prefill row ``i`` into slots ``i*n .. i*n+n-1``, for every prompt: a broadcast copy per tensor, no
        ``[B*n, ...]`` temporary."""
        for layer, origin in zip(self.cache.layers, self.prefill_source.layers):
            for target, values in ((layer.keys, origin.keys), (layer.values, origin.values)):
                prompts, heads, _, dim = values.shape
                target.view(prompts, self.group, heads, -1, dim)[:, :, :, :self.P].copy_(
                    values[:, :, :self.P].unsqueeze(1))

    def _copy_prompts(self, admissions: list[Admission]) -> None:
        """Each admitted row's prompt keys/values into its slot's first ``P`` columns."""
        device = self.slot_row.device
        from_prefill = [(a.slot, a.source[1]) for a in admissions if a.source[0] == "prefill"]
        from_slots = [(a.slot, a.source[1]) for a in admissions if a.source[0] == "slot" and a.source[1] != a.slot]
        # prefilled prompts first: a later sample of the same prompt copies them from its sibling's slot
        for pairs, source in ((from_prefill, self.prefill_source), (from_slots, self.cache)):
            if not pairs:
                continue
            dst = torch.tensor([d for d, _ in pairs], dtype=torch.int64, device=device)
            src = torch.tensor([s for _, s in pairs], dtype=torch.int64, device=device)
            for layer, origin in zip(self.cache.layers, source.layers):
                for target, values in ((layer.keys, origin.keys), (layer.values, origin.values)):
                    target[dst, :, :self.P] = values.index_select(0, src)[:, :, :self.P]

    def _start_rows(self, admissions: list[Admission]) -> None:
        """Slot state of the admitted rows, and their first tokens from their prompts' logits."""
        device = self.slot_row.device
        slots = torch.tensor([a.slot for a in admissions], dtype=torch.int64, device=device)
        rows = torch.tensor([a.row for a in admissions], dtype=torch.int64, device=device)
        self.slot_row[slots] = rows
        self.position[slots] = self.prompt_mask[rows].long().sum(dim=1, keepdim=True)
        self.front.columns[slots] = self.start
        if self.mask is not None:
            self.mask[slots, :self.start] = self.prompt_mask[rows, :self.start].bool()
            self.mask[slots, self.start:] = False
        if self.prefix is not None:
            self.prefix.place(slots, [a.row for a in admissions])
        position = {prompt: i for i, prompt in enumerate(self.prompt_logits)}
        index = torch.tensor([position[a.prompt] for a in admissions], dtype=torch.int64, device=device)
        logits = torch.stack(list(self.prompt_logits.values()))[index]  # [prompts, V], then one per row
        zero = torch.zeros_like(rows)
        token = self._sample(logits, rows, zero)
        self.out[rows, 0] = token
        finished = self._finished(token, zero)
        self.finish[rows] = torch.where(finished, self.stats.forwards - 1, self.finish[rows])
        self.token[slots], self.gen[slots], self.running[slots] = token, 1, ~finished
        self.stats.row_steps += len(admissions)

    # ---- one decode step -----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Every row of this rank has finished while other ranks still step (ZeRO-3 lockstep)."""
        return self.step_count >= self.own_budget or self.scheduler.done

    def step(self) -> None:
        active, front = self.scheduler.active, self.front
        if self.idle:  # join the other ranks' forward; rewrite the same columns, move nothing
            front.begin(1)
            self._forward(active, self._step_mask(active))
            self.stats.forwards += 1
            self.stats.row_steps += active
            self.step_count += 1
            return
        front.active = active
        if not front.aligned:
            front.width = self.scheduler.width(self.start, self.step_count)
        front.begin(1)
        mask = self._step_mask(active)
        logits = self._forward(active, mask)
        front.advance()
        self.stats.forwards += 1
        self.stats.row_steps += active
        live, rows, gen = self.running[:active], self.slot_row[:active], self.gen[:active]
        token = self._sample(logits, rows, gen)
        self.out[torch.where(live, rows, self.sink), torch.where(live, gen, self.max_new)] = token
        finished = live & self._finished(token, gen)
        sink_or_row = torch.where(finished, rows, self.sink)
        self.finish[sink_or_row] = self.stats.forwards - 1
        self.running[:active] = live & ~finished
        self.token[:active] = token
        self.position[:active] += 1
        self.gen[:active] += 1
        self.step_count += 1

    def _forward(self, active: int, mask: torch.Tensor | None) -> torch.Tensor:
        """One decode forward of the first ``active`` slots; a compiled step's first call for a shape apart."""
        inputs = (self.model, self.token[:active, None], self.position[:active], mask, self.cache, self.keyword)
        step, compiled = self.strategy._decode_step, self.strategy.compiled
        if compiled is not None and step is compiled:
            if self.plan.layerwise_gather:  # DeepSpeed's hooks gather inside every forward: they stay eager
                step = decode_one_token
            elif compiled.note_shape((active, self.scheduler.slots, self.front.length, self.target.dtype,
                                      None if mask is None else mask.dim(), self.hooks, self.stats.weight_layout,
                                      None if self.prefix is None else self.prefix.shape_key())):
                with self._attention(active):
                    self.strategy.compile_step(*inputs)
        with self._attention(active):
            if step is not compiled:
                return step(*inputs)
            logits, recompiled = compiled.loop_call(*inputs)
        self.stats.compiled_graphs += recompiled
        return logits

    def _attention(self, active: int) -> contextlib.AbstractContextManager:
        """Around a decode forward: the shared-prefix layout's attention, or the model's own."""
        return self.prefix.decoding(active, self.running) if self.prefix is not None else contextlib.nullcontext()

    def _step_mask(self, active: int) -> torch.Tensor | None:
        """The mask of this decode forward: the fed token's column switched on for each row, then the columns
        attention reads (4-D and ready for SDPA; 2-D for transformers to expand otherwise)."""
        if self.mask is None:
            return None
        front = self.front
        if front.aligned:
            self.mask[:active, front.column] = True
        else:
            self.mask[front.rows[:active], front.columns[:active]] = True
        view = self.mask[:active, :front.view_width]
        # 4-D masks reach the attention function as they are (shared-prefix attention reads this one)
        return view[:, None, None, :] if self.sdpa or self.prefix is not None else view

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        if self.forcing is not None:
            logits = self.forcing.adjust(logits, rows, steps)
        uniform = None if self.greedy else uniforms(self.key, rows, steps, precise_dtype(logits.device))
        token = sample(logits, self.plan, uniform)
        if self.forcing is not None:
            self.forcing.observe(rows, token)
        return token

    def _finished(self, token: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Whether the token at index ``steps`` ends its row: an EOS, or the last token allowed."""
        last = steps >= self.max_new - 1
        return last if self.plan.ignore_eos else last | torch.isin(token, self.eos)

    # ---- compaction ----------------------------------------------------------------------------------------

    def compact(self, order: list[int]) -> None:
        """Rows ``order`` become the batch's first ``len(order)`` slots: their keys/values (the columns written so
        far), masks and state move in place."""
        device = self.slot_row.device
        index = torch.tensor(order, dtype=torch.int64, device=device)
        size = len(order)
        width = self.front.length if self.front.whole else min(
            self.front.length, self.scheduler.width(self.start, self.step_count) + 1)
        # keys/values: only live rows that change slot, only the columns written (a filler row's are never read)
        moves = [(slot, source) for slot, (source, row) in enumerate(zip(order, self.scheduler.row_of))
                 if row is not None and slot != source]
        if moves:
            dst = torch.tensor([d for d, _ in moves], dtype=torch.int64, device=device)
            src = torch.tensor([s for _, s in moves], dtype=torch.int64, device=device)
            for layer in self.cache.layers:
                for buffer in (layer.keys, layer.values):
                    buffer[dst, :, :width] = buffer[src, :, :width]
        for state in (self.slot_row, self.gen, self.position, self.token, self.running, self.front.columns):
            state[:size] = state.index_select(0, index)
        if self.mask is not None:
            self.mask[:size] = self.mask.index_select(0, index)
        if self.prefix is not None:
            self.prefix.compact(self.scheduler.row_of[:size])
        self.stats.compactions += 1
