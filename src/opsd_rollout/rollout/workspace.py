"""The reusable KV workspace: one flat buffer per layer for keys and one for values, viewed as contiguous
``[S, H, L, D]`` tensors (S slots, L columns) for each rollout's shape, so a workspace sized by the largest
rollout serves every smaller one without reallocating. Plus the shared prefill's own buffers, and the token
and mask buffers of the decode loop.

Each cache on it is a ``SlotCache`` of ``SlotLayer``s. The decode batch is the first ``A`` slots (rows that
finished leave it: compaction moves live rows to the front). Where a forward writes is passed with it, as
gpt-fast passes ``input_pos``: one column for every row (all rows started together: a slice copy) or each
slot's own column (continuous batching: rows admitted at different times). Attention reads the columns written
(``width``), or with ``whole`` the entire ``L`` columns at every step, the fixed shapes a compiled step (CUDA
graph) needs; a mask hides what a row must not see. Every buffer and view a compiled step reads keeps its
address from call to call.

The shared-prefix layout (``rollout/shared_prefix.py``) adds a ``PrefixStore``: each prompt's keys/values once,
``[G, H, P, D]`` per layer (G prefix slots), written by the prompts' prefill into the slots it names; the
decode cache then holds only the responses' columns.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from opsd_rollout.modeling import KVShape


class SlotLayer(StaticLayer):
    """One layer's keys and values, ``[S, H, L, D]`` over workspace memory; ``SlotCache.update`` writes them."""

    def __init__(self, max_cache_len: int, whole: bool):
        super().__init__(max_cache_len=max_cache_len)
        self.is_compileable = whole  # transformers treats the eager layout as a dynamic cache
        self.written = 0
        """Positions eager forwards wrote (host count: a forward that ignored its cache is caught)."""


class SlotCache(StaticCache):
    """The keys/values of ``S`` rows x ``L`` columns, per layer, written where the forward it is given says.

    transformers' ``Cache.update`` takes the keys and values and no position (on every release we accept), so a
    forward's write position rides on the cache it is handed: ``decode_one_token`` and ``prefill`` pass
    ``cache.at(column, width)`` as the model's cache, and every layer's ``update`` of that forward writes there.
    """

    def __init__(self, config: Any, slots: int, length: int, device: torch.device, whole: bool):
        super().__init__(config=config, max_cache_len=length)  # only full-attention layers: ModelSpec checked
        self.length, self.whole = length, whole
        """``whole``: every forward reads all ``length`` columns (masked), the fixed shapes a compiled step needs."""
        self.slot_ids = torch.arange(slots, device=device)
        self.column: torch.Tensor | int = 0
        self.width: int | None = 0
        self.rows: torch.Tensor | None = None

    def at(self, column: torch.Tensor | int, width: int | None, rows: torch.Tensor | None = None) -> SlotCache:
        """The cache, set to take one forward's keys/values (each row's ``tokens`` of them) at:

        - ``column``: [A] each row's own column (a tensor: one graph for every step), or one int for every row
          (a slice copy of ``tokens`` columns from there);
        - ``width``: the columns already written, which attention reads with this forward's (a causal query
          offset); ``None`` in a compiled step: the query sits after every column, which the mask hides;
        - ``rows``: [A] the cache rows the forward's rows write (the prefix store's slots, for a prefill that
          attends to its own keys/values only); ``None``: the first ``A`` rows."""
        self.column, self.width, self.rows = column, width, rows
        return self

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [A, H, tokens, D]. Writes them where ``at`` says; returns what attention reads:
        [A, H, width + tokens or L, D] (or, with ``rows``, the forward's own keys/values)."""
        layer, column, rows, tokens = self.layers[layer_idx], self.column, key_states.shape[0], key_states.shape[-2]
        if not torch.compiler.is_compiling():
            layer.written += tokens
        if self.rows is not None:
            layer.keys[:, :, :tokens].index_copy_(0, self.rows, key_states)
            layer.values[:, :, :tokens].index_copy_(0, self.rows, value_states)
            return key_states, value_states
        if isinstance(column, int):
            layer.keys[:rows, :, column:column + tokens].copy_(key_states)
            layer.values[:rows, :, column:column + tokens].copy_(value_states)
        else:  # one token per row, each at its own column
            slots = self.slot_ids[:rows]
            layer.keys[slots, :, column] = key_states[:, :, 0]
            layer.values[slots, :, column] = value_states[:, :, 0]
        width = self.get_mask_sizes(tokens, layer_idx)[0]
        return layer.keys[:rows, :, :width], layer.values[:rows, :, :width]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.length if self.whole else self.width + query_length), 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # transformers places the query at this offset for a 2-D mask's causal part: in a compiled step every
        # column may be visible (the mask hides the unwritten ones) and the offset must not change
        return self.length - 1 if self.width is None else self.width


