"""The reusable KV workspace: one flat buffer per layer for keys and one for values, viewed as contiguous
``[S, H, L, D]`` tensors (S slots, L columns) for each rollout's shape, so a workspace sized by the largest
rollout serves every smaller one without reallocating. Plus the shared prefill's own buffers, and the token
and mask buffers of the decode loop.

Every cache layer on it is a ``SlotLayer``. The decode batch is the first ``A`` slots (rows that finished
leave it: compaction moves live rows to the front). Where a row writes its next keys/values is the cache's
``CacheFront``, shared by all its layers: either one column for every row (all rows started together,
"aligned": a slice copy) or each slot's own column (continuous batching: rows admitted at different times).
Attention reads the columns in use (``width``), or with ``whole`` the entire ``L`` columns at every step, the
fixed shapes a compiled step (CUDA graph) needs; a mask hides what a row must not see. Every tensor a
compiled step reads (buffers, views, per-slot columns) keeps its address from call to call.

The shared-prefix layout (``rollout/shared_prefix.py``) adds a ``PrefixStore``: each prompt's keys/values once,
``[G, H, P, D]`` per layer (G prefix slots), written by the prompts' prefill through ``PrefixLayer``s; the
decode cache then holds only the responses' columns.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from opsd_rollout.modeling import KVShape


class CacheFront:
    """Where one cache's next keys/values go, and how many columns attention reads; set by the decode loop
    before each forward, read by every layer's ``update``."""

    def __init__(self, slots: int, length: int, device: torch.device, whole: bool):
        self.length, self.whole = length, whole
        self.active = slots
        """Rows in the decode batch (the first ``active`` slots)."""
        self.aligned = True
        """All rows write the same column (``column``); otherwise each slot its own (``columns``)."""
        self.column = 0
        self.columns = torch.zeros(slots, dtype=torch.int64, device=device)
        """Per slot, the column its next key/value goes to (static address: read inside compiled steps)."""
        self.rows = torch.arange(slots, device=device)
        self.width = 0
        """Columns holding keys before this forward's write (the largest fill of any active row)."""

    def reset(self, width: int = 0) -> None:
        self.aligned, self.column, self.width = True, width, width
        self.columns.fill_(width)

    def begin(self, tokens: int) -> None:
        """Before a forward that feeds ``tokens`` per row (the layers read ``width`` now)."""
        self._tokens = tokens

    def advance(self) -> None:
        """After the forward: every row's front moved by the tokens fed. A row that finished and is still in the
        batch (until the next check retires it) keeps writing the last column, never read again: rows that all
        started together reach the cache's end only once every one of them has finished."""
        if self.aligned:
            self.column = min(self.column + self._tokens, self.length - 1)
        self.columns[:self.active].add_(self._tokens).clamp_(max=self.length - 1)
        self.width = min(self.width + self._tokens, self.length - 1)

    @property
    def view_width(self) -> int:
        """Columns attention reads during this forward (after its write)."""
        return self.length if self.whole else self.width + self._tokens


class SlotLayer(StaticLayer):
    """A ``StaticLayer`` over workspace memory whose writes and reads follow its cache's ``CacheFront``."""

    def __init__(self, max_cache_len: int, front: CacheFront):
        super().__init__(max_cache_len=max_cache_len)
        self.front = front
        self.is_compileable = front.whole  # transformers treats the eager layout as a dynamic cache
        self.written = 0
        """Positions eager forwards wrote (host count: a forward that ignored its cache is caught)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        front, rows, tokens = self.front, key_states.shape[0], key_states.shape[-2]
        if not torch.compiler.is_compiling():
            self.written += tokens
        if not (front.whole and torch.compiler.is_compiling()) and front.aligned:
            self.keys[:rows, :, front.column:front.column + tokens].copy_(key_states)
            self.values[:rows, :, front.column:front.column + tokens].copy_(value_states)
        else:  # one token per row, each at its slot's own column (a tensor: the same graph every step)
            slots, columns = front.rows[:rows], front.columns[:rows]
            self.keys[slots, :, columns] = key_states[:, :, 0]
            self.values[slots, :, columns] = value_states[:, :, 0]
        width = front.view_width
        return self.keys[:rows, :, :width], self.values[:rows, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.front.length if self.front.whole else self.front.width + query_length), 0

    def get_seq_length(self) -> int:
        # transformers places the query at this offset for a 2-D mask's causal part: inside a compiled whole-cache
        # step every column may be visible (the mask hides the unwritten ones) and the offset must not change
        return self.front.length - 1 if self.front.whole and torch.compiler.is_compiling() else self.front.width


class PrefixFront(CacheFront):
    """The prefix store's front: which prefix slots the next prefill writes (``dest``, one per prompt)."""

    def __init__(self, slots: int, length: int, device: torch.device):
        super().__init__(slots, length, device, whole=False)
        self.dest = torch.zeros(0, dtype=torch.int64, device=device)


