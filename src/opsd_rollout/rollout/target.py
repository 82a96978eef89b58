"""What a rollout runs on: a DeepSpeed engine (any ZeRO stage, hybrid engine or not) or a bare
transformers causal LM, possibly wrapped by PEFT. Resolved once, when the rollout is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import deepspeed
import torch
import transformers
from packaging.version import Version

from opsd_rollout.distributed import rank_info
from opsd_rollout.modeling import cache_keyword, innermost_model, text_config


@dataclass(frozen=True)
class RolloutTarget:
    """The pieces of an engine or model that generation needs."""

    engine: Any
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
    dtype: torch.dtype
    vocab_size: int | None
    max_positions: int | None
    config_eos_ids: tuple[int, ...]
    """``generation_config.eos_token_id`` of the model (an int or a Qwen-style list)."""
    cache_keyword: str | None
    """The keyword the model's forward takes its KV cache by (``cache`` or, before transformers 5.23,
    ``past_key_values``); ``None`` when it takes none by name."""

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


def _is_deepspeed_engine(obj: Any) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:  # pragma: no cover - deepspeed is a dependency
        return False
    return isinstance(obj, DeepSpeedEngine)


def _is_hybrid_engine(obj: Any) -> bool:
    try:
        from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, DeepSpeedHybridEngine)


def hybrid_engine_problem(engine: Any) -> str | None:
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


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value, )
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.flatten().tolist())
    return tuple(int(v) for v in value)


def _first_param(module: torch.nn.Module) -> torch.nn.Parameter | None:
    return next(module.parameters(), None)


def resolve_target(engine_or_model: Any) -> RolloutTarget:
    """Inspect ``engine_or_model`` once; raises ``TypeError`` for anything that cannot generate."""
    if _is_deepspeed_engine(engine_or_model):
        model = engine_or_model.module
        zero_stage = int(engine_or_model.zero_optimization_stage())
        hybrid = _is_hybrid_engine(engine_or_model)
        device = torch.device(engine_or_model.device)
        generate_fn = engine_or_model.generate if hybrid else model.generate
    elif isinstance(engine_or_model, torch.nn.Module):
        model, zero_stage, hybrid = engine_or_model, 0, False
        param = _first_param(model)
        device = param.device if param is not None else torch.device("cpu")
        generate_fn = getattr(model, "generate", None)
    else:
        raise TypeError("engine must be a DeepSpeed engine or a transformers causal LM (torch.nn.Module); "
                        f"got {type(engine_or_model).__name__}")
    if not callable(generate_fn):
        raise TypeError(f"engine's model {type(model).__name__} has no generate(); pass a transformers causal LM")

    forward_module = innermost_model(model)
    config = getattr(forward_module, "config", None)
    text = text_config(config) if config is not None else None
    param = _first_param(forward_module)
    generation_config = getattr(forward_module, "generation_config", None)
    return RolloutTarget(
        engine=engine_or_model,
        model=model,
        forward_module=forward_module,
        generate_fn=generate_fn,
        zero_stage=zero_stage,
        hybrid_engine=hybrid,
        device=device,
        dtype=param.dtype if param is not None else torch.float32,
        vocab_size=getattr(text, "vocab_size", None),
        max_positions=(getattr(text, "max_position_embeddings", None)
                       or getattr(text, "n_positions", None)),
        config_eos_ids=_eos_ids(getattr(generation_config, "eos_token_id", None)),
        cache_keyword=cache_keyword(forward_module),
    )
