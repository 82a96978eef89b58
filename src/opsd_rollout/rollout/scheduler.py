"""Which request row sits in which slot of the decode batch: a small host-side scheduler (admit, step, retire,
compact), in the spirit of vLLM's and nano-vllm's. The decode loop owns the tensors; this owns the plan.

Rows are admitted in request order. A row's prompt keys/values live in its slot's first ``P`` columns and
decoding never writes there, so a later sample of the same prompt reuses them: from the slot it is admitted
into when that slot held its prompt, else copied from any slot that holds it, else its prompt is prefilled
(each prompt once). Rows that finish leave the batch: when every pending row has been admitted and the live
rows fit a smaller batch size bucket, they move to the front and the batch shrinks to that bucket.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def batch_buckets(limit: int) -> list[int]:
    """Decode batch sizes a loop may run at: 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5x them) up
    to ``limit`` (included): at most a third of the rows are idle after compaction, and few distinct shapes."""
    sizes, power = {limit}, 1
    while power < limit:
        sizes.update(size for size in (power, power * 3 // 2) if 0 < size < limit)
        power *= 2
    return sorted(sizes)


def bucket_at_least(count: int, buckets: list[int]) -> int:
    return next(size for size in buckets if size >= count)


@dataclass(frozen=True)
class Admission:
    """Row ``row`` enters slot ``slot``; its prompt's keys/values come from ``source``: ``("slot", s)`` (already in
    slot ``s``: copy them, or nothing to do when ``s == slot``) or ``("prefill", i)`` (row ``i`` of this round's
    prefill)."""

    slot: int
    row: int
    prompt: int
    source: tuple[str, int]


class RowScheduler:
    """Host bookkeeping of one rollout: pending rows, the row and prompt of each slot, the batch size."""

    def __init__(self, rows: int, samples_per_prompt: int, slots: int):
        self.n = samples_per_prompt
        self.slots = slots
        self.pending: deque[int] = deque(range(rows))
        self.row_of: list[int | None] = [None] * slots
        """The request row in each slot, ``None`` when the slot holds none (empty, or finished and retired)."""
        self.prompt_of: list[int | None] = [None] * slots
        """Whose prompt keys/values the slot's prompt columns hold."""
        self.admitted_at: list[int] = [0] * slots
        """The decode step before which each slot's row was admitted (its fill is ``P + steps since``)."""
        self.active = slots
        self.buckets = batch_buckets(slots)
        self.holders: dict[int, set[int]] = {}
        """Prompt -> the slots whose prompt columns hold its keys/values."""

    def retire(self, live: list[bool]) -> None:
        """Slots whose row finished (``live[s]`` false) hold no row any more; their prompt columns stay valid."""
        for slot, alive in enumerate(live):
            if not alive:
                self.row_of[slot] = None

    def admit(self, step: int) -> list[Admission]:
        """Fill free slots with pending rows, in request order (after ``retire``); linear in the rows admitted."""
        free = [slot for slot in range(self.active) if self.row_of[slot] is None]
        taken: set[int] = set()
        admissions: list[Admission] = []
        prefill_rows: dict[int, int] = {}
        cursor = 0
        while len(taken) < len(free) and self.pending:
            row = self.pending.popleft()
            prompt = row // self.n
            holders = self.holders.get(prompt, set())
            slot = next((s for s in sorted(holders) if self.row_of[s] is None and s not in taken), None)
            if slot is None:  # the first free slot no row has taken yet
                while free[cursor] in taken:
                    cursor += 1
                slot = free[cursor]
            taken.add(slot)
            if slot in holders:
                source = ("slot", slot)
            elif holders:
                source = ("slot", min(holders))
            else:
                source = ("prefill", prefill_rows.setdefault(prompt, len(prefill_rows)))
            admissions.append(Admission(slot, row, prompt, source))
            self._place(slot, row, prompt, step)
        return admissions

    def _place(self, slot: int, row: int, prompt: int, step: int) -> None:
        previous = self.prompt_of[slot]
        if previous is not None and previous != prompt:
            self.holders[previous].discard(slot)
        self.holders.setdefault(prompt, set()).add(slot)
        self.row_of[slot], self.prompt_of[slot], self.admitted_at[slot] = row, prompt, step

    def new_prompts(self, admissions: list[Admission]) -> list[int]:
        """The prompts this round prefills, in the order of their prefill rows."""
        return list(dict.fromkeys(a.prompt for a in admissions if a.source[0] == "prefill"))

    def compaction(self, live: list[bool]) -> list[int] | None:
        """When no row is pending and the live rows fit a smaller bucket: the slots, in their new order, of the
        shrunken batch (live ones first, then finished ones as filler), else ``None``."""
        if self.pending:
            return None
        alive = [slot for slot in range(self.active) if live[slot]]
        size = bucket_at_least(max(len(alive), 1), self.buckets)
        if size >= self.active:
            return None
        order = alive + [slot for slot in range(self.active) if not live[slot]][:size - len(alive)]
        self.row_of = [self.row_of[s] for s in order] + [None] * (self.slots - size)
        self.prompt_of = [self.prompt_of[s] for s in order] + [None] * (self.slots - size)
        self.admitted_at = [self.admitted_at[s] for s in order] + [0] * (self.slots - size)
        self.holders = {}  # no row is pending: no prompt is needed again
        self.active = size
        return order

    def prompts_in_use(self) -> set[int]:
        """Prompts whose keys/values are still needed: those with a row in a slot or a row pending."""
        used = {row // self.n for row in self.row_of if row is not None}
        if self.pending:  # rows are admitted in request order: the pending ones are a range of prompts
            used.update(range(self.pending[0] // self.n, self.pending[-1] // self.n + 1))
        return used

    @property
    def occupied(self) -> int:
        """Slots holding a row (admitted and not retired)."""
        return sum(row is not None for row in self.row_of[:self.active])

    @property
    def done(self) -> bool:
        """No row pending and none in a slot."""
        return not self.pending and all(row is None for row in self.row_of[:self.active])

    def width(self, prompt_length: int, step: int) -> int:
        """Columns the rows in the batch have written: the longest-running row's fill."""
        return prompt_length + max((step - self.admitted_at[s] for s in range(self.active)
                                    if self.row_of[s] is not None), default=0)
