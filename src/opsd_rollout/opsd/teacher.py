"""The frozen teacher's logits over a rollout, cached on the host.

The teacher runs in micro-batches of rows; its final hidden states over the response window, flattened to
``[rows x window, d]``, go through the LM head ``chunk_size`` token positions at a time, and each chunk of
logits (or its top-k) is copied to host memory (pinned, non-blocking on CUDA). Flattening makes every chunk's
destination one contiguous range of the host cache, so each copy is a single DMA into pinned memory (a
strided destination would stage through pageable memory and synchronize). The device never holds more than
``chunk_size x V`` teacher logits. The host buffers are kept between steps by whoever runs the steps (a
``TeacherCacheBuffers`` it holds, e.g. in ``opsd.step.StepState``), and times are recorded as deferred marks (no
synchronization per chunk), read once at the end of the step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
import torch

from opsd_rollout import checks
from opsd_rollout.distributed import agree_max, partitioned
from opsd_rollout.metrics import bytes_text
from opsd_rollout.modeling import (innermost_model, lm_body, lm_head, logit_transform, model_config, position_ids,
                                   text_config)
from opsd_rollout.opsd.divergence import TeacherLogits
from opsd_rollout.opsd.self_teacher import scoring
from opsd_rollout.opsd.targets import ResponseTargets, TargetSource, response_targets
from opsd_rollout.profiling import NULL_RECORDER

if TYPE_CHECKING:
    from transformers.configuration_utils import PreTrainedConfig

    from opsd_rollout.profiling.recorder import Recorder

CACHE_MODES = ("full", "topk", "sampled")
OVER_BUDGET = ("error", "topk")


@dataclass(frozen=True, kw_only=True)
class TeacherCacheConfig:
    mode: str = "full"
    """``full``: every vocabulary logit; ``topk``: the ``top_k`` most likely tokens (indices) and their
    log-probabilities (values: what a served teacher returns, and what a tail bucket needs); ``sampled``: the
    teacher's log-probability of each sampled token only (float32, 4 bytes a token at any vocabulary), what
    ``DivergenceConfig(loss="sampled_reverse_kl")`` trains on."""
    top_k: int = 64
    """Logits kept per position with ``mode="topk"``."""
    micro_batch_size: int = 4
    """Rows per teacher forward."""
    chunk_size: int = 512
    """Token positions (rows x window, flattened) per LM-head chunk and per host copy: the device holds at
    most ``chunk_size x V`` teacher logits at a time."""
    dtype: torch.dtype | None = None
    """Storage dtype on the host; ``None`` keeps the teacher's."""
    host_budget_bytes: int | None = None
    """Most host memory the cache may take, checked before the teacher runs; ``None``: ``host_budget_fraction``
    of the memory available at that moment (psutil), counting the buffers the cache is built into."""
    host_budget_fraction: float = 0.5
    """The share of available host memory the default budget allows, in (0, 1]."""
    over_budget: str = "error"
    """A cache over the budget: ``error`` refuses before the teacher runs, naming the fixes; ``topk`` builds a
    ``full`` cache as the ``top_k`` cache instead (with a warning), and refuses if even that does not fit."""

    def __post_init__(self) -> None:
        checks.choice("teacher cache mode", self.mode, CACHE_MODES)
        for name in ("top_k", "micro_batch_size", "chunk_size"):
            checks.integer(f"teacher cache {name}", getattr(self, name))
        checks.integer("teacher cache host_budget_bytes", self.host_budget_bytes, optional=True)
        checks.number("teacher cache host_budget_fraction", self.host_budget_fraction, above=0, at_most=1)
        checks.choice("teacher cache over_budget", self.over_budget, OVER_BUDGET)

    def budget(self, reusable_bytes: int = 0) -> int:
        """The host-memory budget in bytes: ``host_budget_bytes``, or ``host_budget_fraction`` of what is
        available now plus ``reusable_bytes`` (buffers the cache would reuse or free)."""
        if self.host_budget_bytes is not None:
            return self.host_budget_bytes
        return int(self.host_budget_fraction * (psutil.virtual_memory().available + reusable_bytes))


@dataclass
class TeacherCache:
    """Host-resident teacher logits over the response window: logits [N, R, V], the top-k's log-probabilities and
    token ids ([N, R, k], [N, R, k]), or the sampled tokens' log-probabilities [N, R]."""

    values: torch.Tensor
    indices: torch.Tensor | None
    budget_bytes: int = 0
    """The host-memory budget the cache was checked against (0: not checked)."""
    sampled: bool = False
    """``values`` are the log-probabilities of the sampled tokens [N, R] (mode ``sampled``)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.indices) if t is not None)

    @property
    def mode(self) -> str:
        return "sampled" if self.sampled else "full" if self.indices is None else "topk"

    @property
    def stored(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds: logits [N, R, V], the top-k pair (values [N, R, k], indices [N, R, k]), or the
        sampled tokens' log-probabilities [N, R]."""
        return self.values if self.indices is None else (self.values, self.indices)

    def chunk(self, start: int, stop: int, device: torch.device) -> TeacherLogits:
        """Window positions ``start:stop`` on ``device`` (logits, or a (values, indices) pair)."""
        non_blocking = device.type == "cuda"
        values = self.values[:, start:stop].to(device, non_blocking=non_blocking)
        if self.indices is None:
            return values
        return values, self.indices[:, start:stop].to(device, non_blocking=non_blocking)


