"""The frozen teacher's logits over a rollout, cached on the host.

The teacher runs in micro-batches; its final hidden states go through the LM head one sequence chunk at a
time, and each chunk of logits (or its top-k) is copied to host memory (pinned, non-blocking on CUDA), so
the device never holds more than ``micro_batch_size x chunk_size x V`` teacher logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opsd_rollout.opsd.targets import ResponseTargets
from opsd_rollout.rollout.static import position_ids
from opsd_rollout.rollout.target import innermost_model

CACHE_MODES = ("full", "topk")


@dataclass(frozen=True, kw_only=True)
class TeacherCacheConfig:
    mode: str = "full"
    """``full``: every vocabulary logit; ``topk``: the ``top_k`` largest (values + indices)."""
    top_k: int = 64
    """Logits kept per position with ``mode="topk"``."""
    micro_batch_size: int = 4
    """Rows per teacher forward."""
    chunk_size: int = 128
    """Sequence positions per LM-head chunk (and per host copy)."""
    dtype: torch.dtype | None = None
    """Storage dtype on the host; ``None`` keeps the teacher's."""

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ValueError(f"teacher cache mode must be one of {list(CACHE_MODES)}; got {self.mode!r}")
        for name in ("top_k", "micro_batch_size", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)!r}")


@dataclass
class TeacherCache:
    """Host-resident teacher logits over the response window: [N, R, V] or ([N, R, k], [N, R, k])."""

    values: torch.Tensor
    indices: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.indices) if t is not None)

    def chunk(self, start: int, stop: int, device: torch.device):
        """Window positions ``start:stop`` on ``device`` (logits, or a (values, indices) pair)."""
        non_blocking = device.type == "cuda"
        values = self.values[:, start:stop].to(device, non_blocking=non_blocking)
        if self.indices is None:
            return values
        return values, self.indices[:, start:stop].to(device, non_blocking=non_blocking)


def finalize_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """What some models' ``forward`` does after the LM head, applied here because the cache calls the LM head
    itself: Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma 2/3's ``final_logit_softcapping``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return logits


@dataclass
class TeacherTimes:
    forward_ms: float = 0.0
    cache_write_ms: float = 0.0


@torch.no_grad()
def build_teacher_cache(teacher: Any, targets: ResponseTargets, config: TeacherCacheConfig,
                        clock=None) -> tuple[TeacherCache, TeacherTimes]:
    """Run the teacher over ``targets``' sequences and cache its logits for the response window."""
    from opsd_rollout.profiling import Clock

    model = innermost_model(teacher)  # inside DeepSpeed and PEFT wrappers
    body, head = model.base_model, model.get_output_embeddings()
    device = next(head.parameters()).device if any(True for _ in head.parameters()) else targets.input_ids.device
    clock = clock or Clock(device)
    rows, window = targets.labels.shape
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
        model.config.vocab_size
    dtype = config.dtype or next(model.parameters()).dtype
    pin = device.type == "cuda"
    width = vocab if config.mode == "full" else min(config.top_k, vocab)
    values = torch.empty((rows, window, width), dtype=dtype, pin_memory=pin)
    indices = None if config.mode == "full" else torch.empty((rows, window, width), dtype=torch.int32, pin_memory=pin)
    times = TeacherTimes()
    for row in range(0, rows, config.micro_batch_size):
        ids = targets.input_ids[row:row + config.micro_batch_size].to(device)
        mask = targets.attention_mask[row:row + config.micro_batch_size].to(device)
        positions = position_ids(mask)
        start = clock.mark()
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state[:, targets.window]
        times.forward_ms += clock.elapsed_ms(start, clock.mark())
        for pos in range(0, window, config.chunk_size):
            start = clock.mark()
            logits = finalize_logits(model.config, head(hidden[:, pos:pos + config.chunk_size]))  # [b, c, V] at most
            if config.mode == "topk":
                top = torch.topk(logits, width, dim=-1)
                logits, chosen = top.values, top.indices
            mid = clock.mark()
            target = values[row:row + ids.shape[0], pos:pos + config.chunk_size]
            target.copy_(logits.to(dtype), non_blocking=pin)
            if indices is not None:
                indices[row:row + ids.shape[0], pos:pos + config.chunk_size].copy_(chosen.to(torch.int32),
                                                                                    non_blocking=pin)
            end = clock.mark()
            times.forward_ms += clock.elapsed_ms(start, mid)
            times.cache_write_ms += clock.elapsed_ms(mid, end)
    if pin:
        torch.cuda.synchronize(device)
    return TeacherCache(values, indices), times
