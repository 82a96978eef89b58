"""What the package needs to know about a transformers causal LM, read once; the bottom floor every other
module may import (it imports only torch and transformers).

A model is reached through wrappers (DeepSpeed engines hold it as ``.module``, PEFT models return it from
``get_base_model()``); ``ModelSpec.of`` reads the innermost transformers model's facts once, so nothing
else asks ``get_text_config`` or guesses at attribute names.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch
from transformers.cache_utils import StaticCache, StaticLayer

if TYPE_CHECKING:
    from transformers.configuration_utils import PreTrainedConfig

CACHE_KEYWORDS = ("cache", "past_key_values")
"""How a model's ``forward`` takes its KV cache: ``cache`` from transformers 5.23 on, ``past_key_values``
before. Passing the other name is no error in either: ``**kwargs`` swallows it and the model runs uncached."""


def text_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The decoder's config of a (possibly multimodal) model config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def logit_transform(config: PreTrainedConfig) -> tuple[float, float | None]:
    """What a model's ``forward`` does to its LM head's output, as ``(scale, cap)``: logits times ``scale``, then
    ``cap * tanh(logits / cap)`` when ``cap`` is set. Cohere's ``logit_scale``, Granite's ``logits_scaling``,
    Gemma 2/3's ``final_logit_softcapping``; ``(1.0, None)`` for most models."""
    config = text_config(config)
    scale = 1.0
    if getattr(config, "logit_scale", None):
        scale *= config.logit_scale
    if getattr(config, "logits_scaling", None):
        scale /= config.logits_scaling
    return scale, getattr(config, "final_logit_softcapping", None) or None


class TokenizerLike(Protocol):
    """What a rollout and a step read of a tokenizer: its pad and EOS ids (a transformers tokenizer has both; a model
    whose ``generation_config`` names more EOS ids adds them)."""

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | Sequence[int] | None: ...


def model_config(model: torch.nn.Module) -> PreTrainedConfig:
    """A transformers model's ``config`` (``nn.Module`` types an attribute it does not know as a tensor or a module)."""
    return cast("PreTrainedConfig", model.config)


def lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """A transformers causal LM's head (``get_output_embeddings()``: hidden states to logits)."""
    head = model.get_output_embeddings()  # type: ignore[operator]  # nn.Module types unknown attributes as tensors
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"{type(model).__name__} has no LM head (get_output_embeddings() gave {head!r})")
    return head


def lm_body(model: torch.nn.Module) -> torch.nn.Module:
    """A transformers causal LM's body (``base_model``: the final hidden states, without the head)."""
    return cast(torch.nn.Module, model.base_model)


def wrapped_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and what it wraps: ``.module`` of DeepSpeed engines, ``get_base_model()`` of PEFT."""
    chain = [module]
    while True:
        current = chain[-1]
        inner = getattr(current, "module", None)
        base_model = getattr(current, "get_base_model", None)
        if not isinstance(inner, torch.nn.Module) and callable(base_model):
            inner = base_model()
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
    def of(cls, config: PreTrainedConfig) -> "KVShape":
        config = text_config(config)
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(layers, kv_heads, getattr(config, "head_dim", None) or hidden // heads)

    def bytes_per_token(self, element_size: int) -> int:
        """Keys and values of one position of one row, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size


def max_positions_of(config: PreTrainedConfig) -> int | None:
    """The model's position limit from its config, or ``None`` when it has none."""
    config = text_config(config)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


SHARED_PREFIX_ATTENTION = "opsd_shared_prefix"
"""The prefix of the attention implementations a rollout with shared-prefix attention selects
(``rollout/shared_prefix.py``): ``opsd_shared_prefix:sdpa`` is SDPA itself outside its decode forwards."""


def base_attention(implementation: str | None) -> str | None:
    """The model's own implementation behind ``implementation`` (the shared-prefix twin's, or any other as is)."""
    if isinstance(implementation, str) and implementation.startswith(SHARED_PREFIX_ATTENTION + ":"):
        return implementation[len(SHARED_PREFIX_ATTENTION) + 1:]
    return implementation


STATIC_ATTENTION = (None, "sdpa", "eager", "flex_attention")
"""Attention implementations that read a preallocated cache through its layers' ``update`` and the mask we pass.
Flash attention trims keys by the 2-D mask's length, which would span the whole static cache."""