class TeacherCacheBuffers:
    """The host memory teacher caches are built in, kept from step to step (pinned on CUDA, where pinning is
    expensive enough that doing it every step would cost more than the copies it speeds up). A cache built
    into these buffers is valid until the next build into them. Whoever builds caches step after step owns one
    (``opsd.step.StepState`` holds it for ``opsd_step``'s callers)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers held now, by name (a copy of the mapping): for checks of where they live (pinned or not)."""
        return dict(self._buffers)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A contiguous ``shape`` tensor in buffer ``name``, reallocated only when it does not fit."""
        numel = 1
        for size in shape:
            numel *= size
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.is_pinned() != pin:
            self._buffers.pop(name, None)  # free the old one before allocating its replacement
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, pin_memory=pin)
        return buffer[:numel].view(shape)

    def release(self) -> None:
        self._buffers.clear()


def finalize_logits(config: PreTrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """What some models' ``forward`` does after the LM head (``logit_transform``), applied here because the cache
    calls the LM head itself."""
    scale, cap = logit_transform(config)
    if scale != 1.0:
        logits = logits * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def cache_bytes(rows: int, window: int, width: int, dtype: torch.dtype, topk: bool) -> int:
    """Host bytes of a cache of ``rows x window`` positions, ``width`` entries each (int32 indices with top-k)."""
    return rows * window * width * (dtype.itemsize + 4 * topk)


def plan_mode(config: TeacherCacheConfig, rows: int, window: int, vocab: int, dtype: torch.dtype,
              budget: int) -> str:
    """The mode the cache is built in: ``config.mode`` if it fits ``budget`` bytes; ``topk`` for a full cache
    over it when ``over_budget="topk"``; otherwise a ``ValueError`` naming the fixes, before any work."""
    top_k, full = min(config.top_k, vocab), config.mode == "full"
    needed = (rows * window * 4 if config.mode == "sampled"
              else cache_bytes(rows, window, vocab if full else top_k, dtype, not full))
    if needed <= budget:
        return config.mode
    if config.mode == "sampled":
        raise ValueError(f"the sampled teacher cache needs {bytes_text(needed)} of host memory ({rows} rows x {window} "
                         f"response positions x 4 bytes) but its budget is {bytes_text(budget)}")
    what = "full" if full else f"top-{top_k}"
    if full and config.over_budget == "topk":
        switched = cache_bytes(rows, window, top_k, dtype, True)
        if switched <= budget:
            warnings.warn(f"the full teacher cache ({bytes_text(needed)}) is over its host-memory budget "
                          f"({bytes_text(budget)}): caching the teacher's top-{top_k} logits instead "
                          f"({bytes_text(switched)})", stacklevel=3)
            return "topk"
        what = f"top-{top_k} (over_budget='topk': the full one needs {bytes_text(needed)})"
        full, needed = False, switched
    width = vocab if full else top_k
    fixes = [f"cache the teacher's top-k (TeacherCacheConfig(mode='topk', top_k={top_k}): "
             f"{bytes_text(cache_bytes(rows, window, top_k, dtype, True))} here; over_budget='topk' switches when "
             "needed)"
             if full else "a smaller top_k"]
    if dtype.itemsize > 2:
        fixes.append(f"store it in bfloat16 (dtype=torch.bfloat16: "
                     f"{bytes_text(cache_bytes(rows, window, width, torch.bfloat16, not full))})")
    fixes.append("train on fewer rows or shorter responses per step (the cache grows with rows x response length)")
    source = ("host_budget_bytes" if config.host_budget_bytes is not None
              else f"{config.host_budget_fraction:.0%} of the host memory available")
    entries = f"{vocab} logits" if full else f"{top_k} (value, index) pairs"
    raise ValueError(f"the {what} teacher cache needs {bytes_text(needed)} of host memory ({rows} rows x {window} "
                     f"response positions x {entries}, {dtype}) but its budget is {bytes_text(budget)} ({source}; "
                     f"TeacherCacheConfig.host_budget_bytes / host_budget_fraction). Fixes: " + "; or ".join(fixes)
                     + ".")


@torch.no_grad()
def build_teacher_cache(teacher: torch.nn.Module, targets: TargetSource, config: TeacherCacheConfig, *,
                        recorder: Recorder = NULL_RECORDER, buffers: TeacherCacheBuffers | None = None) -> TeacherCache:
    """Run the teacher over ``targets``' sequences and cache its logits for the response window on the host.

    ``targets``: our ``ResponseTargets``, DeepSpeed's ``ResponseTokenBatch`` (its window starts at the first
    position it trains on) or a ``RolloutBatch``. ``recorder`` (a ``StageRecorder``) gets ``teacher_forward``
    (body and LM head) and ``cache_write`` spans. ``buffers``: the host memory to build the cache in, kept by a
    caller that builds one every step; ``None``: fresh buffers, for a one-off cache (they go with it). A
    ``SelfTeacher`` scores in its own context (eval mode; a LoRA student's adapters off for its initial weights)."""
    with scoring(teacher) as running:
        return _build(running, response_targets(targets), config, recorder, buffers)


def _build(teacher: torch.nn.Module, targets: ResponseTargets, config: TeacherCacheConfig, recorder: Recorder,
           buffers: TeacherCacheBuffers | None) -> TeacherCache:
    model = innermost_model(teacher)  # inside DeepSpeed and PEFT wrappers
    body, head = lm_body(model), lm_head(model)
    head_param = next(head.parameters(), None)
    device = head_param.device if head_param is not None else targets.input_ids.device
    rows, window = targets.labels.shape
    vocab = text_config(model_config(model)).vocab_size
    dtype = config.dtype or next(model.parameters()).dtype
    pin = device.type == "cuda"
    buffers = buffers if buffers is not None else TeacherCacheBuffers()
    budget = config.budget(buffers.nbytes)
    mode = plan_mode(config, rows, window, vocab, dtype, budget)  # before the teacher runs
    sampled = mode == "sampled"
    width = vocab if mode == "full" else 1 if sampled else min(config.top_k, vocab)
    values = buffers.take("values", (rows * window, width), torch.float32 if sampled else dtype, pin)  # [N * R, W]
    indices = None if mode != "topk" else buffers.take("indices", (rows * window, width), torch.int32, pin)
    labels = targets.labels.reshape(-1, 1) if sampled else None  # [N * R, 1] the sampled tokens
    micro_batches = -(-rows // config.micro_batch_size)
    chunks = -(-min(rows, config.micro_batch_size) * window // config.chunk_size)  # the most of any micro-batch
    if partitioned(model):  # ZeRO-3 ranks gather in every forward: all run as many forwards and head chunks
        micro_batches, chunks = agree_max([micro_batches, chunks], device)
    for index in range(micro_batches):
        row = index * config.micro_batch_size
        real = row < rows
        picked = slice(row, row + config.micro_batch_size) if real else slice(0, 1)  # else a placeholder: row 0
        ids, mask = targets.input_ids[picked].to(device), targets.attention_mask[picked].to(device)
        with recorder.stage("teacher_forward"):
            hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
            hidden = hidden[:, targets.window].reshape(-1, hidden.shape[-1])  # [b * R, d]
        base = row * window  # this micro-batch's first flat position
        for chunk in range(chunks):
            start = chunk * config.chunk_size
            stop = min(start + config.chunk_size, hidden.shape[0])
            if not real or start >= hidden.shape[0]:  # another rank's chunk: join its gathers, keep nothing
                with recorder.stage("teacher_forward"):
                    head(hidden[:1])
                continue
            with recorder.stage("teacher_forward"):
                logits = finalize_logits(model_config(model), head(hidden[start:stop]))  # [c, V]
                chosen = None
                if mode == "topk":  # log q = z - logsumexp(z) over the whole vocabulary, in float32: [c, k]
                    top, chosen = torch.topk(logits, width, dim=-1)
                    logits = top.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
                elif labels is not None:  # sampled: log q(y) = z_y - logsumexp(z), in float32: [c, 1]
                    token = labels[base + start:base + stop].to(device)
                    logits = logits.float()
                    logits = logits.gather(1, token) - torch.logsumexp(logits, dim=-1, keepdim=True)
            with recorder.stage("cache_write"):
                values[base + start:base + stop].copy_(logits.to(values.dtype), non_blocking=pin)
                if indices is not None and chosen is not None:
                    indices[base + start:base + stop].copy_(chosen.to(torch.int32), non_blocking=pin)
    if pin:  # the host copies must land before anyone reads the cache
        torch.cuda.current_stream(device).synchronize()
    if sampled:
        return TeacherCache(values.view(rows, window), None, budget_bytes=budget, sampled=True)
    shape = (rows, window, width)
    return TeacherCache(values.view(shape), None if indices is None else indices.view(shape), budget_bytes=budget)
