"""Shared-prefix attention: each prompt's keys/values stored once for its n samples, and read once per step.

The layout: a ``PrefixStore`` holds every prompt's keys/values once (``[G, H, P, D]`` per layer, G prefix slots)
and the decode cache holds each row's response only (``[S, H, R, D]``). A decode step's attention over a row's
whole context is two attentions merged exactly by their log-sum-exps (the decomposition of Hydragen, Juravsky
et al. 2024, and of FlashInfer's cascade attention):

    softmax over [prefix; suffix] @ [V_prefix; V_suffix]
        = w_p * attention(q, prefix) + w_s * attention(q, suffix),   w_x = exp(lse_x - logaddexp(lse_p, lse_s))

The prefix part runs for the n queries of a prompt together against its one copy of the prompt (a matmul of
``n * heads_per_kv_head`` queries per key/value head instead of n reads of the prompt); the suffix part is each
row's own response. It plugs into transformers models through their attention-function interface, with no code
per model: ``install`` selects, once, when the rollout is built, an attention implementation registered under
``ATTENTION + ":" + the model's own`` (``sdpa`` or ``eager``). That implementation is the model's own in every
forward but the shared-prefix decode forwards, which pass their layout as the keyword argument
``shared_prefix`` (transformers hands a forward's extra keyword arguments to every attention call). Every model
whose attention goes through that interface (Llama, Qwen2, GPT-2, ...) works; one that does not is caught at the
first decode step (its layers never used the layout).

Rows come and go (continuous batching, compaction): each decode slot knows its row's prefix slot and sample
index (``slot_index = prefix_slot * n + sample``), so a prompt group with fewer live rows than n simply has
empty query places. Prefix slots are reused once every row of their prompt has finished. When the batch
compacts (no row pending any more), the store compacts with it: the prompts that still have a live row move to
its first prefix slots and the prefix part reads only those (``groups``, a size bucket), so a tail of a few
rows reads a few prompts, not every prompt of the request (eager steps; a compiled step reads every slot).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from opsd_rollout.modeling import SHARED_PREFIX_ATTENTION as ATTENTION, ModelSpec, base_attention
from opsd_rollout.rollout.scheduler import batch_buckets, bucket_at_least
from opsd_rollout.rollout.workspace import PrefixStore


SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Implementations whose decode forwards the shared-prefix attention replaces (it computes what they compute)."""


def shared_prefix_problem(spec: ModelSpec) -> str | None:
    """Why the shared-prefix layout cannot serve this model (it then uses the copied layout), or ``None``."""
    if spec.attention not in SUPPORTED_ATTENTION:
        return f"attention implementation {spec.attention!r} (shared-prefix attention replaces sdpa or eager)"
    if spec.attention == "eager" and getattr(spec.config, "reorder_and_upcast_attn", False):
        return "GPT-2's reorder_and_upcast_attn computes its eager attention its own way"
    return None


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: may be seen) as the additive mask attention kernels take: 0, or ``dtype``'s lowest value
    (not -inf: a row that sees nothing attends uniformly, finite, as transformers' eager attention does)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible,
                                                                                       torch.finfo(dtype).min)


