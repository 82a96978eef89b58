"""ZeRO-3 "gather once": every parameter materialized for the whole rollout, instead of DeepSpeed's
per-layer all-gather at every forward (which, in a decode loop, gathers the whole model once per token)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import psutil
import torch
from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.partition_parameters import GatheredParameters

from opsd_rollout.distributed import agree_all
from opsd_rollout.metrics import bytes_text
from opsd_rollout.rollout.phases import partitioned_bytes

logger = logging.getLogger(__name__)


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can use: on CUDA the device's free memory plus what torch's caching allocator
    holds without using (``mem_get_info`` counts that as taken; after a training step it is often most of
    the headroom); on CPU the available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return int(psutil.virtual_memory().available)


def default_budget_bytes(device: torch.device) -> int:
    """80% of ``available_bytes``."""
    return int(0.8 * available_bytes(device))


class GatherOnce:
    """``with gather_once(): ...`` runs the block with every ZeRO-3 parameter gathered (DeepSpeed's own
    ``GatheredParameters``), when their full size fits the budget; otherwise it changes nothing and says why."""

    def __init__(self, model: torch.nn.Module, budget_bytes: int | None, device: torch.device,
                 offload: Any = None):
        self.offload = offload
        """DeepSpeed's ZeRO-3 parameter offload object (owner of the per-module hooks), when known."""
        self.params = [p for p in model.parameters() if hasattr(p, "ds_numel")]
        self.full_bytes = sum(int(p.ds_numel) * p.element_size() for p in self.params)
        self.budget_bytes = budget_bytes
        self.device = device
        self.last_reason: str | None = None
        """Why the last rollout gathered per layer, or ``None`` when it gathered once."""

    def fits(self) -> bool:
        """Whether the full parameters fit the budget on every rank (ranks must agree: a gather is collective)."""
        budget = self.budget_bytes if self.budget_bytes is not None else default_budget_bytes(self.device)
        fits = agree_all(self.full_bytes <= budget, self.device)
        if not fits:
            reason = (f"the full parameters ({bytes_text(self.full_bytes)}) exceed the gather budget "
                      f"({bytes_text(budget)} here) on at least one rank")
            if reason != self.last_reason:
                logger.warning("ZeRO-3 rollout gathers per layer (slower: the whole model once per token): %s; "
                               "raise gather_memory_budget_bytes if it fits", reason)
            self.last_reason = reason
            return False
        self.last_reason = None
        return True

    def gather(self, context: Any) -> None:
        context.__enter__()
        # With every parameter present, DeepSpeed's per-module hooks have nothing to do but would still
        # release parameters after each submodule and re-fetch them (how much depends on the coordinator's
        # recorded trace): take them off for the rollout.
        if self.offload is not None:
            self.offload._remove_module_hooks()

    def release(self, context: Any) -> None:
        try:
            context.__exit__(None, None, None)
        finally:
            if self.offload is not None:
                stack = parameter_offload.FWD_MODULE_STACK
                depth = len(stack)
                self.offload.setup_zero_stage3_hooks()
                del stack[depth:]  # re-registering pushes the root module again; keep the stack as it was

    @contextlib.contextmanager
    def __call__(self, recorder: Any) -> Iterator[bool]:
        """Yields whether the parameters were gathered once. The gather and the hooks' return are ``recorder``'s
        ``param_gather`` phase, with the one all-gather it launches (none when nothing was partitioned)."""
        if not self.params or not self.fits():
            yield False
            return
        context = GatheredParameters(self.params, modifier_rank=None)
        nbytes = partitioned_bytes(self.params)
        with recorder.phase("param_gather"):
            self.gather(context)
        recorder.count("param_gather", int(nbytes > 0), nbytes)
        try:
            yield True
        finally:
            with recorder.phase("param_gather"):
                self.release(context)
