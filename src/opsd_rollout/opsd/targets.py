"""Training targets from a rollout: which positions predict a response token, and which token."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ResponseTargets:
    """Shifted next-token targets over the response window of a ``RolloutBatch``.

    Position ``j`` of the window is sequence position ``P - 1 + j``, whose logits predict token ``P + j``.
    """

    input_ids: torch.Tensor
    """[N, P + R] the rollout's sequences."""
    attention_mask: torch.Tensor
    """[N, P + R]."""
    prompt_length: int
    labels: torch.Tensor
    """[N, R] the response tokens (the targets)."""
    mask: torch.Tensor
    """[N, R] bool: a real response token (up to and including EOS); never prompt, never padding."""

    @property
    def window(self) -> slice:
        """Slice of sequence positions whose logits predict the response: ``P - 1 .. P + R - 2``."""
        return slice(self.prompt_length - 1, self.input_ids.shape[1] - 1)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def response_targets(batch) -> ResponseTargets:
    """From a ``RolloutBatch`` (all rows share ``response_start_idx``, as every rollout here returns)."""
    starts = batch.response_start_idx
    prompt_length = int(starts[0])
    if not bool((starts == prompt_length).all()):
        raise ValueError("response_start_idx must be the same for every row (a RolloutBatch from this package)")
    if prompt_length < 1:
        raise ValueError(f"response_start_idx must be >= 1 (a prompt token predicts the first response token); "
                         f"got {prompt_length}")
    labels = batch.input_ids[:, prompt_length:]
    mask = batch.attention_mask[:, prompt_length:].bool()
    return ResponseTargets(batch.input_ids, batch.attention_mask, prompt_length, labels, mask)
