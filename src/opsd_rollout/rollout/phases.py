"""Which methods a profiled rollout probes, per kind of engine (see ``profiling.probes``): each on an object the
rollout is handed (the engine, its ZeRO-3 coordinator, a PEFT model), never on a module or a class."""

from __future__ import annotations

from typing import Any

from opsd_rollout.profiling.probes import PhaseProbes
from opsd_rollout.rollout.target import RolloutTarget

LAUNCH = "_PartitionedParameterCoordinator__all_gather_params_"
"""Where DeepSpeed's ZeRO-3 coordinator launches the all-gathers of a set of parameters (its private
``__all_gather_params_(params, forward, quantize)``, DeepSpeed 0.19): the per-layer fetches and their prefetches."""


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


def partitioned_bytes(params: Any) -> int:
    """Bytes of the whole parameters among ``params`` that are partitioned now (what gathering them moves in)."""
    return sum(int(p.ds_numel) * p.element_size() for p in params if p.ds_status.name == "NOT_AVAILABLE")


def launched(params: Any, *_args: Any, **_kwargs: Any) -> tuple[int, int]:
    """The all-gathers one coordinator launch starts and their bytes: one collective for the partitioned parameters
    with a secondary (hpZ) partition and one for those without, as DeepSpeed groups them."""
    pending = [p for p in params if p.ds_status.name == "NOT_AVAILABLE"]
    groups = {getattr(p, "ds_secondary_tensor", None) is None for p in pending}
    return len(groups), partitioned_bytes(pending)


def add_rollout_probes(probes: PhaseProbes, target: RolloutTarget, *, merge_adapters: bool) -> None:
    """Register every phase that can occur during a rollout on ``target`` (the gather of ``zero3_gather="once"`` and
    the rollout's own releases are timed where the rollout makes them)."""
    if target.zero_stage == 3:
        coordinator = zero3_coordinator(target.engine)
        # the fetch (launch, wait, prefetch) is timed; each all-gather it launches is counted with its bytes
        probes.add(coordinator, "fetch_sub_module", "param_gather")
        probes.add(coordinator, LAUNCH, "param_gather", timed=False, measure=launched)
    if target.hybrid_engine:
        probes.add(target.engine, "retake_inference_cache", "inference_cache")
        probes.add(getattr(target.engine, "workspace", None), "release_workspace", "inference_cache")
        probes.add(target.engine, "fuse_lora_weight", "lora_fuse")
        probes.add(target.engine, "unfuse_lora_weight", "lora_unfuse")
        probes.add(target.engine, "unfuse_lora_weight_non_pinned", "lora_unfuse")
    if merge_adapters:
        probes.add(target.model, "merge_adapter", "lora_fuse")
        probes.add(target.model, "unmerge_adapter", "lora_unfuse")
    probes.watch_gc()