NEUTRAL_GENERATION = {"repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
                      "encoder_no_repeat_ngram_size": (None, 0), "min_new_tokens": (None, 0), "min_length": (None, 0),
                      "suppress_tokens": (None, []), "begin_suppress_tokens": (None, []), "bad_words_ids": (None, []),
                      "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "sequence_bias": (None, {}),
                      "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "typical_p": (None, 1.0),
                      "min_p": (None, 0.0), "exponential_decay_length_penalty": (None,),
                      "renormalize_logits": (None, False), "diversity_penalty": (None, 0.0)}
"""``generation_config`` fields and the values that leave ``generate()``'s logits processors off."""


def _static_cache_problem(model: torch.nn.Module, config: PreTrainedConfig, attention: str | None,
                          keyword: str | None) -> str | None:
    if keyword is None:
        return f"{type(model).__name__}.forward takes no KV cache argument by name"
    if attention not in STATIC_ATTENTION:
        return f"attention implementation {attention!r} needs transformers' own cache handling"
    if getattr(config, "v_head_dim", None) not in (None, getattr(config, "head_dim", None)) or getattr(
            config, "qk_rope_head_dim", None):
        return "keys and values of different widths (multi-head latent attention)"
    try:
        layers = StaticCache(config=model_config(model), max_cache_len=2).layers
    except Exception as error:  # noqa: BLE001 - any failure means: no static cache for this model
        return f"cannot build a static cache for {type(model).__name__}: {error}"
    if any(type(layer) is not StaticLayer for layer in layers):
        return "sliding-window or linear-attention layers need transformers' own cache handling"
    return None


def _full_numel(param: torch.Tensor) -> int:
    """A parameter's full size, also when ZeRO-3 has partitioned it away (``ds_numel``)."""
    return int(getattr(param, "ds_numel", param.numel()))


@dataclass(frozen=True)
class ModelSpec:
    """A transformers causal LM's facts, read once (``ModelSpec.of``) from the innermost model."""

    config: PreTrainedConfig
    """The decoder's config."""
    vocab_size: int | None
    max_positions: int | None
    hidden_size: int | None
    kv: KVShape | None
    """``None`` when the config does not say (the static strategy then cannot run)."""
    attention: str | None
    """``config._attn_implementation``: ``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2``, ..."""
    cache_keyword: str | None
    """The keyword the model's forward takes its KV cache by (see ``CACHE_KEYWORDS``)."""
    static_cache_problem: str | None
    """Why a preallocated static KV cache cannot serve this model, or ``None``."""
    generation_processors: tuple[str, ...]
    """``generation_config`` fields that switch on logits processors only ``generate()`` applies."""
    parameters: int
    """All parameters (ZeRO-3 partitioned ones counted whole)."""
    matmul_parameters: int
    """Parameters that take part in a matmul per token: all but the lookup tables (input embeddings not tied to
    the LM head, learned position embeddings), of which a token reads one row. A tied embedding counts here: the
    LM head multiplies by the whole matrix."""
    lookup_width: int
    """Elements one token reads from the lookup tables (every ``nn.Embedding``'s row width, summed; tied or not)."""
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelSpec":
        model = innermost_model(model)
        config = text_config(model_config(model))
        attention = base_attention(getattr(model_config(model), "_attn_implementation", None))
        keyword = cache_keyword(model)
        try:
            kv = KVShape.of(config)
        except (AttributeError, TypeError):
            kv = None
        params = list(model.parameters())
        parameters = sum(_full_numel(p) for p in params)
        output_embeddings = getattr(model, "get_output_embeddings", None)
        output = output_embeddings() if output_embeddings is not None else None
        lookups = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        untied = [m.weight for m in lookups if m.weight is not getattr(output, "weight", None)]
        generation = getattr(model, "generation_config", None)
        return cls(
            config=config, vocab_size=getattr(config, "vocab_size", None), max_positions=max_positions_of(config),
            hidden_size=getattr(config, "hidden_size", None) or getattr(config, "n_embd", None), kv=kv,
            attention=attention, cache_keyword=keyword,
            static_cache_problem=_static_cache_problem(model, config, attention, keyword) if kv is not None
            else "the config does not give the key/value shape",
            generation_processors=tuple(name for name, neutral in NEUTRAL_GENERATION.items()
                                        if getattr(generation, name, None) not in neutral),
            parameters=parameters, matmul_parameters=parameters - sum(_full_numel(w) for w in untied),
            lookup_width=sum(m.embedding_dim for m in lookups),
            dtype=params[0].dtype if params else torch.float32)