def matmul_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` from matmuls: any device."""
    scores = torch.matmul(query * scale, keys.transpose(-1, -2))
    if scores.dtype not in (torch.float32, torch.float64):
        scores = scores.float()
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values), lse


_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""torch's CPU flash-attention kernel, which also returns the log-sum-exp (one kernel instead of five)."""


def partial_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` [B, H, M, D] over ``keys``/``values`` [B, H, N, D] (``bias``: additive mask in the
    query's dtype, broadcast to [B, H, M, N], or ``None``), and its log-sum-exp. Returns the output [B, H, M, D]
    (values' dtype) and the log-sum-exp of the scaled, masked scores [B, H, M] (float32 at least)."""
    if query.device.type == "cpu" and _FUSED_CPU is not None:
        return _FUSED_CPU(query, keys, values, 0.0, False, attn_mask=bias, scale=scale)
    return matmul_attention(query, keys, values, bias, scale)


def merge(output_a: torch.Tensor, lse_a: torch.Tensor, output_b: torch.Tensor,
          lse_b: torch.Tensor) -> torch.Tensor:
    """The attention over the union of two disjoint key sets, from each part's output [..., D] and log-sum-exp
    [...] (in the log-sum-exps' precision, float32 at least): part a's weight is
    exp(lse_a) / (exp(lse_a) + exp(lse_b))."""
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return torch.lerp(output_b.to(share_a.dtype), output_a.to(share_a.dtype), share_a)


def own_attention(base: str, module: torch.nn.Module) -> Any:
    """The attention function the model would run under implementation ``base``: transformers' registered one,
    or (``eager``) the model's own ``eager_attention_forward``, which every transformers modeling file defines."""
    if base != "eager":
        return ALL_ATTENTION_FUNCTIONS[base]
    modeling = sys.modules[type(module).__module__]
    eager = getattr(modeling, "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__module__} defines no eager_attention_forward: set shared_prefix=False")
    return eager


def _attention_for(base: str) -> Any:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
                  shared_prefix: "SharedPrefix | None" = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """transformers' attention-function signature. Without ``shared_prefix``: the model's own attention.
        With it (a shared-prefix decode step): query [A, Hq, 1, D]; key, value [A, Hkv, W, D], the rows' response
        columns; attention_mask [A, 1, 1, W] bool or ``None`` (all visible). Returns [A, 1, Hq, D]."""
        if shared_prefix is None:
            return own_attention(base, module)(module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
        if dropout:
            raise RuntimeError(f"shared-prefix attention applies no dropout, and the model asks for {dropout}: put "
                               "the model in eval mode for rollouts, or set shared_prefix=False")
        return shared_prefix.attend(module.layer_idx, query, key, value, attention_mask, scaling), None

    return attention


for _base in SUPPORTED_ATTENTION:
    AttentionInterface.register(f"{ATTENTION}:{_base}", _attention_for(_base))
    # the forwards that do not pass a layout build the masks the model's own attention takes
    AttentionMaskInterface.register(f"{ATTENTION}:{_base}", ALL_MASK_ATTENTION_FUNCTIONS[_base])


def install(config: Any) -> bool:
    """Select the shared-prefix-capable twin of the model's attention (once, when a rollout is built: never
    during a call). Returns whether the model's attention now takes a layout."""
    implementation = getattr(config, "_attn_implementation", None)
    if base_attention(implementation) not in SUPPORTED_ATTENTION:
        return False
    config._attn_implementation = f"{ATTENTION}:{base_attention(implementation)}"
    return True


def installed(config: Any) -> bool:
    implementation = getattr(config, "_attn_implementation", None)
    return isinstance(implementation, str) and implementation.startswith(ATTENTION + ":")


class SharedPrefix:
    """One rollout's shared-prefix state: the store, which prompt each prefix slot holds, and each decode slot's
    place among its prompt's queries (``slot_index``)."""

    def __init__(self, store: PrefixStore, samples_per_prompt: int, slots: int, *, continuous: bool, padded: bool,
                 narrow: bool = True):
        self.store, self.n = store, samples_per_prompt
        self.groups = store.slots
        """Prefix slots the prefix part reads (the first ``groups``): all of the store's; with ``narrow``, under
        continuous batching those up to the last one in use, after a compaction those of the prompts with a live
        row (size buckets)."""
        self.narrow = narrow
        """Whether ``groups`` follows the prompts in use. A compiled step keeps every slot: each count would be a
        graph of its own (a plain int to dynamo), and a long tail would run into torch's recompile limit."""
        device = store.mask.device
        self.prompt_of: list[int | None] = [None] * self.groups
        self.slot_of: dict[int, int] = {}
        """Prompt -> its prefix slot, while any of its rows is live or pending."""
        self.slot_index = torch.zeros(slots, dtype=torch.int64, device=device)
        """Per decode slot, its row's place among the grouped queries: ``prefix_slot * n + sample``."""
        self.continuous = continuous
        # prefix slots are reassigned only under continuous batching: there a finished row still in the batch
        # could share its place with a new prompt's row, so it writes its query to a sink place instead (after a
        # compaction, so do the finished rows kept as filler)
        self.identity = not continuous
        """Decode slot s holds row s, of prefix slot s // n (no compaction yet): queries group by a view."""
        self.padded = padded
        self._bias: torch.Tensor | None = None
        """[G, 1, 1, P] additive: the prefix positions each prompt must not see (its padding and holes)."""
        self._suffix_visible: torch.Tensor | None = None
        self._suffix_bias: torch.Tensor | None = None
        self.layers = len(store.keys)
        self._read = self._write = self.slot_index
        self._calls = 0

    def _bucket(self, groups: int) -> int:
        """Prefix slots read for ``groups`` in use: a size bucket (a compiled step's graphs stay few)."""
        return bucket_at_least(max(groups, 1), batch_buckets(self.store.slots))

    @property
    def sink(self) -> int:
        """The query place past every prompt's: rows that no longer produce tokens write theirs there."""
        return self.groups * self.n

    def shape_key(self) -> tuple:
        """What a compiled decode step's graph depends on besides the decode batch: the prefix slots read, the
        store's columns, how queries group (a view, or an index copy once rows moved) and which masks apply."""
        return (self.groups, self.store.mask.shape[1], self.n, self.identity, self.padded, self.continuous)

    def __contains__(self, prompt: int) -> bool:
        return prompt in self.slot_of

    # ---- admission --------------------------------------------------------------------------------------------

    def assign(self, prompts: list[int], masks: torch.Tensor, in_use: set[int]) -> tuple[Any, torch.Tensor]:
        """Give each prompt of ``prompts`` (masks [k, P]) a prefix slot, reusing those whose prompt is no longer
        ``in_use``; returns the cache their prefill writes through and the slots it writes, [k]."""
        free = [g for g in range(self.store.slots) if self.prompt_of[g] is None or self.prompt_of[g] not in in_use]
        if len(free) < len(prompts):
            raise RuntimeError(f"{len(prompts)} prompts to prefill and {len(free)} free prefix slots: the store "
                               f"was sized too small ({self.store.slots})")
        for prompt, slot in zip(prompts, free):
            self.slot_of.pop(self.prompt_of[slot], None)
            self.prompt_of[slot], self.slot_of[prompt] = prompt, slot
        if self.continuous and self.narrow:  # free slots are reused lowest first: the prompts in use are the first
            used = max(g for g, prompt in enumerate(self.prompt_of) if prompt in in_use or prompt in prompts) + 1
            self.groups = self._bucket(used)
        dest = torch.tensor(free[:len(prompts)], dtype=torch.int64, device=masks.device)
        self.store.mask[dest, :masks.shape[1]] = masks.bool()  # a compiled step's store has masked columns after
        self._bias = additive_mask(self.store.mask[:, None, None, :], self.store.keys[0].dtype)
        for layer in self.store.cache.layers:
            layer.written = 0
        return self.store.cache, dest

    def place(self, slots: torch.Tensor, rows: list[int]) -> None:
        """Decode slots ``slots`` now hold request rows ``rows`` (their prompts assigned)."""
        self.slot_index[slots] = torch.tensor([self._place(row) for row in rows], dtype=torch.int64,
                                              device=self.slot_index.device)

    def _place(self, row: int) -> int:
        """Request row ``row``'s query place: its prompt's prefix slot times n, plus its sample index."""
        return self.slot_of[row // self.n] * self.n + row % self.n

    def compact(self, rows: list[int | None]) -> int:
        """The decode batch compacted (no row is pending): its slots now hold request ``rows`` in order (``None``:
        a finished row kept as filler). The prompts with a live row move to the store's first prefix slots, as
        many as the size bucket of their count (the rest filler), and the prefix part reads those only. Returns
        the bytes of keys/values moved."""
        moved_bytes = 0
        live = list(dict.fromkeys(row // self.n for row in rows if row is not None))
        if self.narrow:
            old = [self.slot_of[prompt] for prompt in live]
            size = min(self._bucket(len(live)), self.groups)
            moved = set(old)
            order = old + [g for g in range(self.groups) if g not in moved][:size - len(old)]
        else:  # every slot stays where it is
            size, order = self.groups, list(range(self.groups))
        if order != list(range(size)):
            index = torch.tensor(order, dtype=torch.int64, device=self.slot_index.device)
            for keys, values in zip(self.store.keys, self.store.values):
                for buffer in (keys, values):
                    buffer[:size] = buffer.index_select(0, index)
                    moved_bytes += buffer[:size].numel() * buffer.element_size()
            self.store.mask[:size] = self.store.mask.index_select(0, index)
            # every slot's, as ``assign`` makes it: one shape, whichever slots a call ends up reading
            self._bias = additive_mask(self.store.mask[:, None, None, :], self.store.keys[0].dtype)
        self.prompt_of = [self.prompt_of[g] for g in order] + [None] * (self.store.slots - size)
        in_use = set(live)
        self.slot_of = {prompt: g for g, prompt in enumerate(self.prompt_of) if prompt in in_use}
        self.groups = size
        sink = self.sink
        self.slot_index[:len(rows)] = torch.tensor(
            [sink if row is None else self._place(row) for row in rows],
            dtype=torch.int64, device=self.slot_index.device)
        self.identity = False
        return moved_bytes

    # ---- decoding ---------------------------------------------------------------------------------------------

    def step(self, active: int, running: torch.Tensor) -> "SharedPrefix":
        """Before one decode forward of the first ``active`` slots (``running``: which still produce tokens):
        where each row's query goes and reads; returns the layout, for the forward's ``shared_prefix`` argument."""
        index = self.slot_index[:active]
        self._write = torch.where(running[:active], index, self.sink) if self.continuous else index
        # a row writing to the sink reads any place (its output is never used)
        self._read = index if self.identity else index.clamp(max=self.sink - 1)
        self._calls = 0
        self._suffix_visible = None
        return self

    def check_step(self) -> None:
        """After the decode forward: every layer must have used this layout."""
        if self._calls != self.layers:
            raise RuntimeError(f"the decode forward ran the shared-prefix attention in {self._calls} of {self.layers} "
                               "layers: this model's attention does not go through transformers' attention "
                               "interface, so its tokens would be wrong. Set shared_prefix=False.")

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               visible: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
        """One layer's decode attention: prefix part (grouped) merged with the suffix part (per row)."""
        rows, heads, tokens, dim = query.shape
        kv_heads = keys.shape[1]
        if tokens != 1:
            raise RuntimeError(f"shared-prefix attention decodes one token per row; got {tokens}")
        scale = scaling if scaling is not None else dim ** -0.5
        # query head h reads key/value head h // per_kv, as transformers' repeat_kv pairs them
        q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
        prefix_out, prefix_lse = self._prefix_part(layer, q, scale)
        if visible is not None and visible is not self._suffix_visible:  # the same mask for every layer of a step
            # a bool mask (SDPA's), or already additive (transformers makes the 4-D mask so for eager attention)
            bias = additive_mask(visible, query.dtype) if visible.dtype == torch.bool else visible.to(query.dtype)
            self._suffix_visible, self._suffix_bias = visible, bias
        suffix_out, suffix_lse = partial_attention(q, keys, values, None if visible is None else self._suffix_bias,
                                                   scale)
        self._calls += 1
        out = merge(prefix_out, prefix_lse, suffix_out, suffix_lse)
        return out.to(query.dtype).reshape(rows, 1, heads, dim)

    def _prefix_part(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [A, Hkv, r, D] -> the rows' attention over their prompts and its log-sum-exp, each prompt's n queries
        in one matmul against its one copy: [G, Hkv, n*r, D] x [G, Hkv, P, D]."""
        groups, n = self.groups, self.n
        rows, kv_heads, per_kv, dim = q.shape
        if self.identity:
            grouped = q.view(groups, n, kv_heads, per_kv, dim)
        else:  # a zero query where a prompt has no live row (finite, never read)
            grouped = q.new_zeros(groups * n + 1, kv_heads, per_kv, dim).index_copy_(0, self._write, q)
            grouped = grouped[:groups * n].view(groups, n, kv_heads, per_kv, dim)
        grouped = grouped.transpose(1, 2).reshape(groups, kv_heads, n * per_kv, dim)
        bias = self._bias[:groups] if self.padded else None
        out, lse = partial_attention(grouped, self.store.keys[layer][:groups], self.store.values[layer][:groups],
                                     bias, scale)
        out = out.view(groups, kv_heads, n, per_kv, dim).transpose(1, 2).reshape(groups * n, kv_heads, per_kv, dim)
        lse = lse.view(groups, kv_heads, n, per_kv).transpose(1, 2).reshape(groups * n, kv_heads, per_kv)
        if self.identity:
            return out, lse
        return out.index_select(0, self._read), lse.index_select(0, self._read)


def prefix_slots(prompts: int, decode_slots: int) -> int:
    """Prefix slots a rollout needs: one per prompt with a live row (at most one per decode slot) plus the prompt
    whose first rows finished while its later ones still wait."""
    return min(prompts, decode_slots + 1)


def slots_within(budget: int, bytes_per_position: int, rows: int, prompts: int, prompt_length: int,
                 row_length: int, shared: bool) -> int:
    """The most decode slots (at most ``rows``) whose key/value cache fits ``budget`` bytes: ``row_length``
    positions per slot, plus (``shared``) ``prompt_length`` per prefix slot. 0 when not even one fits."""
    def cost(slots: int) -> int:
        prefix = prefix_slots(prompts, slots) * prompt_length if shared else 0
        return bytes_per_position * (slots * row_length + prefix)

    fit = 0
    while fit < rows and cost(fit + 1) <= budget:
        fit += 1
    return fit