class PrefixLayer(SlotLayer):
    """A prefill layer of the prefix store: the prompts' keys/values go to their prefix slots (``front.dest``),
    and the prefill attends to the prompts' own keys/values (nothing else is in their context)."""

    front: PrefixFront

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        width = key_states.shape[-2]  # the store may have more columns (a compiled step's bucket), masked
        self.written += width
        self.keys[:, :, :width].index_copy_(0, self.front.dest, key_states)
        self.values[:, :, :width].index_copy_(0, self.front.dest, value_states)
        return key_states, value_states


class PrefixStore:
    """Each prompt's keys/values once, for all of its samples: per layer ``[G, H, P, D]`` (``keys``, ``values``)
    and which positions of each prompt are real (``mask``, [G, P]). ``cache`` is what a prefill writes through
    (``front.dest`` picks the slots)."""

    def __init__(self, cache: StaticCache, front: PrefixFront, mask: torch.Tensor):
        self.cache, self.front, self.mask = cache, front, mask
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
        self.caches: dict[tuple, tuple[StaticCache, CacheFront]] = {}

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
              whole: bool = False) -> tuple[StaticCache, CacheFront]:
        """The decode cache of ``slots`` rows x ``length`` columns, empty, and its front. The same objects come
        back for the same shape, so a compiled step sees the same tensors every call."""
        self.last_event = None
        return self._cache("kv", self._kv, config, slots, length, dtype, device, whole)

    def prefill_cache(self, config: Any, rows: int, length: int, dtype: torch.dtype, device: torch.device, *,
                      capacity: int | None = None) -> tuple[StaticCache, CacheFront]:
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
        cache, front = self._cache("prefix", self._prefix, config, slots, length, dtype, device, False)
        self._prefix_mask = _buffer(self._prefix_mask, slots * length, torch.bool, device)
        mask = self._prefix_mask[:slots * length].view(slots, length).fill_(False)
        return PrefixStore(cache, front, mask)

    def _cache(self, part: str, buffers: _Buffers, config: Any, rows: int, length: int, dtype: torch.dtype,
               device: torch.device, whole: bool) -> tuple[StaticCache, CacheFront]:
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
                                                   prefix=buffers is self._prefix)
        cache, front = buffers.caches[key]
        front.reset()
        front.active = rows
        for layer in cache.layers:
            layer.written = 0
        return cache, front

    @staticmethod
    def _view_cache(buffers: _Buffers, shape: KVShape, config: Any, rows: int, length: int, device: torch.device,
                    whole: bool, prefix: bool = False) -> tuple[StaticCache, CacheFront]:
        cache = StaticCache(config=config, max_cache_len=length)  # only full-attention layers: ModelSpec checked
        front = PrefixFront(rows, length, device) if prefix else CacheFront(rows, length, device, whole)
        view = (rows, shape.kv_heads, length, shape.head_dim)
        elements = rows * shape.kv_heads * length * shape.head_dim
        layer_type = PrefixLayer if prefix else SlotLayer
        cache.layers = [layer_type(length, front) for _ in cache.layers]
        for layer, keys, values in zip(cache.layers, buffers.keys, buffers.values):
            layer.keys, layer.values = keys[:elements].view(view), values[:elements].view(view)
            layer.device, layer.batch_size, layer.num_heads = device, rows, shape.kv_heads
            layer.k_head_dim = layer.v_head_dim = shape.head_dim
            layer.is_initialized = True
            if (whole or prefix) and device.type == "cuda":  # fixed addresses: the compiled step replays as a graph
                for tensor in (layer.keys, layer.values):
                    torch._dynamo.mark_static_address(tensor)
        if whole and device.type == "cuda":
            torch._dynamo.mark_static_address(front.columns)
        return cache, front

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
