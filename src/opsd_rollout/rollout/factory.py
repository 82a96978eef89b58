"""``build_rollout``: DeepSpeed's rollout factory, building ours.

The signature, defaults and errors are those of ``deepspeed.runtime.rollout.build_rollout``, so a trainer that
calls DeepSpeed's factory runs unchanged on this package. Extra keyword arguments that are fields of our
``HybridEngineRolloutConfig`` (or DeepSpeed's names for them) are applied; any other is ignored, as DeepSpeed's
factory ignores it, with a warning that names it (DeepSpeedExamples' OPSD trainer passes ``student_model_path=``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from opsd_rollout.rollout.config import HybridEngineRolloutConfig
from opsd_rollout.rollout.deepspeed_fields import NAMES as DEEPSPEED_NAMES
from opsd_rollout.rollout.engine import HybridEngineRollout

if TYPE_CHECKING:
    from deepspeed.runtime.rollout.base import RolloutConfig
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig as DeepSpeedRolloutConfig

    from opsd_rollout.modeling import TokenizerLike
    from opsd_rollout.rollout.target import EngineOrModel

ENGINES = ("hybrid_engine",)
"""The values of ``RolloutConfig.engine`` the factory builds (DeepSpeed's one name for this rollout)."""


def build_rollout(rollout_cfg: RolloutConfig | DeepSpeedRolloutConfig | HybridEngineRolloutConfig,
                  student_engine: EngineOrModel | None = None, tokenizer: TokenizerLike | None = None,
                  **kwargs: Any) -> HybridEngineRollout:
    """Build the rollout ``rollout_cfg.engine`` names, as DeepSpeed's factory does.

    Args:
        rollout_cfg: DeepSpeed's ``RolloutConfig`` (``engine`` must be ``"hybrid_engine"``), or a rollout config
            without an ``engine`` field (ours, or DeepSpeed's ``HybridEngineRolloutConfig``), which can only
            mean this engine. DeepSpeed's fields map onto ours as ``HybridEngineRolloutConfig.from_any`` says.
        student_engine: the DeepSpeed engine (or transformers model) to roll out with.
        tokenizer: anything with ``pad_token_id`` and ``eos_token_id``.
        **kwargs: fields of our ``HybridEngineRolloutConfig`` (``enable_profiling=True``, ``seed=0``, ...) or
            DeepSpeed's names for them (``use_graph_capture=True``), applied over what ``rollout_cfg`` says; any
            other keyword is ignored with a warning (DeepSpeed's factory ignores it in silence).

    Raises:
        ValueError: an engine other than ``hybrid_engine`` ("Unknown rollout engine"), or a missing
            ``student_engine`` or ``tokenizer`` ("needs both"), as DeepSpeed's factory raises.
        TypeError: ``rollout_cfg`` is ``None``.
    """
    if rollout_cfg is None:
        raise TypeError("rollout_cfg must be a rollout config (DeepSpeed's RolloutConfig or "
                        "opsd_rollout.HybridEngineRolloutConfig); got None")
    engine_name = getattr(rollout_cfg, "engine", "hybrid_engine")
    if engine_name not in ENGINES:
        raise ValueError(f"Unknown rollout engine {engine_name!r}; choose from 'hybrid_engine'")
    if student_engine is None or tokenizer is None:
        missing = [name for name, value in (("student_engine", student_engine), ("tokenizer", tokenizer))
                   if value is None]
        raise ValueError(f"hybrid_engine rollout needs both student_engine and tokenizer; {' and '.join(missing)} "
                         "is None")
    known = ({f.name for f in dataclasses.fields(HybridEngineRolloutConfig)} - {"deepspeed"}) | set(DEEPSPEED_NAMES)
    ignored = sorted(set(kwargs) - known)
    if ignored:
        warnings.warn(f"build_rollout() ignores keyword arguments that are not HybridEngineRolloutConfig fields: "
                      f"{ignored} (as DeepSpeed's factory does); the fields are {sorted(known)}", stacklevel=2)
    cfg = HybridEngineRolloutConfig.from_any(rollout_cfg)
    changes = {name: value for name, value in kwargs.items() if name in known}
    if changes:
        cfg = cfg.replace(**changes)  # validated again by the dataclass
    return HybridEngineRollout(student_engine, tokenizer, cfg=cfg)
