"""The engines a benchmark run measures: one built engine alive at a time (the one the current config needs), the
frozen models of OPSD steps, and the contenders built on each engine."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from opsd_rollout.bench import contenders
from opsd_rollout.deepspeed_config import LEARNING_RATE
from opsd_rollout.deepspeed_engine import build_engine, build_inference_engine
from opsd_rollout.modeling import ModelSpec
from opsd_rollout.models import load_model
from opsd_rollout.presets import PRESETS


@dataclass
class BuiltEngine:
    """The model built for one ``engine_key`` (dtype, ZeRO stage), with its tokenizer, facts and rollouts."""

    engine: Any
    tokenizer: Any
    spec: ModelSpec
    """Read before any wrapper (ZeRO-3 empties parameters)."""
    rollouts: dict[tuple, Any] = field(default_factory=dict)
    """The contenders built on it, by their knobs."""


class EnginePool:
    """Keeps one engine alive at a time (the one the current config needs), and frozen models (teachers)
    per (name, dtype)."""

    def __init__(self, model: str, device: torch.device, *, lr: float = LEARNING_RATE, rank: int = 0):
        self.model, self.device, self.lr, self.rank = model, device, lr, rank
        self._key: tuple | None = None
        self._current: BuiltEngine | None = None
        self._frozen: dict[tuple[str, str], Any] = {}

    def frozen(self, name: str, dtype: str, zero_stage: int = 0) -> Any:
        """``name`` in ``dtype``, without gradients, loaded once (the frozen teacher of an OPSD step); at
        ``zero_stage`` 3 a DeepSpeed inference engine, its parameters partitioned across the ranks."""
        key = (name, dtype, zero_stage)
        if key not in self._frozen:
            # a preset teacher that is also the student gets other random weights: the same would make the loss 0
            seed = 1 if name == self.model and name in PRESETS else None
            model = load_model(name, dtype=dtype, device=self.device, seed=seed)[0].requires_grad_(False)
            self._frozen = {key: build_inference_engine(model, 3) if zero_stage == 3 else model}
        return self._frozen[key]

    def get(self, config: Any) -> BuiltEngine:
        if self._key != config.engine_key:
            self.close()
            model, tokenizer = load_model(self.model, dtype=config.dtype, device=self.device)
            spec = ModelSpec.of(model)
            engine = model if config.zero_stage == "none" else build_engine(model, int(config.zero_stage), lr=self.lr)
            self._key, self._current = config.engine_key, BuiltEngine(engine, tokenizer, spec)
        return self._current

    def rollout(self, config: Any) -> tuple[Any, BuiltEngine]:
        """The config's contender on the current engine (``bench/contenders/``), built once per its knobs."""
        built = self.get(config)
        key = (config.lengths, tuple(sorted(config.engine_fields.items())))
        if key not in built.rollouts:
            built.rollouts[key] = contenders.module(config.strategy).build(built, config)
        return built.rollouts[key], built

    def close(self) -> None:
        if self._current is not None:
            for rollout in self._current.rollouts.values():
                rollout.shutdown()
        self._key = self._current = None
        self._frozen = {}
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
