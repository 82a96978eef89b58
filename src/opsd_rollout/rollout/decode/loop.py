"""One rollout's decode loop: admit, step, check, until every row has finished.

    admit   prefill each new prompt once, give each admitted row its prompt (the layout says where), sample
            its first token
    step    one decode forward of the first ``active`` slots, one token each (sampled from counter-based
            random numbers: a function of the seed, the request row and the step only)
    check   every ``k`` steps, one host read of which rows still run (agreed across ranks): retire them, admit
            pending rows into the freed slots (continuous batching) or, once none is pending, compact the live
            rows to the front of a smaller batch size bucket

The loop owns the order of things; the pieces own their state: ``SlotState`` (per slot), ``KVLayout`` (where
keys/values live), ``RowScheduler`` (which row is in which slot), ``Lockstep`` (ranks). Phases that are not
decode steps (compaction, a compile) are recorded through the ``recorder`` the loop is given.
"""

from __future__ import annotations

from typing import Any

import torch

from opsd_rollout.rollout.compiled import CompiledStep, NeedsCompile
from opsd_rollout.rollout.counter_rng import uniforms
from opsd_rollout.rollout.decode.layouts import KVLayout
from opsd_rollout.rollout.decode.lockstep import Lockstep, Solo
from opsd_rollout.rollout.decode.state import SlotState
from opsd_rollout.rollout.decode.steps import prefill
from opsd_rollout.rollout.processors import RowLogitsProcessor
from opsd_rollout.rollout.sampling import precise_dtype, sample
from opsd_rollout.rollout.scheduler import Admission, RowScheduler
from opsd_rollout.rollout.decode.stats import DecodeStats
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.workspace import check_written

UNBOUNDED = 2**62  # a step budget no rollout reaches: rows wait for slots, the checks end the loop


