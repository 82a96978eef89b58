"""What a rollout runs on: a DeepSpeed engine (any ZeRO stage, hybrid engine or not) or a bare
transformers causal LM, possibly wrapped by PEFT. Resolved once, when the rollout is built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypeGuard

import deepspeed
import torch
import transformers
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
from packaging.version import Version

from opsd_rollout.distributed import partitioned, rank_info
from opsd_rollout.modeling import ModelSpec, device_of, innermost_model


class WrapsModule(Protocol):
    """Anything whose ``.module`` is the model, as DeepSpeed's rollout reads an engine: a wrapper of DeepSpeed's
    engine, a user's own."""

    @property
    def module(self) -> torch.nn.Module: ...


EngineOrModel: TypeAlias = "torch.nn.Module | WrapsModule"
"""What a rollout runs on: a DeepSpeed engine (a ``torch.nn.Module``, ZeRO 0-3, hybrid engine or not), a transformers
causal LM (PEFT-wrapped or not), or a wrapper whose ``.module`` is one."""


@dataclass(frozen=True)
class RolloutTarget:
    """The pieces of an engine or model that generation needs."""

    engine: EngineOrModel
    """What the user passed: a DeepSpeed engine or the model itself."""
    model: torch.nn.Module
    """The module generation is called on: ``engine.module`` for DeepSpeed, the model itself otherwise."""
    forward_module: torch.nn.Module
    """The transformers model whose ``forward`` runs at every step (inside PEFT / DeepSpeed wrappers)."""
    generate_fn: Callable[..., torch.Tensor]
    """``engine.generate`` for the hybrid engine (its fuse/gather/cache logic runs), else ``model.generate``."""
    zero_stage: int
    hybrid_engine: bool
    device: torch.device
    spec: ModelSpec
    """The model's facts (config, KV shape, attention, limits, cache keyword), read once."""
    config_eos_ids: tuple[int, ...]
    """``generation_config.eos_token_id`` of the model (an int or a Qwen-style list)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of its keys/values: the model's, or float32 for a model whose weights are integers."""
        return self.dtype if self.dtype.is_floating_point else torch.float32

    @property
    def vocab_size(self) -> int | None:
        return self.spec.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.spec.max_positions

    @property
    def cache_keyword(self) -> str | None:
        return self.spec.cache_keyword

    @property
    def is_peft(self) -> bool:
        return callable(getattr(self.model, "merge_adapter", None)) and callable(
            getattr(self.model, "unmerge_adapter", None))

    @property
    def world_size(self) -> int:
        return rank_info().world_size

    @property
    def rank(self) -> int:
        return rank_info().rank


def hybrid_engine_problem(engine: EngineOrModel) -> str | None:
    """Why DeepSpeed's hybrid engine cannot generate with the installed transformers, or ``None``.

    In eval mode the hybrid engine swaps each decoder layer's forward for a DeepSpeed inference layer
    (``DeepSpeedTransformerInference``), which returns a tuple (``return_tuple`` is on in every config it
    builds). transformers 5's model loop feeds each layer's output to the next as a tensor, so the second
    layer receives a tuple and fails. transformers 4.x unpacked ``layer_outputs[0]``; opsd-rollout needs 5.x.
    """
    containers = getattr(engine, "_inference_containers", None) or []
    tuple_layers = [c for c in containers
                    if any(getattr(getattr(getattr(c, "module", None), "config", None), flag, True)
                           for flag in ("return_tuple", "return_single_tuple"))]
    if not tuple_layers or Version(transformers.__version__).major < 5:
        return None
    return (f"DeepSpeed {deepspeed.__version__}'s hybrid engine replaces {len(tuple_layers)} decoder layers with "
            f"inference layers that return tuples, and transformers {transformers.__version__} passes each layer's "
            "output to the next as a tensor, so generation would fail at the second layer. The hybrid engine "
            "generates only with transformers 4.x, which opsd-rollout does not support: turn "
            "hybrid_engine.enabled off in the DeepSpeed config (the static strategy, with one ZeRO-3 gather per "
            "rollout, takes its place)")


def _eos_ids(value: int | Sequence[int] | torch.Tensor | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value, )
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.flatten().tolist())
    return tuple(int(v) for v in value)


def is_causal_lm(obj: object) -> TypeGuard[torch.nn.Module]:
    """A module that generates itself: a transformers causal LM, or a PEFT wrapper of one."""
    return isinstance(obj, torch.nn.Module) and callable(getattr(obj, "generate", None)) and \
        getattr(innermost_model(obj), "config", None) is not None


def resolve_target(engine_or_model: EngineOrModel) -> RolloutTarget:
    """Inspect ``engine_or_model`` once; raises ``TypeError`` for anything that cannot generate."""
    generate_fn: Callable[..., torch.Tensor] | None
    if isinstance(engine_or_model, DeepSpeedEngine):
        model = engine_or_model.module
        zero_stage = int(engine_or_model.zero_optimization_stage())
        hybrid = isinstance(engine_or_model, DeepSpeedHybridEngine)
        device = torch.device(engine_or_model.device)
        generate_fn = engine_or_model.generate if hybrid else model.generate
    elif is_causal_lm(engine_or_model):
        model, zero_stage, hybrid = engine_or_model, 0, False
        device, generate_fn = device_of(model), getattr(model, "generate")
    elif isinstance(inner := getattr(engine_or_model, "module", None), torch.nn.Module):
        # what DeepSpeed's rollout reads an engine as: anything whose ``.module`` is the model (a wrapper of
        # DeepSpeed's engine, a user's own, DDP)
        model, hybrid = inner, False
        stage = getattr(engine_or_model, "zero_optimization_stage", None)
        zero_stage = int(stage()) if callable(stage) else 3 if partitioned(model) else 0
        device, generate_fn = device_of(model), getattr(model, "generate", None)
    elif isinstance(engine_or_model, torch.nn.Module):
        model, zero_stage, hybrid = engine_or_model, 0, False
        device, generate_fn = device_of(model), getattr(model, "generate", None)
    else:
        raise TypeError("engine must be a DeepSpeed engine or a transformers causal LM (a torch.nn.Module, or any "
                        f"object whose .module is one); got {type(engine_or_model).__name__}")
    forward_module = innermost_model(model)
    if not callable(generate_fn) or getattr(forward_module, "config", None) is None:
        raise TypeError(f"engine's model {type(model).__name__} is not a transformers causal LM (it needs a config "
                        "and generate())")
    generation_config = getattr(forward_module, "generation_config", None)
    return RolloutTarget(
        engine=engine_or_model,
        model=model,
        forward_module=forward_module,
        generate_fn=generate_fn,
        zero_stage=zero_stage,
        hybrid_engine=hybrid,
        device=device,
        spec=ModelSpec.of(forward_module),
        config_eos_ids=_eos_ids(getattr(generation_config, "eos_token_id", None)),
    )


def merged_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a PEFT ``merge_adapter`` of ``model`` writes into: each adapted layer's base weight and bias
    (PEFT's tuner layers: modules with ``get_base_layer`` and ``merge``)."""
    found = []
    for module in model.modules():
        base_layer = getattr(module, "get_base_layer", None)
        if callable(base_layer) and callable(getattr(module, "merge", None)):
            base = base_layer()
            found += [t for t in (getattr(base, "weight", None), getattr(base, "bias", None))
                      if isinstance(t, torch.Tensor)]
    return found
