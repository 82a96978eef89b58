"""Where the keys/values of a rollout live: the KV-layout interface and its two layouts.

Both keep the decode cache (``S`` slots x ``L`` columns, per layer; each forward is told where to write) and,
when some slot must not see every column, a ``[S, L]`` mask. They differ in where a row's prompt is:

- ``CopiedLayout``: in the first ``P`` columns of the row's own slot (prefilled there, or prefilled once per
  prompt and copied to its samples' slots); responses start at column ``P``.
- ``SharedPrefixLayout``: once per prompt in a prefix store, read once per step for its n samples
  (``rollout/shared_prefix.py``); the slot holds the response only, from column 0, and the decode forward
  passes the layout's state to the attention functions as a keyword argument.

The decode loop calls the same methods on either: ``prompts_to_prefill``, ``prefill_target``, ``place``,
``step_inputs``/``step_done`` around each decode forward, ``compact`` and ``shape_key``. Where each slot writes
next is the slot state's (``decode/loop.py``); a row's responses start at the layout's ``start`` column.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from opsd_rollout.rollout.scheduler import Admission, RowScheduler
from opsd_rollout.rollout.shared_prefix import SharedPrefix
from opsd_rollout.rollout.workspace import KVWorkspace, SlotCache


class PrefillTarget(NamedTuple):
    """Where a prefill forward writes: columns ``0..P-1`` of ``cache``'s first rows (or of ``rows``)."""

    cache: SlotCache
    width: int
    """The columns of the prefill's mask (the cache's, when the prefill reads the whole cache)."""
    masked: bool
    """Whether the prefill needs a mask even when no prompt is padded."""
    rows: torch.Tensor | None = None
    """[k] the cache rows the prompts go to (the prefix store's slots); ``None``: the first ``k``."""


