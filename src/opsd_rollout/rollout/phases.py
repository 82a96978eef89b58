"""Which live callables a profiled rollout probes, per kind of engine (see ``profiling.probes``)."""

from __future__ import annotations

import functools
from typing import Any


from opsd_rollout.profiling.probes import PhaseProbes, add_housekeeping_probes
from opsd_rollout.rollout.target import RolloutTarget


def zero3_offload(engine: Any) -> Any:
    """DeepSpeed's ZeRO-3 parameter offload object of ``engine`` (hooks and coordinator), or ``None``."""
    for owner in (getattr(engine, "optimizer", None), engine):
        offload = getattr(owner, "parameter_offload", None)
        if offload is not None and hasattr(offload, "get_param_coordinator"):
            return offload
    return None


def zero3_coordinator(engine: Any) -> Any:
    """DeepSpeed's ZeRO-3 parameter coordinator of ``engine``, or ``None``."""
    offload = zero3_offload(engine)
    return offload.get_param_coordinator() if offload is not None else None


def _gathered_bytes(params: Any, *_args: Any, **_kwargs: Any) -> int:
    return sum(int(p.ds_numel) * p.element_size() for p in params)


def _listed_bytes(param: Any, param_list: Any = None, *_args: Any, **_kwargs: Any) -> int:
    """``param.all_gather(param_list=...)``: the bytes of the listed (default: this) parameters not yet present."""
    listed = param_list if param_list is not None else [param]
    return sum(int(p.ds_numel) * p.element_size() for p in listed if p.ds_status.name == "NOT_AVAILABLE")


def add_rollout_probes(probes: PhaseProbes, target: RolloutTarget, rollout: Any, *, merge_adapters: bool) -> None:
    """Register every phase that can occur during a rollout on ``target``."""
    if target.zero_stage == 3:
        # the fetch (launch, wait, prefetch) is timed; each all-gather it launches is counted with its bytes
        probes.add(zero3_coordinator(target.engine), "fetch_sub_module", "param_gather")
        for param in target.model.parameters():
            probes.add(param, "all_gather_coalesced", "param_gather", timed=False, measure=_gathered_bytes)
            # GatheredParameters (the one gather of zero3_gather="once") goes through all_gather instead
            probes.add(param, "all_gather", "param_gather", timed=False, measure=functools.partial(_listed_bytes, param))
    if target.hybrid_engine:
        probes.add(target.engine, "retake_inference_cache", "inference_cache")
        probes.add(getattr(target.engine, "workspace", None), "release_workspace", "inference_cache")
        probes.add(target.engine, "fuse_lora_weight", "lora_fuse")
        probes.add(target.engine, "unfuse_lora_weight", "lora_unfuse")
        probes.add(target.engine, "unfuse_lora_weight_non_pinned", "lora_unfuse")
    if merge_adapters:
        probes.add(target.model, "merge_adapter", "lora_fuse")
        probes.add(target.model, "unmerge_adapter", "lora_unfuse")
    probes.add(rollout, "release_workspace", "inference_cache")
    add_housekeeping_probes(probes)
