"""The reusable KV workspace: one flat buffer per layer for keys and one for values, viewed as contiguous
``[N, H, L, D]`` tensors for each rollout's shape, so a workspace sized by the largest rollout serves
every smaller one without reallocating. Plus the token and attention-mask buffers of the decode loop.

Two kinds of cache layers sit on it. Eager decoding uses ``FilledLayer``: attention reads only the positions
written so far (``[N, H, filled, D]`` views of the buffer), so the unwritten tail costs nothing and needs no
mask. A compiled decode step (CUDA graphs) needs the same shapes at every step and uses transformers'
``StaticLayer``, which always returns the whole ``[N, H, L, D]`` buffer and relies on the mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer


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


class FilledLayer(StaticLayer):
    """A ``StaticLayer`` over preallocated memory that hands attention only the filled positions.

    ``update`` copies the new keys/values in at ``filled`` and returns views up to the new end: no copy of
    the past (unlike ``DynamicLayer``'s ``torch.cat``), no attention over the empty tail (unlike
    ``StaticLayer``). The fill level is a Python int, so reading it never synchronizes with the device."""

    is_compileable = False  # shapes change every step; transformers then treats it as a dynamic cache

    filled: int = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.filled, self.filled + key_states.shape[-2]
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        self.filled = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.filled + query_length, 0

    def get_seq_length(self) -> int:
        return self.filled


def set_filled(layer: StaticLayer, length: int) -> None:
    """Mark the first ``length`` positions of a workspace layer as written (after copying them in)."""
    if isinstance(layer, FilledLayer):
        layer.filled = length
    else:
        layer.cumulative_length.fill_(length)


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

    def cache(self, config: Any, rows: int, length: int, dtype: torch.dtype, device: torch.device, *,
              static_shapes: bool = False):
        """A transformers ``StaticCache`` for ``rows`` x ``length`` whose layers are views of the workspace:
        ``FilledLayer`` layers, or with ``static_shapes`` (a compiled decode step) plain ``StaticLayer`` ones."""
        shape = KVShape.of(config)
        elements = rows * shape.kv_heads * length * shape.head_dim
        if self._fits(shape, elements, dtype, device):
            self.last_event = "reused"
        else:
            self.allocate(shape, elements, dtype, device)
            self.last_event = "allocated"
        cache = StaticCache(config=config, max_cache_len=length)
        unsupported = {type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer}
        if unsupported:
            raise TypeError(f"{sorted(unsupported)} layers are not supported by the static workspace")
        view = (rows, shape.kv_heads, length, shape.head_dim)
        layer_type = StaticLayer if static_shapes else FilledLayer
        cache.layers = [layer_type(max_cache_len=length) for _ in cache.layers]
        for layer, keys, values in zip(cache.layers, self._keys, self._values):
            layer.keys, layer.values = keys[:elements].view(view), values[:elements].view(view)
            layer.device, layer.batch_size, layer.num_heads = device, rows, shape.kv_heads
            layer.k_head_dim = layer.v_head_dim = shape.head_dim
            layer.cumulative_length = torch.zeros((), dtype=torch.int64, device=device)
            layer.is_initialized = True
            if static_shapes and device.type == "cuda":  # fixed addresses: the compiled step replays as a graph
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
        self._tokens = _buffer(self._tokens, rows * steps, torch.int64, device)
        return self._tokens[:rows * steps].view(rows, steps).fill_(fill)

    def masks(self, prompt_mask: torch.Tensor, length: int, *, sdpa: bool, static_shapes: bool) -> "RolloutMasks":
        """The attention masks of one rollout, in this workspace's buffers (``None`` where none is needed:
        prompts without padding, decoded over ``FilledLayer`` views; one host read decides)."""
        if not static_shapes and bool(prompt_mask.all()):
            return RolloutMasks(None, None, static_shapes)
        rows, prompt_length = prompt_mask.shape
        device = prompt_mask.device
        self._mask = _buffer(self._mask, rows * length, torch.int64, device)
        mask = self._mask[:rows * length].view(rows, length)  # the prompt's mask, then ones
        mask[:, :prompt_length] = prompt_mask
        mask[:, prompt_length:] = 1
        if not sdpa:  # transformers builds the 4-D mask from this one at every forward
            return RolloutMasks(mask, mask, static_shapes)
        self._decode_mask = _buffer(self._decode_mask, rows * length, torch.bool, device)
        ready = self._decode_mask[:rows * length].view(rows, 1, 1, length)  # generated columns off until fed
        ready[:, 0, 0, :prompt_length] = prompt_mask.bool()
        ready[:, 0, 0, prompt_length:] = False
        return RolloutMasks(mask, ready, static_shapes)


def _buffer(buffer: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``buffer`` if it holds ``numel`` elements on ``device``, else a new one."""
    if buffer is None or buffer.numel() < numel or buffer.device != device:
        return torch.empty(numel, dtype=dtype, device=device)
    return buffer


class RolloutMasks:
    """The attention mask of each forward of one rollout.

    ``prefill`` is the prompt's ``[N, L]`` mask (ones past the prompt; causality hides the future). ``decode``
    is the same mask, or for SDPA a ready ``[N, 1, 1, L]`` boolean mask whose column for each fed token is
    switched on as it is fed, instead of transformers rebuilding the 4-D mask from the 2-D one every step.
    Over ``FilledLayer`` caches each forward gets the columns filled so far; with ``static_shapes`` the whole
    width, every step the same shape."""

    def __init__(self, prefill: torch.Tensor | None, decode: torch.Tensor | None, static_shapes: bool):
        self._prefill, self._decode, self._static_shapes = prefill, decode, static_shapes

    def prefill(self, width: int, rows: slice = slice(None)) -> torch.Tensor | None:
        """For a prefill into a cache ``width`` positions wide (of the given ``rows``)."""
        return None if self._prefill is None else self._prefill[rows, :width]

    def step(self, end: int) -> torch.Tensor | None:
        """For the decode forward whose fed token lands at position ``end - 1``."""
        if self._decode is None:
            return None
        if self._decode.dim() == 4:
            self._decode[..., end - 1] = True  # the fed token attends to itself from now on
        return self._decode if self._static_shapes else self._decode[..., :end]
