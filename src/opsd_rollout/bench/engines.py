"""The engines a benchmark run measures: one built engine alive at a time (the one the current config needs), the
frozen models of OPSD steps, the servers of served teachers, and the contenders built on each engine."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from opsd_rollout.bench import contenders
from opsd_rollout.bench.served import TeacherProcess
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
    """Keeps one engine alive at a time (the one the current config needs), frozen models (teachers) per (name,
    dtype), and served teachers' servers for the whole run (``shutdown`` stops them)."""

    def __init__(self, model: str, device: torch.device, *, lr: float = LEARNING_RATE, rank: int = 0,
                 kept_cores: tuple[int, ...] = ()):
        self.model, self.device, self.lr, self.rank = model, device, lr, rank
        self.kept_cores = kept_cores
        """The cores the run kept for a served teacher's server (``threads.share_cores``); none: the run's own."""
        self._key: tuple | None = None
        self._current: BuiltEngine | None = None
        self._frozen: dict[tuple[str, str], Any] = {}
        self._servers: dict[tuple, TeacherProcess] = {}

    def _teacher_seed(self, name: str) -> int | None:
        """A preset teacher that is also the student gets other random weights: the same would make the loss 0."""
        return 1 if name == self.model and name in PRESETS else None

    def frozen(self, name: str, dtype: str, zero_stage: int = 0) -> Any:
        """``name`` in ``dtype``, without gradients, loaded once (the frozen teacher of an OPSD step); at
        ``zero_stage`` 3 a DeepSpeed inference engine, its parameters partitioned across the ranks."""
        key = (name, dtype, zero_stage)
        if key not in self._frozen:
            model = load_model(name, dtype=dtype, device=self.device, seed=self._teacher_seed(name))[0]
            model.requires_grad_(False)
            self._frozen = {key: build_inference_engine(model, 3) if zero_stage == 3 else model}
        return self._frozen[key]

    def served(self, name: str, dtype: str, *, compact: bool, top_k: int) -> str:
        """The URL of ``name`` in ``dtype`` served by ``opsd-rollout serve-teacher`` on loopback (``bench/served.py``),
        answering the compact answer or vLLM's JSON, at least ``top_k`` log-probabilities a position; started once
        and kept until ``shutdown``, on the kept cores when there are some."""
        key = (name, dtype, compact, max(64, top_k))
        if key not in self._servers:
            self._servers[key] = TeacherProcess(name, dtype=dtype, device=str(self.device), seed=self._teacher_seed(name),
                                                compact=compact, max_logprobs=key[-1], cores=self.kept_cores)
        return self._servers[key].url

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

    def shutdown(self) -> None:
        """``close``, and stop the served teachers' servers: the run is over."""
        self.close()
        for server in self._servers.values():
            server.stop()
        self._servers = {}
