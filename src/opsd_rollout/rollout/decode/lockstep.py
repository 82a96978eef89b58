"""Several ZeRO-3 ranks decode in lockstep: every rank runs the same number of forwards, leaves the loop at the
same step and admits rows in the same rounds, whatever its own rows do (a collective never waits forever).

``Solo`` is the one-rank case: it agrees with itself and touches no device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Solo:
    """One rank (or ranks whose forwards are independent): every answer is this rank's own."""

    def schedule(self, budget: int, checks: bool) -> tuple[int, bool]:
        return budget, checks

    def agree(self, done: bool, admits: bool) -> tuple[bool, bool]:
        return done, admits


class Lockstep:
    """Ranks under ZeRO-3: one all-reduce per question, the answer the slowest rank needs."""

    def __init__(self, device: torch.device):
        self.device = device

    def schedule(self, budget: int, checks: bool) -> tuple[int, bool]:
        """The largest step budget and whether any rank checks. A rank whose rows are done earlier keeps
        stepping (idle) until all leave together."""
        flags = torch.tensor([budget, int(checks)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), bool(flags[1])

    def agree(self, done: bool, admits: bool) -> tuple[bool, bool]:
        """Ranks stop together (all done) and admit together (any admits: the others run a prefill of their own
        when forwards gather parameters collectively)."""
        flags = torch.tensor([int(not done), int(admits)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return not bool(flags[0]), bool(flags[1])


def lockstep_for(several_ranks: bool, device: torch.device) -> Solo | Lockstep:
    return Lockstep(device) if several_ranks else Solo()
