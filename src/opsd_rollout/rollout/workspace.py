"""The reusable KV workspace: one flat buffer per layer for keys and one for values, viewed as contiguous
``[N, H, L, D]`` tensors for each rollout's shape, so a workspace sized by the largest rollout serves
every smaller one without reallocating. Plus the shared prefill's own (smaller) buffers, and the token and
attention-mask buffers of the decode loop.

Two kinds of cache layers sit on it. Eager decoding uses ``FilledLayer``: attention reads only the positions
written so far (``[N, H, filled, D]`` views of the buffer), so the unwritten tail costs nothing and needs no
mask. A compiled decode step (CUDA graphs) needs the same shapes at every step and uses ``WholeLayer``,
transformers' ``StaticLayer``, which always returns the whole ``[N, H, L, D]`` buffer and relies on the mask.
Every tensor a compiled step reads (buffers, views, fill counters) keeps its address from call to call."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from opsd_rollout.modeling import KVShape


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


class WholeLayer(StaticLayer):
    """transformers' ``StaticLayer`` over workspace memory (the whole cache every step, for compiled steps),
    which also counts on the host the positions eager forwards wrote, so a forward that ignored the cache
    is caught (``written``); inside compiled code the count is skipped (a Python int would be a guard)."""

    written: int = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():
            self.written += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)


def written(layer: StaticLayer) -> int:
    """Positions an eager forward wrote into a workspace layer."""
    return layer.filled if isinstance(layer, FilledLayer) else layer.written


def set_filled(layer: StaticLayer, length: int) -> None:
    """Mark the first ``length`` positions of a workspace layer as written (after copying them in)."""
    if isinstance(layer, FilledLayer):
        layer.filled = length
    else:
        layer.cumulative_length.fill_(length)
        layer.written = length


def check_written(cache: Any, expected: int, what: str) -> None:
    """Raise if a forward did not write ``expected`` positions into every layer of ``cache``: the model then ran
    without its cache (e.g. a transformers release that takes the cache under another keyword), and every
    later token would be wrong. Host-side counters only: no device read."""
    got = {written(layer) for layer in cache.layers}
    if got != {expected}:
        raise RuntimeError(f"the {what} forward wrote {sorted(got)} positions into the KV cache, expected {expected}: "
                           "the model did not use the cache it was given, so its tokens would be wrong. This "
                           "transformers release is not supported by the static strategy; use strategy='generate'.")


class _Buffers:
    """One flat keys buffer and one flat values buffer per layer, and the caches viewing them by shape."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.caches: dict[tuple, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def fits(self, shape: KVShape, elements: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (len(self.keys) == shape.layers and self.keys[0].numel() >= elements
                and self.keys[0].dtype == dtype and self.keys[0].device == device)

    def allocate(self, shape: KVShape, elements: int, dtype: torch.dtype, device: torch.device) -> None:
        self.release()
        self.keys = [torch.zeros(elements, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(elements, dtype=dtype, device=device) for _ in range(shape.layers)]

    def release(self) -> None:
        self.keys, self.values, self.caches = [], [], {}


class KVWorkspace:
    """Buffers kept between rollouts (``cache_policy=retain``) and freed by ``release()``."""

    def __init__(self) -> None:
        self._kv = _Buffers()
        self._prefill = _Buffers()
        self._lengths: list[torch.Tensor] = []
        """Per layer, the ``cumulative_length`` of ``WholeLayer`` caches: allocated once, reset in place, so a
        compiled step that reads it sees one address for the workspace's life."""
        self._tokens: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self.last_event: str | None = None
        """``reused`` or ``allocated``: what the last rollout's ``cache()``/``prefill_cache()`` calls did."""

    @property
    def nbytes(self) -> int:
        """Bytes of the key/value buffers (the decode cache and the shared prefill's)."""
        return self._kv.nbytes + self._prefill.nbytes

    def release(self) -> None:
        self._kv.release()
        self._prefill.release()
        self._lengths, self._tokens, self._mask, self._decode_mask = [], None, None, None

    def allocate(self, part: str, shape: KVShape, elements: int, dtype: torch.dtype, device: torch.device) -> None:
        """(Re)allocate ``part``'s key/value buffers (``kv`` or ``prefill``), ``elements`` per layer; a profiled
        rollout times this call as ``workspace_alloc_ms``."""
        if part == "kv":
            self._kv.allocate(shape, elements, dtype, device)
            if len(self._lengths) != shape.layers or self._lengths[0].device != device:
                self._lengths = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(shape.layers)]
        else:
            self._prefill.allocate(shape, elements, dtype, device)

    def cache(self, config: Any, rows: int, length: int, dtype: torch.dtype, device: torch.device, *,
              static_shapes: bool = False) -> StaticCache:
        """The decode cache for ``rows`` x ``length``, empty: a transformers ``StaticCache`` whose layers view the
        workspace (``FilledLayer``, or with ``static_shapes`` ``WholeLayer``). The same cache object comes back
        for the same shape, so a compiled step sees the same tensors every call."""
        self.last_event = None
        cache = self._cache("kv", self._kv, config, rows, length, dtype, device,
                            WholeLayer if static_shapes else FilledLayer)
        for layer, counter in zip(cache.layers, self._lengths):
            if isinstance(layer, WholeLayer):
                if layer.cumulative_length is not counter:
                    layer.cumulative_length = counter
                    if device.type == "cuda":  # fixed addresses: the compiled step replays as a graph
                        for tensor in (layer.keys, layer.values, counter):
                            torch._dynamo.mark_static_address(tensor)
            set_filled(layer, 0)
        return cache

    def prefill_cache(self, config: Any, rows: int, length: int, dtype: torch.dtype,
                      device: torch.device) -> StaticCache:
        """The shared prefill's cache for ``rows`` distinct prompts of ``length`` tokens, empty (``FilledLayer``
        views of the workspace's prefill buffers, kept between calls like the decode cache)."""
        cache = self._cache("prefill", self._prefill, config, rows, length, dtype, device, FilledLayer)
        for layer in cache.layers:
            set_filled(layer, 0)
        return cache

    def _cache(self, part: str, buffers: _Buffers, config: Any, rows: int, length: int, dtype: torch.dtype,
               device: torch.device, layer_type: type) -> StaticCache:
        shape = KVShape.of(config)
        elements = rows * shape.kv_heads * length * shape.head_dim
        if buffers.fits(shape, elements, dtype, device):
            self.last_event = self.last_event or "reused"
        else:
            self.allocate(part, shape, elements, dtype, device)
            self.last_event = "allocated"
        key = (rows, length, layer_type)
        if key not in buffers.caches:
            buffers.caches[key] = self._view_cache(buffers, shape, config, rows, length, device, layer_type)
        return buffers.caches[key]

    @staticmethod
    def _view_cache(buffers: _Buffers, shape: KVShape, config: Any, rows: int, length: int, device: torch.device,
                    layer_type: type) -> StaticCache:
        cache = StaticCache(config=config, max_cache_len=length)  # only full-attention layers: ModelSpec checked
        view = (rows, shape.kv_heads, length, shape.head_dim)
        elements = rows * shape.kv_heads * length * shape.head_dim
        cache.layers = [layer_type(max_cache_len=length) for _ in cache.layers]
        for layer, keys, values in zip(cache.layers, buffers.keys, buffers.values):
            layer.keys, layer.values = keys[:elements].view(view), values[:elements].view(view)
            layer.device, layer.batch_size, layer.num_heads = device, rows, shape.kv_heads
            layer.k_head_dim = layer.v_head_dim = shape.head_dim
            layer.is_initialized = True
        return cache

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

    @property
    def step_shape(self) -> tuple[int, ...] | None:
        """The decode masks' layout (``None`` when there are none), part of a compiled step's shape."""
        return None if self._decode is None else tuple(self._decode.shape[1:-1])

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
