"""The two model calls of the decode loop, as gpt-fast names them: ``prefill`` and ``decode_one_token``.

Only ``decode_one_token`` is ever compiled (one token per row: the shapes a CUDA graph replays); the prefill
stays eager. Extra keyword arguments reach the model's attention functions through transformers' attention
interface (the shared-prefix layout passes its state this way).
"""

from __future__ import annotations

from typing import Any

import torch

from opsd_rollout.modeling import position_ids


def prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache_mask: torch.Tensor | None,
            cache: Any, cache_keyword: str) -> torch.Tensor:
    """ids, mask: [B, P] left-padded prompts; cache_mask: [B, cache width] or None (no padding).
    Fills ``cache`` (passed as ``cache_keyword``, the name the model's forward takes it by); returns the last
    logits [B, V]."""
    out = model(input_ids=ids, attention_mask=cache_mask, position_ids=position_ids(mask), use_cache=True,
                logits_to_keep=1, **{cache_keyword: cache})
    return out.logits[:, -1]


def decode_one_token(model: torch.nn.Module, token: torch.Tensor, position: torch.Tensor,
                     mask: torch.Tensor | None, cache: Any, cache_keyword: str, **attention: Any) -> torch.Tensor:
    """token, position: [A, 1]; mask: [A, kv], [A, 1, 1, kv] or None; ``attention``: keyword arguments for the
    attention functions. Returns logits [A, V] for the next token."""
    out = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                **{cache_keyword: cache}, **attention)
    return out.logits[:, -1]
