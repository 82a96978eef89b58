"""LoRA students: PEFT's adapters on the student, the only parameters trained and optimised.

``AdapterConfig`` (``TrainConfig.lora``) is light (no torch, transformers or PEFT at import: the command line checks
it before they load); the functions that wrap a model, check the targets against its modules or merge import PEFT
when they run. The adapters are PEFT's own (``LoraConfig``, ``get_peft_model``), saved in its format
(``save_pretrained``: ``adapter_config.json`` and the adapter weights) so that ``PeftModel.from_pretrained`` and
every tool that reads PEFT adapters load them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opsd_rollout import checks

ALL_LINEAR = "all-linear"
"""PEFT's name for every linear layer but the output head."""


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """LoRA adapters on the student (``rank`` set), or full fine-tuning (``rank`` ``None``, the default)."""

    rank: int | None = None
    """The adapters' rank r (PEFT's ``r``); ``None``: no adapters, every parameter trains."""
    alpha: float | None = None
    """PEFT's ``lora_alpha`` (the update is scaled by alpha / r); ``None``: 2 x rank."""
    targets: tuple[str, ...] = (ALL_LINEAR,)
    """Module names the adapters wrap, as PEFT's ``target_modules`` matches them (a name matches a module whose
    dotted path ends with it: ``q_proj`` wraps every layer's ``q_proj``), or ``all-linear`` (PEFT's: every linear
    layer but the output head). Each name must match at least one module of the student, checked before any step."""
    merge_rollouts: bool = True
    """Rollouts (and evaluations) run with the adapters merged into the base weights (PEFT's ``merge_adapter``, the
    weights put back exactly after: the rollout's ``merge_adapters``), not through PEFT's extra matmuls at every
    layer of every decode step: measured faster (benchmarks/RESULTS.md "LoRA students"), at the cost of a copy of
    the adapted weights during the rollout."""
    merge: bool = False
    """Also write the merged model (the adapters folded into the base weights, PEFT's ``merge_and_unload``) to
    ``merged/`` beside the adapters' ``model/``."""

    def __post_init__(self) -> None:
        checks.integer("lora rank", self.rank, optional=True, hint="--lora-rank")
        checks.number("lora alpha", self.alpha, above=0, optional=True, hint="--lora-alpha")
        if isinstance(self.targets, (str, list)):  # a flag's comma list, or train_config.json's list
            targets = split_targets(self.targets) if isinstance(self.targets, str) else tuple(self.targets)
            object.__setattr__(self, "targets", targets)
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"lora targets must be module names (--lora-targets q_proj,v_proj) or all-linear; got "
                             f"{self.targets!r}")
        if self.rank is None and (self.alpha is not None or self.merge or self.targets != (ALL_LINEAR,)):
            given = [name for name, on in (("--lora-alpha", self.alpha is not None), ("--merge-lora", self.merge),
                                           ("--lora-targets", self.targets != (ALL_LINEAR,))) if on]
            raise ValueError(f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} LoRA adapters, and there are "
                             "none without --lora-rank R (lora rank): add it, or drop "
                             f"{'it' if len(given) == 1 else 'them'}")

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scale_alpha(self) -> float:
        """``alpha`` as PEFT takes it: the one given, else 2 x rank."""
        return float(self.alpha) if self.alpha is not None else 2.0 * float(self.rank or 0)


def split_targets(text: str) -> tuple[str, ...]:
    """``q_proj,v_proj`` -> ``("q_proj", "v_proj")``."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def peft_config(adapters: AdapterConfig) -> Any:
    """PEFT's ``LoraConfig`` of ``adapters`` (a causal LM's)."""
    from peft import LoraConfig  # heavy: see the module docstring

    targets = ALL_LINEAR if adapters.targets == (ALL_LINEAR,) else list(adapters.targets)
    return LoraConfig(r=adapters.rank, lora_alpha=adapters.scale_alpha, target_modules=targets, lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")


def with_adapters(model: Any, adapters: AdapterConfig, base: str, seed: int) -> Any:
    """``model`` wrapped by PEFT with fresh adapters (B zero, so the student starts as ``model``; A drawn from
    ``seed``, the process's random state left as it was), its base weights frozen. ``base`` (the preset or the
    directory the student came from) is written as the adapters' ``base_model_name_or_path``, so that
    ``models.load_model`` of the saved adapters finds it."""
    import os
    import warnings

    import torch
    from peft import get_peft_model  # heavy: see the module docstring

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # PEFT reads transformers' deprecated is_gradient_checkpointing: not the user's to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, peft_config(adapters))
    wrapped.peft_config["default"].base_model_name_or_path = os.path.abspath(base) if os.path.isdir(base) else base
    return wrapped


def trainable_parameters(model: Any) -> tuple[int, int]:
    """(trainable, all) parameter counts of ``model`` (ZeRO-3's partitioned ones at their full size)."""
    trainable = total = 0
    for param in model.parameters():
        count = int(getattr(param, "ds_numel", param.numel()))
        total += count
        trainable += count if param.requires_grad else 0
    return trainable, total


ADAPTABLE = ("Linear", "Embedding", "Conv1D", "Conv1d", "Conv2d")
"""Class names of the layers PEFT's LoRA wraps (``Conv1D``: GPT-2's linear layers, transformers' class)."""


def check_targets(model: Any, adapters: AdapterConfig, name: str) -> None:
    """Refuses a target that matches no layer PEFT can wrap in ``model`` (built from its config on the meta device:
    no weights needed), naming the layers there are. PEFT refuses only when no target matches at all; a misspelt
    one of several would silently adapt fewer layers."""
    layers = sorted({path.rsplit(".", 1)[-1] for path, module in model.named_modules()
                     if path and type(module).__name__ in ADAPTABLE})
    if adapters.targets == (ALL_LINEAR,):
        return
    paths = [path for path, module in model.named_modules() if path and type(module).__name__ in ADAPTABLE]
    missing = [t for t in adapters.targets if not any(p == t or p.endswith("." + t) for p in paths)]
    if missing:
        raise ValueError(f"--lora-targets {', '.join(map(repr, missing))} match{'es' if len(missing) == 1 else ''} "
                         f"no layer of the student {name!r}; its layers LoRA can wrap: {', '.join(layers)} (or "
                         f"{ALL_LINEAR})")
