"""``profiling``: what profiling costs: one rollout with profiling on and one with it off per round, on the
settings' model, greedy, EOS ignored, timed from outside ``generate`` (speed-up = off / on: below 1 by the
overhead)."""

from __future__ import annotations

from typing import Any

import torch

from kernel_bench.contest import Contest, rollout_inputs


class ProfilingContest(Contest):
    def __init__(self, config: Any, settings: Any, built: Any, device: torch.device):
        from opsd_rollout.bench.workload import workload_rollout

        super().__init__(device)
        self.request, self.sampling = rollout_inputs(config, settings, built, device)
        self.on, self.off = (workload_rollout(built.engine, built.tokenizer, "fixed", enable_profiling=profiled)
                             for profiled in (True, False))

    def ours(self) -> torch.Tensor:
        return self.on.generate(self.request, self.sampling).input_ids

    def baseline(self) -> torch.Tensor:
        return self.off.generate(self.request, self.sampling).input_ids

    def same(self, ours: Any, baseline: Any) -> bool:
        return torch.equal(ours, baseline)


def build(config: Any, settings: Any, built: Any, device: torch.device) -> ProfilingContest:
    return ProfilingContest(config, settings, built, device)