class KVLayout:
    """The decode cache of one rollout and its mask; subclasses say where prompts live."""

    name = ""
    start = 0
    """The decode cache's column where responses begin."""

    def __init__(self, *, cache: SlotCache, workspace: KVWorkspace, scheduler: RowScheduler,
                 prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, config: Any, dtype: torch.dtype,
                 masked: bool, sdpa: bool):
        self.cache, self.workspace, self.scheduler = cache, workspace, scheduler
        self.prompt_ids, self.prompt_mask, self.config, self.dtype = prompt_ids, prompt_mask, config, dtype
        self.P = prompt_ids.shape[1]
        self.masked = masked
        self.mask = workspace.mask(scheduler.slots, cache.length, prompt_ids.device) if masked else None
        """[S, L] what each slot's row may attend to; ``None`` when every slot sees every column written (rows
        that started together over unpadded prompts: attention reads only what was written)."""
        self.four_d = sdpa
        """Whether decode masks go to the model 4-D (``[A, 1, 1, kv]``: as SDPA takes them, expanded by no one)."""

    # ---- admission ---------------------------------------------------------------------------------------------

    def prompts_to_prefill(self, admissions: list[Admission]) -> list[int]:
        """The prompts of ``admissions`` whose keys/values are nowhere yet, in prefill order."""
        raise NotImplementedError

    def prefill_target(self, prompts: list[int], masks: torch.Tensor, first: bool) -> PrefillTarget:
        """Where the prefill of ``prompts`` (masks ``[k, P]``) writes."""
        raise NotImplementedError

    def scratch(self, rows: int) -> PrefillTarget:
        """The prefill cache (``rows`` prompts), kept between calls: what a prefill that stays nowhere writes."""
        capacity = min(self.scheduler.slots, -(-self.prompt_ids.shape[0] // self.scheduler.n))
        cache = self.workspace.prefill_cache(self.config, rows, self.P, self.dtype, self.prompt_ids.device,
                                             capacity=capacity)
        return PrefillTarget(cache, self.P, self.masked)

    def place(self, admissions: list[Admission], first: bool) -> None:
        """Slots take the admitted rows: their masks (and, per layout, their prompts)."""
        device = self.prompt_ids.device
        slots = torch.tensor([a.slot for a in admissions], dtype=torch.int64, device=device)
        rows = torch.tensor([a.row for a in admissions], dtype=torch.int64, device=device)
        if self.mask is not None:
            self.mask[slots, :self.start] = self.prompt_mask[rows, :self.start].bool()
            self.mask[:, self.start:].index_fill_(0, slots, False)  # a number through a tensor index would wait

    # ---- one decode forward ------------------------------------------------------------------------------------

    def step_inputs(self, active: int, column: torch.Tensor | int, width: int, running: torch.Tensor) -> tuple[
            torch.Tensor | None, dict[str, Any]]:
        """Before a decode forward of the first ``active`` slots, which write at ``column`` (one int for all, or
        [A]) after ``width`` columns written (``running``: which rows still produce tokens): the mask and the
        attention's keyword arguments."""
        return self._step_mask(active, column, width), {}

    def step_done(self) -> None:
        """After the decode forward."""

    def _step_mask(self, active: int, column: torch.Tensor | int, width: int) -> torch.Tensor | None:
        """The fed token's column switched on for each row, then the columns attention reads."""
        if self.mask is None:
            return None
        if isinstance(column, int):
            self.mask[:active, column] = True
        else:
            self.mask[self.cache.slot_ids[:active], column] = self.mask.new_ones(())  # a device value: no host copy
        view = self.mask[:active, :self.cache.length if self.cache.whole else width + 1]
        return view[:, None, None, :] if self.four_d else view

    # ---- compaction ----------------------------------------------------------------------------------------------

    def compact(self, order: list[int], width: int) -> int:
        """Slots ``order`` become the first ``len(order)`` (the scheduler's ``row_of`` already says so): their
        keys/values over the ``width`` columns written, and masks move in place. Returns the bytes of
        keys/values moved."""
        device = self.prompt_ids.device
        index = torch.tensor(order, dtype=torch.int64, device=device)
        width = self.cache.length if self.cache.whole else min(self.cache.length, width)
        # only live rows that change slot (a filler row's keys/values are never read)
        moves = [(slot, source) for slot, (source, row) in enumerate(zip(order, self.scheduler.row_of))
                 if row is not None and slot != source]
        moved = 0
        if moves:
            dst = torch.tensor([d for d, _ in moves], dtype=torch.int64, device=device)
            src = torch.tensor([s for _, s in moves], dtype=torch.int64, device=device)
            for layer in self.cache.layers:
                for buffer in (layer.keys, layer.values):
                    buffer[dst, :, :width] = buffer[src, :, :width]
                    moved += len(moves) * buffer[0, :, :width].numel() * buffer.element_size()
        if self.mask is not None:
            self.mask[:len(order)] = self.mask.index_select(0, index)
        return moved

    @property
    def positions(self) -> int:
        """Key/value positions one row can span: its slot's columns."""
        return self.cache.length

    @property
    def nbytes(self) -> int:
        """Bytes of this rollout's key/value cache (the slots)."""
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def shape_key(self) -> tuple:
        """The sizes a compiled decode step's graph depends on besides its batch."""
        return (self.scheduler.slots, self.cache.length, None if self.mask is None else self.four_d)


class CopiedLayout(KVLayout):
    """Each slot holds its row's prompt keys/values in its first ``P`` columns."""

    name = "copied"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.start = self.P
        self.group = self.scheduler.n
        self.direct = self.group == 1 and self.scheduler.slots == self.prompt_ids.shape[0]
        """Row i decodes in slot i and shares its prompt with no other row: the first prefill writes the slots."""
        self.source: Any = None
        """The cache the last prefill wrote (the prompts' keys/values are copied from it)."""

    def prompts_to_prefill(self, admissions: list[Admission]) -> list[int]:
        return self.scheduler.new_prompts(admissions)

    def prefill_target(self, prompts: list[int], masks: torch.Tensor, first: bool) -> PrefillTarget:
        if first and self.direct:
            target = PrefillTarget(self.cache, self.cache.length if self.cache.whole else self.P, self.masked)
        else:
            target = self.scratch(len(prompts))
        self.source = target.cache
        return target

    def place(self, admissions: list[Admission], first: bool) -> None:
        if first and not self.direct and len(admissions) == self.prompt_ids.shape[0] and self.group > 1:
            self._replicate_prompts()  # every row of every prompt, in order: one broadcast copy
        elif not (first and self.direct):
            self._copy_prompts(admissions)
        super().place(admissions, first)

    def _replicate_prompts(self) -> None:
        """Prefill row ``i`` into slots ``i*n .. i*n+n-1``, for every prompt: a broadcast copy per tensor, no
        ``[B*n, ...]`` temporary."""
        for layer, origin in zip(self.cache.layers, self.source.layers):
            for target, values in ((layer.keys, origin.keys), (layer.values, origin.values)):
                prompts, heads, _, dim = values.shape
                target.view(prompts, self.group, heads, -1, dim)[:, :, :, :self.P].copy_(
                    values[:, :, :self.P].unsqueeze(1))

    def _copy_prompts(self, admissions: list[Admission]) -> None:
        """Each admitted row's prompt keys/values into its slot's first ``P`` columns: prefilled prompts first, so a
        later sample of the same prompt copies them from its sibling's slot."""
        device = self.prompt_ids.device
        from_prefill = [(a.slot, a.source[1]) for a in admissions if a.source[0] == "prefill"]
        from_slots = [(a.slot, a.source[1]) for a in admissions if a.source[0] == "slot" and a.source[1] != a.slot]
        for pairs, source in ((from_prefill, self.source), (from_slots, self.cache)):
            if not pairs:
                continue
            dst = torch.tensor([d for d, _ in pairs], dtype=torch.int64, device=device)
            src = torch.tensor([s for _, s in pairs], dtype=torch.int64, device=device)
            for layer, origin in zip(self.cache.layers, source.layers):
                for target, values in ((layer.keys, origin.keys), (layer.values, origin.values)):
                    target[dst, :, :self.P] = values.index_select(0, src)[:, :, :self.P]


class SharedPrefixLayout(KVLayout):
    """Each prompt's keys/values once, in the prefix store; the slots hold the responses."""

    name = "shared_prefix"

    def __init__(self, *, prefix: SharedPrefix, **kwargs: Any):
        super().__init__(**kwargs)
        self.prefix = prefix
        self.four_d = True  # the shared-prefix attention reads the 4-D mask as it is

    def prompts_to_prefill(self, admissions: list[Admission]) -> list[int]:
        return [p for p in dict.fromkeys(a.prompt for a in admissions) if p not in self.prefix]

    def prefill_target(self, prompts: list[int], masks: torch.Tensor, first: bool) -> PrefillTarget:
        cache, rows = self.prefix.assign(prompts, masks, self.scheduler.prompts_in_use())
        return PrefillTarget(cache, self.P, False, rows)  # a prompt attends to its own columns only

    def place(self, admissions: list[Admission], first: bool) -> None:
        super().place(admissions, first)
        slots = torch.tensor([a.slot for a in admissions], dtype=torch.int64, device=self.prompt_ids.device)
        self.prefix.place(slots, [a.row for a in admissions])

    def step_inputs(self, active: int, column: torch.Tensor | int, width: int, running: torch.Tensor) -> tuple[
            torch.Tensor | None, dict[str, Any]]:
        mask, attention = super().step_inputs(active, column, width, running)
        return mask, {**attention, "shared_prefix": self.prefix.step(active, running)}

    def step_done(self) -> None:
        """After the decode forward: every layer must have used the layout."""
        self.prefix.check_step()

    def compact(self, order: list[int], width: int) -> int:
        return super().compact(order, width) + self.prefix.compact(self.scheduler.row_of[:len(order)])

    @property
    def positions(self) -> int:
        """A row's slot columns plus its prompt's positions in the prefix store."""
        return super().positions + self.prefix.store.mask.shape[1]

    @property
    def nbytes(self) -> int:
        """The slots and the prefix store."""
        store = self.prefix.store
        return super().nbytes + sum(t.numel() * t.element_size() for t in (*store.keys, *store.values))

    def shape_key(self) -> tuple:
        return super().shape_key() + self.prefix.shape_key()
