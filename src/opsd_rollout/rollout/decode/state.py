"""Per-slot decode state: which request row each slot of the decode batch holds and where that row stands.

Slots are the decode batch's rows (``S`` of them; the first ``active`` run). Request rows are the rollout's
``N = B * n`` rows. A finished or empty slot keeps stepping until the next check retires it: its token goes to a
sink (an extra row and column of the output), so nothing it computes is ever read.
"""

from __future__ import annotations

import torch


class SlotState:
    """The decode batch's per-slot tensors (``row``, ``count``, ``position``, ``token``, ``running``) and the
    per-request-row output (``out``, ``finish``)."""

    def __init__(self, rows: int, slots: int, max_new_tokens: int, out: torch.Tensor):
        device = out.device
        self.sink = rows
        """The extra output row (and ``max_new_tokens``, the extra column) finished slots write to."""
        self.max_new = max_new_tokens
        self.out = out
        """[N + 1, max_new_tokens + 1] the generated tokens per request row, pad-filled."""
        self.finish = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
        """[N + 1] per request row, the forward that produced its last token (-1 while it runs)."""
        self.row = torch.full((slots,), self.sink, dtype=torch.int64, device=device)
        """[S] the request row each slot holds (the sink when none)."""
        self.count = torch.zeros(slots, dtype=torch.int64, device=device)
        """[S] tokens the slot's row has generated so far."""
        self.position = torch.zeros(slots, 1, dtype=torch.int64, device=device)
        """[S, 1] the position id of the slot's next token."""
        self.token = torch.zeros(slots, dtype=torch.int64, device=device)
        """[S] the token the next decode step feeds."""
        self.running = torch.zeros(slots, dtype=torch.bool, device=device)
        """[S] whether the slot's row still produces tokens."""

    def start(self, slots: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, token: torch.Tensor,
              finished: torch.Tensor, forward: int) -> None:
        """Slots ``slots`` [k] now hold request rows ``rows`` [k], whose first token ``token`` came from
        forward ``forward`` (their prompt's prefill) and ended them where ``finished``."""
        self.row[slots], self.position[slots] = rows, positions
        self.out[rows, 0] = token
        self.finish[rows] = torch.where(finished, forward, self.finish[rows])
        self.token[slots], self.count[slots], self.running[slots] = token, 1, ~finished

    def live(self, active: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``active`` slots' ``(running, row, count)``."""
        return self.running[:active], self.row[:active], self.count[:active]

    def advance(self, active: int, token: torch.Tensor, finished: torch.Tensor, forward: int) -> None:
        """After decode forward ``forward`` of the first ``active`` slots produced ``token`` [A] (``finished``: the
        rows it ended): write the live rows' tokens, retire the finished, move every slot one token on."""
        live, rows, count = self.live(active)
        self.out[torch.where(live, rows, self.sink), torch.where(live, count, self.max_new)] = token
        self.finish[torch.where(finished, rows, self.sink)] = forward
        self.running[:active] = live & ~finished
        self.token[:active] = token
        self.position[:active] += 1
        self.count[:active] += 1

    def compact(self, index: torch.Tensor) -> None:
        """Slots ``index`` [k] become the first ``k`` slots, in that order."""
        size = index.numel()
        for tensor in (self.row, self.count, self.position, self.token, self.running):
            tensor[:size] = tensor.index_select(0, index)

    def tokens(self, rows: int, width: int) -> torch.Tensor:
        """[N, width] the generated tokens, a fresh tensor."""
        return self.out[:rows, :width].clone()
