"""One rollout's decode loop: admit, step, check, until every row has finished.

    admit   prefill each new prompt once, give each admitted row its prompt (the layout says where), sample
            its first token
    step    one decode forward of the first ``active`` slots, one token each (sampled from counter-based
            random numbers: a function of the seed, the request row and the step only)
    check   every ``k`` steps, one host read of which rows still run (agreed across ranks): retire them, admit
            pending rows into the freed slots (continuous batching) or, once none is pending, compact the live
            rows to the front of a smaller batch size bucket

A token's path is here, in the cache it is written to (``rollout/workspace.py``) and in the sampler
(``rollout/sampling.py``). Here: the two model calls ``prefill`` and ``decode_one_token`` (gpt-fast's names; the
write position is their argument, as gpt-fast passes ``input_pos``), ``SlotState`` (where each slot stands: its
row, position, write column, last token) and ``DecodeLoop`` (the order of things). ``KVLayout`` (where
keys/values live), ``RowScheduler`` (which row is in which slot) and ``Lockstep`` (ranks) are the loop's other
pieces. Phases that are not decode steps (compaction, a compile) are recorded through the ``recorder`` the loop
is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from opsd_rollout.modeling import position_ids
from opsd_rollout.rollout.compiled import CompiledStep, NeedsCompile, WarmShapes
from opsd_rollout.rollout.counter_rng import uniforms
from opsd_rollout.rollout.decode.layouts import KVLayout, PrefillTarget
from opsd_rollout.rollout.decode.lockstep import Lockstep, Solo
from opsd_rollout.rollout.decode.stats import DecodeStats
from opsd_rollout.rollout.processors import RowLogitsProcessor
from opsd_rollout.rollout.sampling import precise_dtype, sample
from opsd_rollout.rollout.scheduler import Admission
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.workspace import SlotCache, check_written

UNBOUNDED = 2**62  # a step budget no rollout reaches: rows wait for slots, the checks end the loop


# ---- the two model calls (only decode_one_token is ever compiled: one token per row, the shapes a CUDA graph
# replays). Extra keyword arguments reach the attention functions through transformers' attention interface ----

def prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache_mask: torch.Tensor | None,
            cache: SlotCache, cache_keyword: str, rows: torch.Tensor | None = None) -> torch.Tensor:
    """ids, mask: [k, P] left-padded prompts, written to columns ``0..P-1`` of the cache's first ``k`` rows (or of
    ``rows`` [k]); cache_mask: [k, cache width] or None (no padding). ``cache_keyword``: the name the model's
    forward takes the cache by. Returns the last logits [k, V]."""
    out = model(input_ids=ids, attention_mask=cache_mask, position_ids=position_ids(mask), use_cache=True,
                logits_to_keep=1, **{cache_keyword: cache.at(0, 0, rows)})
    return out.logits[:, -1]


def decode_one_token(model: torch.nn.Module, token: torch.Tensor, position: torch.Tensor,
                     column: torch.Tensor | int, width: int | None, mask: torch.Tensor | None, cache: SlotCache,
                     cache_keyword: str, **attention: Any) -> torch.Tensor:
    """token, position: [A, 1]; column: [A] the cache column each row's key/value goes to, or one int for all
    (``SlotCache.at``); width: the columns written before (``None`` in a compiled step); mask: [A, kv],
    [A, 1, 1, kv] or None; ``attention``: keyword arguments for the attention functions. Returns logits [A, V]
    for the next token."""
    out = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                **{cache_keyword: cache.at(column, width)}, **attention)
    return out.logits[:, -1]


# ---- where each slot stands ----------------------------------------------------------------------------------

class SlotState:
    """Per slot of the decode batch (``S``; the first ``active`` run): the request row it holds, its token count,
    position id, write column, last token and whether it runs; per request row (``N``), the tokens out. A
    finished or empty slot keeps stepping until the next check retires it: its token goes to a sink (an extra
    output row and column) and its keys/values past its row's last (at most to the cache's last column, which no
    live row writes), so nothing it computes is read."""

    def __init__(self, rows: int, slots: int, max_new_tokens: int, out: torch.Tensor, length: int):
        device = out.device
        self.sink, self.max_new, self.length = rows, max_new_tokens, length
        self.out = out
        """[N + 1, max_new_tokens + 1] the generated tokens per request row, pad-filled."""
        self.finish = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
        """[N + 1] per request row, the forward that produced its last token (-1 while it runs)."""
        self.generated = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        """[N + 1] per request row, the tokens it generated, its last included (0 while it runs)."""
        self.row = torch.full((slots,), self.sink, dtype=torch.int64, device=device)
        """[S] the request row each slot holds (the sink when none)."""
        self.count = torch.zeros(slots, dtype=torch.int64, device=device)
        """[S] tokens the slot's row has generated so far."""
        self.position = torch.zeros(slots, 1, dtype=torch.int64, device=device)
        """[S, 1] the position id of the slot's next token."""
        self.column = torch.zeros(slots, dtype=torch.int64, device=device)
        """[S] the cache column the slot's next key/value goes to (at most the cache's last, ``length - 1``)."""
        self.token = torch.zeros(slots, dtype=torch.int64, device=device)
        """[S] the token the next decode step feeds."""
        self.running = torch.zeros(slots, dtype=torch.bool, device=device)
        """[S] whether the slot's row still produces tokens."""
        self.aligned = True
        """Host: every slot writes the same column, ``width`` (all rows were admitted together)."""
        self.width = 0
        """Host: columns the longest-running row in the batch has written."""

    def start(self, slots: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, column: int,
              token: torch.Tensor, finished: torch.Tensor, forward: int, first: bool) -> None:
        """Slots ``slots`` [k] now hold request rows ``rows`` [k], whose next keys/values go to ``column`` and
        whose first token ``token`` came from forward ``forward`` (their prompt's prefill) and ended them where
        ``finished``."""
        self.row[slots], self.position[slots] = rows, positions
        self.column.index_fill_(0, slots, column)  # a number through a tensor index: a host copy and a wait on CUDA
        self.out[rows, 0] = token
        self.finish[rows] = torch.where(finished, forward, self.finish[rows])
        self.generated[rows] = finished.long()
        self.token[slots], self.running[slots] = token, ~finished
        self.count.index_fill_(0, slots, 1)
        if first:
            self.aligned, self.width = True, column
        else:  # admitted rows start behind the others: each slot its own column
            self.aligned = False

    def live(self, active: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``active`` slots' ``(running, row, count)``."""
        return self.running[:active], self.row[:active], self.count[:active]

    def advance(self, active: int, token: torch.Tensor, finished: torch.Tensor, forward: int) -> None:
        """After decode forward ``forward`` of the first ``active`` slots produced ``token`` [A] (``finished``: the
        rows it ended): write the live rows' tokens, retire the finished, move every slot one token on. A row that
        finished and is still in the batch (until the next check retires it) keeps writing the last column: rows
        that all started together reach the cache's end only once every one of them has finished."""
        live, rows, count = self.live(active)
        self.out[torch.where(live, rows, self.sink), torch.where(live, count, self.max_new)] = token
        ended = torch.where(finished, rows, self.sink)
        self.finish.index_fill_(0, ended, forward)
        self.generated[ended] = count + 1
        self.running[:active] = live & ~finished
        self.token[:active] = token
        self.position[:active] += 1
        self.count[:active] += 1
        self.column[:active].add_(1).clamp_(max=self.length - 1)
        self.width = min(self.width + 1, self.length - 1)

    def compact(self, index: torch.Tensor) -> None:
        """Slots ``index`` [k] become the first ``k`` slots, in that order."""
        size = index.numel()
        for tensor in (self.row, self.count, self.position, self.column, self.token, self.running):
            tensor[:size] = tensor.index_select(0, index)

    def tokens(self, rows: int, width: int) -> torch.Tensor:
        """[N, width] the generated tokens, a fresh tensor."""
        return self.out[:rows, :width].clone()


# ---- what the loop is given, besides the layout and the state ------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Forwards:
    """What the loop runs."""

    model: torch.nn.Module
    """The module every forward is called on (``engine.module`` under DeepSpeed, PEFT wrappers included)."""
    cache_keyword: str
    """The name the model's forward takes its cache by."""
    step: Callable[..., torch.Tensor] = decode_one_token
    """``decode_one_token``, or a ``CompiledStep`` of it."""
    warmed: WarmShapes = field(default_factory=WarmShapes)
    """The bucket shapes the compiled step has been warmed for (kept by the strategy across calls)."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How a row's next token is chosen, besides the plan's temperature, top-k and top-p."""

    key: int
    """This call's random key (unused when greedy)."""
    processor: RowLogitsProcessor | None = None
    """A hook on every sampled token's logits, by request row."""


@dataclass(frozen=True, kw_only=True)
class Checks:
    """When the loop reads which rows still run, and what it does then."""

    every: int
    """Steps between checks (``stop_check_interval``)."""
    compact: bool
    """Whether live rows move to the front of a smaller batch once none is pending."""
    lockstep: Solo | Lockstep = field(default_factory=Solo)
    """Ranks that must take the same forwards (ZeRO-3)."""


class DecodeLoop:
    """Generates the tokens of one rollout; ``run()`` returns them ``[N, R']``."""

    def __init__(self, *, plan: RolloutPlan, layout: KVLayout, state: SlotState, forwards: Forwards,
                 sampling: Sampling, checks: Checks, recorder: Any, stats: DecodeStats):
        self.plan, self.layout, self.state, self.forwards = plan, layout, state, forwards
        self.sampling, self.checks, self.recorder, self.stats = sampling, checks, recorder, stats
        self.scheduler, self.prompt_ids, self.prompt_mask = layout.scheduler, layout.prompt_ids, layout.prompt_mask
        self.compiled = isinstance(forwards.step, CompiledStep)
        self.rows, self.max_new = self.prompt_ids.shape[0], plan.max_new_tokens
        self.continuous = self.scheduler.slots < self.rows
        processor = sampling.processor
        self.eos_stops = processor is None or processor.eos_stops
        self.eos = torch.tensor(plan.eos_token_ids, dtype=torch.int64, device=self.prompt_ids.device)
        # steps after which every row has finished: a fixed budget, unless rows wait for slots
        self.budget = self.own_budget = UNBOUNDED if self.continuous else self.max_new - 1
        self.budget, self.checking = checks.lockstep.schedule(self.budget, self.continuous or self.eos_stops)
        self.prompt_logits: dict[int, torch.Tensor] = {}
        self.step_count = 0

    def run(self) -> torch.Tensor:
        with self.recorder.phase("scheduler"):
            admissions = self.scheduler.admit(0)
        self.admit(admissions, first=True)
        while True:
            if self.checking and (self.step_count + 1) % self.checks.every == 0 and self.check():  # every k tokens
                break
            if self.step_count >= self.budget:
                break
            self.step()
        self.stats.finish_forward = self.state.finish[:self.rows]
        # where each row stopped is where post-processing would find its first EOS, when EOS stops rows
        self.stats.lengths = self.state.generated[:self.rows] if self.eos_stops else None
        width = self.step_count + 1 if not self.continuous else self.max_new
        return self.state.tokens(self.rows, min(width, self.max_new))

    # ---- one decode step ---------------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Every row of this rank has finished while other ranks still step (ZeRO-3 lockstep)."""
        return self.step_count >= self.own_budget or self.scheduler.done

    def step(self) -> None:
        active, idle = self.scheduler.active, self.idle
        if not idle and not self.state.aligned:  # rows started at different steps: the longest-running one's fill
            self.state.width = self.written_width()
        if self.compiled:
            self.forwards.warmed.current(self.forwards.step)
            if (active,) + self.layout.shape_key() not in self.forwards.warmed:
                self.warm(active)
        try:
            logits = self.forward(active)
        except NeedsCompile:  # a guard failed on a warmed shape (other hooks, a dynamo reset): compiled apart too
            self.warm(active)
            logits = self.forward(active)
        self.layout.step_done()
        self.stats.forwards += 1
        self.stats.decode_steps += 1
        self.stats.row_steps += active
        self.step_count += 1
        if idle:  # an idle rank joins the other ranks' forward: it rewrites the same columns and moves nothing
            return
        live, rows, count = self.state.live(active)
        token = self.sample(logits, rows, count)
        self.state.advance(active, token, live & self.finished(token, count), self.stats.forwards - 1)

    def written_width(self) -> int:
        """Columns the rows in the batch have written (a host loop over the slots: asked only when needed)."""
        return self.scheduler.width(self.layout.start, self.step_count)

    def forward(self, active: int, warm: bool = False) -> Any:
        """One decode forward of the first ``active`` slots: logits [A, V]. With ``warm``, the compiled step's
        warm-up call for this shape instead (its keys/values go to the cache's last column, which only finished
        rows write; it returns the graphs it compiled)."""
        state, layout, forwards = self.state, self.layout, self.forwards
        # where the rows' keys/values go: one column while every slot writes the same one (a slice copy)
        column, width = state.width if state.aligned else state.column[:active], state.width
        mask, attention = layout.step_inputs(active, column, width, state.running)
        if self.compiled:  # its arguments keep their types and values from step to step: no host ints
            column, width = state.column[:active], None
            if warm:
                column = torch.full_like(column, layout.cache.length - 1)
        step = forwards.step.warm if warm else forwards.step
        return step(forwards.model, state.token[:active, None], state.position[:active], column, width, mask,
                    layout.cache, forwards.cache_keyword, **attention)

    def warm(self, active: int) -> None:
        """The compiled step's warm-up call for this step's shape: a forward of its own before the step (timed as
        ``compile``), on the step's inputs, writing only the cache's last column."""
        with self.recorder.phase("compile"):
            self.stats.compiled_graphs += self.forward(active, warm=True)
        self.layout.step_done()
        self.forwards.warmed.current(self.forwards.step)  # a graph this warm-up compiled may serve shapes warmed before
        self.forwards.warmed.add((active,) + self.layout.shape_key())

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """logits [A, V] of request rows ``rows`` at their step ``steps`` -> tokens [A]."""
        processor = self.sampling.processor
        if processor is not None:
            logits = processor.adjust(logits, rows, steps)
        uniform = None if self.plan.greedy else uniforms(self.sampling.key, rows, steps, precise_dtype(logits.device))
        token = sample(logits, self.plan, uniform)
        if processor is not None:
            processor.observe(rows, token)
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
        done, anyone_admits = self.checks.lockstep.agree(scheduler.done and not admissions, bool(admissions))
        if done:
            return True
        if anyone_admits:
            self.admit(admissions)
        elif self.checks.compact:
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
        self.start_rows(admissions, first)
        # rows are admitted in request order: only the prompt of the next pending row still needs its logits
        waiting = self.scheduler.pending[0] // self.scheduler.n if self.scheduler.pending else None
        self.prompt_logits = {p: v for p, v in self.prompt_logits.items() if p == waiting}

    def join_prefill(self) -> None:
        """When forwards gather parameters collectively, a placeholder prefill joins the other ranks' prefill."""
        if self.plan.collective_forwards:
            self.prefill(self.prompt_ids[:1], self.prompt_mask[:1], self.layout.scratch(1))

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, target: PrefillTarget) -> torch.Tensor:
        """One prefill forward of ``ids`` [k, P] into ``target`` (the layout's); returns the last logits [k, V]."""
        P = ids.shape[1]
        cache_mask = None
        if target.masked or not bool(mask.all()):
            cache_mask = mask.new_zeros(ids.shape[0], target.width, dtype=torch.bool)
            cache_mask[:, :P] = mask.bool()
        logits = prefill(self.forwards.model, ids, mask, cache_mask, target.cache, self.forwards.cache_keyword,
                         target.rows)
        check_written(target.cache, P, "prefill")
        self.stats.forwards += 1
        return logits

    def start_rows(self, admissions: list[Admission], first: bool) -> None:
        """The admitted rows' slot state and their first tokens, from their prompts' logits."""
        device = self.prompt_ids.device
        slots = torch.tensor([a.slot for a in admissions], dtype=torch.int64, device=device)
        rows = torch.tensor([a.row for a in admissions], dtype=torch.int64, device=device)
        position = {prompt: i for i, prompt in enumerate(self.prompt_logits)}
        index = torch.tensor([position[a.prompt] for a in admissions], dtype=torch.int64, device=device)
        logits = torch.stack(list(self.prompt_logits.values()))[index]  # [prompts, V], then one per row
        zero = torch.zeros_like(rows)
        token = self.sample(logits, rows, zero)
        self.state.start(slots, rows, self.prompt_mask[rows].long().sum(dim=1, keepdim=True), self.layout.start,
                         token, self.finished(token, zero), self.stats.forwards - 1, first)
        self.stats.row_steps += len(admissions)
