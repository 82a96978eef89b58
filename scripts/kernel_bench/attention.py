"""``attention``: decode time per token and KV workspace bytes with each prompt's keys/values stored once
(shared-prefix attention, for every prompt length) against a copy in each of its n rows' slots, one greedy
rollout of each per round on the settings' model, EOS ignored. Each config builds its own two rollouts, so each
workspace is sized for that shape alone."""

from __future__ import annotations

from typing import Any

import torch

from kernel_bench.contest import Contest, rollout_inputs, Timed


class AttentionContest(Contest):
    def __init__(self, config: Any, settings: Any, built: Any, device: torch.device):
        from opsd_rollout.bench.workload import workload_rollout

        super().__init__(device)
        self.request, self.sampling = rollout_inputs(config, settings, built, device)
        self.shared = workload_rollout(built.engine, built.tokenizer, "fixed", enable_profiling=True,
                                       shared_prefix=True, shared_prefix_min_prompt=1)
        self.copied = workload_rollout(built.engine, built.tokenizer, "fixed", enable_profiling=True,
                                       shared_prefix=False)

    @staticmethod
    def _call(rollout: Any, request: Any, sampling: Any) -> tuple[torch.Tensor, Any]:
        batch = rollout.generate(request, sampling)
        return batch.input_ids, rollout.get_last_profile()

    def ours(self) -> tuple[torch.Tensor, Any]:
        return self._call(self.shared, self.request, self.sampling)

    def baseline(self) -> tuple[torch.Tensor, Any]:
        return self._call(self.copied, self.request, self.sampling)

    def figures(self, sides: dict[str, Timed]) -> dict[str, Any]:
        shared, copied = sides["ours"].result[1], sides["baseline"].result[1]
        if shared.kv_layout != "shared_prefix":  # the comparison would be the copied layout against itself
            raise RuntimeError(f"the shared-prefix rollout decoded with the {shared.kv_layout!r} layout")
        return {"kernel_ms": shared.decode_ms / shared.decode_steps,
                "baseline_ms": copied.decode_ms / copied.decode_steps,
                "call_ms": sides["ours"].ms, "baseline_call_ms": sides["baseline"].ms,
                "kv_workspace_bytes": shared.kv_workspace_bytes,
                "baseline_kv_workspace_bytes": copied.kv_workspace_bytes}

    def same(self, ours: Any, baseline: Any) -> bool:
        return torch.equal(ours[0], baseline[0])


def build(config: Any, settings: Any, built: Any, device: torch.device) -> AttentionContest:
    return AttentionContest(config, settings, built, device)