class PrefixStore:
    """Each prompt's keys/values once, for all of its samples: per layer ``[G, H, P, D]`` (``keys``, ``values``)
    and which positions of each prompt are real (``mask``, [G, P]). ``cache`` is what a prefill writes through
    (``cache.at(0, 0, rows)``: the slots its prompts go to)."""

    def __init__(self, cache: SlotCache, mask: torch.Tensor):
        self.cache, self.mask = cache, mask
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]

    @property
    def slots(self) -> int:
        return self.mask.shape[0]


def check_written(cache: Any, expected: int, what: str) -> None:
    """Raise if a forward did not write ``expected`` positions into every layer of ``cache``: the model then ran
    without its cache (e.g. a transformers release that takes the cache under another keyword), and every
    later token would be wrong. Host-side counters only: no device read."""
    got = {layer.written for layer in cache.layers}
    if got != {expected}:
        raise RuntimeError(f"the {what} forward wrote {sorted(got)} positions into the KV cache, expected {expected}: "
                           "the model did not use the cache it was given, so its tokens would be wrong. This "
                           "transformers release is not supported by the static strategy; use strategy='generate'.")


class _Buffers:
    """One flat keys buffer and one flat values buffer per layer, and the caches viewing them by shape."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.caches: dict[tuple, SlotCache] = {}

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
        self._prefix = _Buffers()
        self._prefix_mask: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self.last_event: str | None = None
        """``reused`` or ``allocated``: what the last rollout's ``cache()``/``prefill_cache()`` calls did."""

    @property
    def nbytes(self) -> int:
        """Bytes of the key/value buffers: the decode cache, the shared prefill's and the prefix store."""
        return self._kv.nbytes + self._prefill.nbytes + self._prefix.nbytes

    def release(self) -> None:
        self._kv.release()
        self._prefill.release()
        self._prefix.release()
        self._tokens = self._mask = self._prefix_mask = None

    def allocate(self, part: str, shape: KVShape, elements: int, dtype: torch.dtype, device: torch.device) -> None:
        """(Re)allocate ``part``'s key/value buffers (``kv``, ``prefill`` or ``prefix``), ``elements`` per layer; a
        profiled rollout times this call as ``workspace_alloc_ms``."""
        {"kv": self._kv, "prefill": self._prefill, "prefix": self._prefix}[part].allocate(shape, elements, dtype,
                                                                                           device)

    def cache(self, config: Any, slots: int, length: int, dtype: torch.dtype, device: torch.device, *,
              whole: bool = False) -> SlotCache:
        """The decode cache of ``slots`` rows x ``length`` columns, empty. The same object comes back for the
        same shape, so a compiled step sees the same tensors every call."""
        self.last_event = None
        return self._cache("kv", self._kv, config, slots, length, dtype, device, whole)

    def prefill_cache(self, config: Any, rows: int, length: int, dtype: torch.dtype, device: torch.device, *,
                      capacity: int | None = None) -> SlotCache:
        """The cache prompts are prefilled into before their keys/values are copied to their rows' slots:
        ``rows`` distinct prompts of ``length`` tokens, in buffers sized for ``capacity`` prompts (the most one
        rollout prefills at once), kept between calls like the decode cache."""
        shape = KVShape.of(config)
        elements = max(rows, capacity or rows) * shape.kv_heads * length * shape.head_dim
        if not self._prefill.fits(shape, elements, dtype, device):
            self.allocate("prefill", shape, elements, dtype, device)
            self.last_event = "allocated"
        return self._cache("prefill", self._prefill, config, rows, length, dtype, device, False)

    def prefix_store(self, config: Any, slots: int, length: int, dtype: torch.dtype,
                     device: torch.device) -> PrefixStore:
        """The shared-prefix layout's store of ``slots`` prompts x ``length`` positions (contents undefined; every
        position masked off), kept between calls like the decode cache."""
        cache = self._cache("prefix", self._prefix, config, slots, length, dtype, device, False)
        self._prefix_mask = _buffer(self._prefix_mask, slots * length, torch.bool, device)
        mask = self._prefix_mask[:slots * length].view(slots, length).fill_(False)
        return PrefixStore(cache, mask)

    def _cache(self, part: str, buffers: _Buffers, config: Any, rows: int, length: int, dtype: torch.dtype,
               device: torch.device, whole: bool) -> SlotCache:
        shape = KVShape.of(config)
        elements = rows * shape.kv_heads * length * shape.head_dim
        if buffers.fits(shape, elements, dtype, device):
            self.last_event = self.last_event or "reused"
        else:
            self.allocate(part, shape, elements, dtype, device)
            self.last_event = "allocated"
        key = (rows, length, whole)
        if key not in buffers.caches:
            buffers.caches[key] = self._view_cache(buffers, shape, config, rows, length, device, whole,
                                                   static=whole or buffers is self._prefix)
        cache = buffers.caches[key]
        for layer in cache.layers:
            layer.written = 0
        return cache

    @staticmethod
    def _view_cache(buffers: _Buffers, shape: KVShape, config: Any, rows: int, length: int, device: torch.device,
                    whole: bool, static: bool) -> SlotCache:
        cache = SlotCache(config, rows, length, device, whole)
        view = (rows, shape.kv_heads, length, shape.head_dim)
        elements = rows * shape.kv_heads * length * shape.head_dim
        cache.layers = [SlotLayer(length, whole) for _ in cache.layers]
        for layer, keys, values in zip(cache.layers, buffers.keys, buffers.values):
            layer.keys, layer.values = keys[:elements].view(view), values[:elements].view(view)
            layer.device, layer.batch_size, layer.num_heads = device, rows, shape.kv_heads
            layer.k_head_dim = layer.v_head_dim = shape.head_dim
            layer.is_initialized = True
            if static and device.type == "cuda":  # fixed addresses: the compiled step replays as a graph
                for tensor in (layer.keys, layer.values):
                    torch._dynamo.mark_static_address(tensor)
        return cache

    def tokens(self, rows: int, steps: int, fill: int, device: torch.device) -> torch.Tensor:
        """[rows, steps] int64 token buffer, filled with ``fill``."""
        self._tokens = _buffer(self._tokens, rows * steps, torch.int64, device)
        return self._tokens[:rows * steps].view(rows, steps).fill_(fill)

    def mask(self, slots: int, length: int, device: torch.device) -> torch.Tensor:
        """[slots, length] bool buffer of what each slot's row may attend to (contents undefined)."""
        self._mask = _buffer(self._mask, slots * length, torch.bool, device)
        return self._mask[:slots * length].view(slots, length)


def _buffer(buffer: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``buffer`` if it holds ``numel`` elements on ``device``, else a new one."""
    if buffer is None or buffer.numel() < numel or buffer.device != device:
        return torch.empty(numel, dtype=dtype, device=device)
    return buffer
