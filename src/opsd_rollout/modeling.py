"""What the package needs to know about a transformers causal LM, read once; the bottom floor every other
module may import (it imports only torch and transformers).

A model is reached through wrappers (DeepSpeed engines hold it as ``.module``, PEFT models return it from
``get_base_model()``); ``ModelSpec.of`` reads the innermost transformers model's facts once, so nothing
else asks ``get_text_config`` or guesses at attribute names.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

CACHE_KEYWORDS = ("cache", "past_key_values")
"""How a model's ``forward`` takes its KV cache: ``cache`` from transformers 5.23 on, ``past_key_values``
before. Passing the other name is no error in either: ``**kwargs`` swallows it and the model runs uncached."""


def text_config(config: Any) -> Any:
    """The decoder's config of a (possibly multimodal) model config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def wrapped_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and what it wraps: ``.module`` of DeepSpeed engines, ``get_base_model()`` of PEFT."""
    chain = [module]
    while True:
        current = chain[-1]
        inner = getattr(current, "module", None)
        if not isinstance(inner, torch.nn.Module) and callable(getattr(current, "get_base_model", None)):
            inner = current.get_base_model()
        if not isinstance(inner, torch.nn.Module) or inner in chain:
            return chain
        chain.append(inner)


def innermost_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose forward runs at every step, inside DeepSpeed and PEFT wrappers."""
    return wrapped_modules(module)[-1]


def device_of(module: torch.nn.Module) -> torch.device:
    """Where ``module`` runs: its ``device`` attribute (DeepSpeed engines, transformers models), else its first
    parameter's device, else the CPU."""
    device = getattr(module, "device", None)
    if isinstance(device, (torch.device, str)):
        return torch.device(device)
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """[N, T] positions of left-padded (or holed) sequences: real tokens count from 0, as transformers'
    ``generate`` numbers them (masked positions get 1; they are never attended to)."""
    return (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)


def cache_keyword(model: torch.nn.Module) -> str | None:
    """The keyword ``model.forward`` takes its KV cache by (see ``CACHE_KEYWORDS``), or ``None`` when it takes
    none by name."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        return None
    return next((name for name in CACHE_KEYWORDS if name in parameters), None)


@dataclass(frozen=True)
class KVShape:
    """Per layer, the keys/values of one row and one position: ``kv_heads x head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> "KVShape":
        config = text_config(config)
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(layers, kv_heads, getattr(config, "head_dim", None) or hidden // heads)

    def bytes_per_token(self, element_size: int) -> int:
        """Keys and values of one position of one row, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size
