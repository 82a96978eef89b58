"""Building a DeepSpeed training engine around a model, for the benchmarks, the OPSD step and tests.

Real trainers build their own engine; this is the small, explicit version the tool needs to measure
ZeRO stages without a config file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from datetime import timedelta
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from opsd_rollout.deepspeed_config import LEARNING_RATE
from opsd_rollout.distributed import free_port


logger = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


def init_distributed(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
    """Initialize torch.distributed through DeepSpeed once: gloo on CPU, DeepSpeed's default on GPUs.

    Outside a launcher (no ``RANK`` in the environment) this makes a one-process group on loopback. Every
    collective of the group gives up after ``timeout_s`` seconds with an error, instead of waiting forever
    for a rank that died.
    """
    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s), "verbose": False}
    if not torch.cuda.is_available():
        kwargs["dist_backend"] = "gloo"
    # DeepSpeed prints a line when it builds or loads its CPU communication op: ours to log, not to print
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        deepspeed.init_distributed(**kwargs)
    for line in printed.getvalue().splitlines():
        logger.info("%s", line)


def deepspeed_config(zero_stage: int, *, dtype: torch.dtype = torch.float32, lr: float = LEARNING_RATE,
                     micro_batch_size: int = 1, param_persistence_threshold: int = 0) -> dict[str, Any]:
    """A minimal DeepSpeed config for ``zero_stage`` (0-3).

    ``param_persistence_threshold=0`` partitions every ZeRO-3 parameter, as a large model's would be;
    DeepSpeed's default (1e5 elements) would keep a small model wholly resident and hide the gathers.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3; got {zero_stage!r}")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = param_persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_inference_engine(model: torch.nn.Module, zero_stage: int = 3, *, param_persistence_threshold: int = 0):
    """A frozen model (a teacher) as a DeepSpeed engine with no optimizer: at ZeRO-3 its parameters are partitioned
    across the ranks, each forward gathering them a module at a time, so a teacher larger than one device fits."""
    if zero_stage not in (0, 3):
        raise ValueError(f"an inference engine's ZeRO stage is 0 or 3 (stages 1 and 2 partition optimizer state and "
                         f"gradients, which a frozen teacher has none of); got {zero_stage!r}")
    init_distributed()
    config = deepspeed_config(zero_stage, dtype=next(model.parameters()).dtype,
                              param_persistence_threshold=param_persistence_threshold)
    del config["optimizer"]  # nothing to optimise
    engine, *_ = deepspeed.initialize(model=model.eval().requires_grad_(False), config=config)
    return engine


def build_engine(model: torch.nn.Module, zero_stage: int, **config_kwargs: Any):
    """Wrap ``model`` in a DeepSpeed engine at ``zero_stage``; returns the engine."""
    init_distributed()
    dtype = next(model.parameters()).dtype
    config = deepspeed_config(zero_stage, dtype=dtype, **config_kwargs)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad], config=config)
    return engine
