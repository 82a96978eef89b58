"""The reusable KV workspace: one flat buffer per layer for keys and one for values, viewed as contiguous
``[N, H, L, D]`` tensors for each rollout's shape, so a workspace sized by the largest rollout serves
every smaller one without reallocating. Plus the token and attention-mask buffers of the decode loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> "KVShape":
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(layers, kv_heads, getattr(config, "head_dim", None) or hidden // heads)


class KVWorkspace:
    """Buffers kept between rollouts (``cache_policy=retain``) and freed by ``release()``."""

    def __init__(self) -> None:
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._tokens: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self.last_event: str | None = None
        """``reused`` or ``allocated``: what the last ``cache()`` call did."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def release(self) -> None:
        self._keys, self._values, self._tokens, self._mask, self._decode_mask = [], [], None, None, None

    def _fits(self, shape: KVShape, elements: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (len(self._keys) == shape.layers and self._keys[0].numel() >= elements
                and self._keys[0].dtype == dtype and self._keys[0].device == device)

    def cache(self, config: Any, rows: int, length: int, dtype: torch.dtype, device: torch.device):
        """A transformers ``StaticCache`` for ``rows`` x ``length`` whose layers are views of the workspace."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        shape = KVShape.of(config)
        elements = rows * shape.kv_heads * length * shape.head_dim
        if self._fits(shape, elements, dtype, device):
            self.last_event = "reused"
        else:
            self.allocate(shape, elements, dtype, device)
            self.last_event = "allocated"
        cache = StaticCache(config=config, max_cache_len=length)
        view = (rows, shape.kv_heads, length, shape.head_dim)
        for layer, keys, values in zip(cache.layers, self._keys, self._values):
            if type(layer) is not StaticLayer:
                raise TypeError(f"{type(layer).__name__} layers are not supported by the static workspace")
            layer.keys, layer.values = keys[:elements].view(view), values[:elements].view(view)
            layer.device, layer.batch_size, layer.num_heads = device, rows, shape.kv_heads
            layer.k_head_dim = layer.v_head_dim = shape.head_dim
            layer.cumulative_length = torch.zeros((), dtype=torch.int64, device=device)
            layer.is_initialized = True
            if device.type == "cuda":  # fixed addresses, so a compiled decode step can replay as a CUDA graph
                for tensor in (layer.keys, layer.values, layer.cumulative_length):
                    torch._dynamo.mark_static_address(tensor)
        return cache

    def allocate(self, shape: KVShape, elements: int, dtype: torch.dtype, device: torch.device) -> None:
        """(Re)allocate the key/value buffers: ``elements`` per layer (a profiled rollout times this call)."""
        self.release()
        self._keys = [torch.zeros(elements, dtype=dtype, device=device) for _ in range(shape.layers)]
        self._values = [torch.zeros(elements, dtype=dtype, device=device) for _ in range(shape.layers)]

    def tokens(self, rows: int, steps: int, fill: int, device: torch.device) -> torch.Tensor:
        """[rows, steps] int64 token buffer, filled with ``fill``."""
        if self._tokens is None or self._tokens.numel() < rows * steps or self._tokens.device != device:
            self._tokens = torch.empty(rows * steps, dtype=torch.int64, device=device)
        return self._tokens[:rows * steps].view(rows, steps).fill_(fill)

    def attention_mask(self, prompt_mask: torch.Tensor, length: int) -> torch.Tensor:
        """[N, length]: the prompt's mask, then ones (generated positions; causality masks the future)."""
        rows, prompt_length = prompt_mask.shape
        if self._mask is None or self._mask.numel() < rows * length or self._mask.device != prompt_mask.device:
            self._mask = torch.empty(rows * length, dtype=torch.int64, device=prompt_mask.device)
        mask = self._mask[:rows * length].view(rows, length)
        mask[:, :prompt_length] = prompt_mask
        mask[:, prompt_length:] = 1
        return mask

    def decode_mask(self, prompt_mask: torch.Tensor, length: int) -> torch.Tensor:
        """[N, 1, 1, length] bool for SDPA: the prompt's mask, every generated column off until fed."""
        rows, prompt_length = prompt_mask.shape
        if (self._decode_mask is None or self._decode_mask.numel() < rows * length
                or self._decode_mask.device != prompt_mask.device):
            self._decode_mask = torch.empty(rows * length, dtype=torch.bool, device=prompt_mask.device)
        mask = self._decode_mask[:rows * length].view(rows, 1, 1, length)
        mask[:, 0, 0, :prompt_length] = prompt_mask.bool()
        mask[:, 0, 0, prompt_length:] = False
        return mask