class DecodeLoop:
    """Generates the tokens of one rollout; ``run()`` returns them ``[N, R']``."""

    def __init__(self, *, model: torch.nn.Module, cache_keyword: str, plan: RolloutPlan, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor, scheduler: RowScheduler, layout: KVLayout, state: SlotState,
                 lockstep: Solo | Lockstep, recorder: Any, step_fn: Any, warmed: set, key: int,
                 check_every: int, compact: bool, processor: RowLogitsProcessor | None, stats: DecodeStats):
        self.model, self.keyword, self.plan = model, cache_keyword, plan
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.scheduler, self.layout, self.state, self.lockstep = scheduler, layout, state, lockstep
        self.recorder, self.step_fn, self.warmed, self.key = recorder, step_fn, warmed, key
        """``step_fn``: ``decode_one_token`` or a ``CompiledStep`` of it; ``warmed``: the bucket shapes it has
        compiled (kept by the strategy across calls)."""
        self.check_every, self.compact_rows, self.processor, self.stats = check_every, compact, processor, stats
        self.rows, self.max_new = prompt_ids.shape[0], plan.max_new_tokens
        self.continuous = scheduler.slots < self.rows
        self.eos_stops = processor is None or processor.eos_stops
        self.eos = torch.tensor(plan.eos_token_ids, dtype=torch.int64, device=prompt_ids.device)
        self.checks = self.continuous or self.eos_stops
        # steps after which every row has finished: a fixed budget, unless rows wait for slots
        self.budget = self.own_budget = UNBOUNDED if self.continuous else self.max_new - 1
        self.budget, self.checks = lockstep.schedule(self.budget, self.checks)
        self.prompt_logits: dict[int, torch.Tensor] = {}
        self.step_count = 0

    def run(self) -> torch.Tensor:
        with self.recorder.phase("scheduler"):
            admissions = self.scheduler.admit(0)
        self.admit(admissions, first=True)
        while True:
            if self.checks and (self.step_count + 1) % self.check_every == 0 and self.check():  # every k tokens
                break
            if self.step_count >= self.budget:
                break
            self.step()
        self.stats.finish_forward = self.state.finish[:self.rows]
        width = self.step_count + 1 if not self.continuous else self.max_new
        return self.state.tokens(self.rows, min(width, self.max_new))

    # ---- one decode step ---------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Every row of this rank has finished while other ranks still step (ZeRO-3 lockstep)."""
        return self.step_count >= self.own_budget or self.scheduler.done

    def step(self) -> None:
        active, idle = self.scheduler.active, self.idle
        # an idle rank joins the other ranks' forward: it rewrites the same columns and moves nothing
        width = None if idle else self.written_width
        mask, attention = self.layout.step_inputs(active, self.state.running, width)
        logits = self.forward(active, mask, attention)
        self.layout.step_done(moved=not idle)
        self.stats.forwards += 1
        self.stats.decode_steps += 1
        self.stats.row_steps += active
        self.step_count += 1
        if idle:
            return
        live, rows, count = self.state.live(active)
        token = self.sample(logits, rows, count)
        self.state.advance(active, token, live & self.finished(token, count), self.stats.forwards - 1)

    def written_width(self) -> int:
        """Columns the rows in the batch have written (a host loop over the slots: asked only when needed)."""
        return self.scheduler.width(self.layout.start, self.step_count)

    def forward(self, active: int, mask: torch.Tensor | None, attention: dict[str, Any]) -> torch.Tensor:
        """One decode forward of the first ``active`` slots; a compiled step's new shapes compiled apart first."""
        inputs = (self.model, self.state.token[:active, None], self.state.position[:active], mask,
                  self.layout.cache, self.keyword)
        if not isinstance(self.step_fn, CompiledStep):
            return self.step_fn(*inputs, **attention)
        shape = (active,) + self.layout.shape_key()
        if shape not in self.warmed:
            self.warm(inputs, attention)
            self.warmed.add(shape)
        try:
            return self.step_fn(*inputs, **attention)
        except NeedsCompile:  # a guard failed on a warmed shape (other hooks, a dynamo reset): compiled apart too
            self.warm(inputs, attention)
            return self.step_fn(*inputs, **attention)

    def warm(self, inputs: tuple, attention: dict[str, Any]) -> None:
        """The compiled step's warm-up call for this step's shape (timed as ``compile``, not a decode step). It
        writes this step's columns, which the real call then writes again."""
        with self.recorder.phase("compile"):
            self.stats.compiled_graphs += self.step_fn.warm(*inputs, **attention)
        self.layout.step_done(moved=False)
        self.layout.step_inputs(inputs[1].shape[0], self.state.running, None)  # the real call starts afresh

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """logits [A, V] of request rows ``rows`` at their step ``steps`` -> tokens [A]."""
        if self.processor is not None:
            logits = self.processor.adjust(logits, rows, steps)
        uniform = None if self.plan.greedy else uniforms(self.key, rows, steps, precise_dtype(logits.device))
        token = sample(logits, self.plan, uniform)
        if self.processor is not None:
            self.processor.observe(rows, token)
        return token

    def finished(self, token: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Whether the token at index ``steps`` ends its row: an EOS, or the last token allowed."""
        last = steps >= self.max_new - 1
        return last | torch.isin(token, self.eos) if self.eos_stops else last

    # ---- the check ---------------------------------------------------------------------------------------------

    def check(self) -> bool:
        """One host read of which rows still run (agreed across ranks); retire, admit, compact. Returns whether
        the rollout is done (on every rank)."""
        scheduler = self.scheduler
        live = self.state.running[:scheduler.active].tolist()
        with self.recorder.phase("scheduler"):
            scheduler.retire(live)
            admissions = scheduler.admit(self.step_count) if scheduler.pending else []
        done, anyone_admits = self.lockstep.agree(scheduler.done and not admissions, bool(admissions))
        if done:
            return True
        if anyone_admits:
            self.admit(admissions)
        elif self.compact_rows:
            with self.recorder.phase("scheduler"):
                order = scheduler.compaction(live)
            if order is not None:
                with self.recorder.phase("compaction"):
                    self.compact(order)
        return False

    def compact(self, order: list[int]) -> None:
        """Rows ``order`` become the batch's first ``len(order)`` slots."""
        self.stats.compacted_bytes += self.layout.compact(order, self.written_width() + 1)
        self.state.compact(torch.tensor(order, dtype=torch.int64, device=self.prompt_ids.device))
        self.stats.compactions += 1

    # ---- admission ---------------------------------------------------------------------------------------------

    def admit(self, admissions: list[Admission], first: bool = False) -> None:
        """Prefill the admitted rows' new prompts (once each), give each row its prompt's keys/values, and sample
        its first token."""
        if not admissions:
            self.join_prefill()  # the other ranks prefill
            return
        prompts = self.layout.prompts_to_prefill(admissions)
        if prompts:
            rows = torch.tensor([p * self.scheduler.n for p in prompts], dtype=torch.int64,
                                device=self.prompt_ids.device)
            ids, mask = self.prompt_ids[rows], self.prompt_mask[rows]
            logits = self.prefill(ids, mask, self.layout.prefill_target(prompts, mask, first))
            self.prompt_logits.update(zip(prompts, logits))
        else:  # every prompt already prefilled here; other ranks may prefill
            self.join_prefill()
        with self.recorder.phase("kv_placement"):
            self.layout.place(admissions, first)
        self.stats.peak_active_rows = max(self.stats.peak_active_rows, self.scheduler.occupied)
        if not first:
            self.stats.admission_rounds += 1
        self.start_rows(admissions)
        # rows are admitted in request order: only the prompt of the next pending row still needs its logits
        waiting = self.scheduler.pending[0] // self.scheduler.n if self.scheduler.pending else None
        self.prompt_logits = {p: v for p, v in self.prompt_logits.items() if p == waiting}

    def join_prefill(self) -> None:
        """When forwards gather parameters collectively, a placeholder prefill joins the other ranks' prefill."""
        if self.plan.collective_forwards:
            self.prefill(self.prompt_ids[:1], self.prompt_mask[:1], self.layout.scratch(1))

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, target: tuple) -> torch.Tensor:
        """One prefill forward of ``ids`` [k, P] into ``target`` (the layout's); returns the last logits [k, V]."""
        cache, front, width, masked = target
        P = ids.shape[1]
        front.begin(P)
        cache_mask = None
        if masked or not bool(mask.all()):
            cache_mask = mask.new_zeros(ids.shape[0], width, dtype=torch.bool)
            cache_mask[:, :P] = mask.bool()
        logits = prefill(self.model, ids, mask, cache_mask, cache, self.keyword)
        front.advance()
        check_written(cache, P, "prefill")
        self.stats.forwards += 1
        return logits

    def start_rows(self, admissions: list[Admission]) -> None:
        """The admitted rows' slot state and their first tokens, from their prompts' logits."""
        device = self.prompt_ids.device
        slots = torch.tensor([a.slot for a in admissions], dtype=torch.int64, device=device)
        rows = torch.tensor([a.row for a in admissions], dtype=torch.int64, device=device)
        position = {prompt: i for i, prompt in enumerate(self.prompt_logits)}
        index = torch.tensor([position[a.prompt] for a in admissions], dtype=torch.int64, device=device)
        logits = torch.stack(list(self.prompt_logits.values()))[index]  # [prompts, V], then one per row
        zero = torch.zeros_like(rows)
        token = self.sample(logits, rows, zero)
        self.state.start(slots, rows, self.prompt_mask[rows].long().sum(dim=1, keepdim=True), token,
                         self.finished(token, zero), self.stats.forwards - 1)
        self.stats.row_steps += len(admissions)
