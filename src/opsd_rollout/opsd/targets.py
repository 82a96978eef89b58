"""Training targets from a rollout: which positions predict a response token, and which token.

Ours (``ResponseTargets``) keeps only the response window; DeepSpeed's ``ResponseTokenBatch`` keeps every
shifted position with a mask. Each converts to the other exactly: the positions outside our window are
never response positions, so a loss over either is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch
from deepspeed.runtime.rollout.opsd import ResponseTokenBatch

if TYPE_CHECKING:
    from deepspeed.runtime.rollout import RolloutBatch, RolloutRequest


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
    """``P``: the first response column (with rows that start later, the earliest row's)."""
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

    def to_token_batch(self) -> ResponseTokenBatch:
        """DeepSpeed's ``ResponseTokenBatch`` of the same targets: every shifted position, masked outside the
        response; equal to ``ResponseTokenBatch.from_rollout`` of the rollout these targets came from."""
        shifted = self.input_ids.shape[1] - 1
        response_mask = torch.zeros((self.input_ids.shape[0], shifted), dtype=torch.bool, device=self.mask.device)
        response_mask[:, self.window] = self.mask
        return ResponseTokenBatch(input_ids=self.input_ids, attention_mask=self.attention_mask,
                                  target_ids=self.input_ids[:, 1:], response_mask=response_mask)

    @classmethod
    def from_token_batch(cls, batch: ResponseTokenBatch) -> "ResponseTargets":
        """Ours from DeepSpeed's ``ResponseTokenBatch``: the window starts at the first shifted position any row
        trains on (rows whose response starts later are masked there, as in ``batch``)."""
        if batch.target_ids.shape != batch.response_mask.shape or \
                batch.target_ids.shape[1] != batch.input_ids.shape[1] - 1:
            raise ValueError(f"batch must be a ResponseTokenBatch: target_ids and response_mask [N, T - 1] for "
                             f"input_ids [N, T]; got {tuple(batch.target_ids.shape)}, "
                             f"{tuple(batch.response_mask.shape)} and {tuple(batch.input_ids.shape)}")
        trained = batch.response_mask.bool().any(dim=0).nonzero()
        # no position to train on: a one-position window, masked (T - 2 is the last shifted position)
        first = int(trained[0]) if trained.numel() else max(batch.target_ids.shape[1] - 1, 0)
        return cls(batch.input_ids, batch.attention_mask, first + 1, batch.target_ids[:, first:],
                   batch.response_mask[:, first:].bool())


TargetSource: TypeAlias = "RolloutBatch | ResponseTokenBatch | ResponseTargets"
"""What a step's targets are read from: a rollout's batch, DeepSpeed's targets, or ours."""


def response_targets(batch: TargetSource) -> ResponseTargets:
    """Targets from a ``RolloutBatch`` (all rows sharing ``response_start_idx``, as every rollout here returns),
    from DeepSpeed's ``ResponseTokenBatch`` (any starts), or ours as they are.

    A ``RolloutBatch``'s targets keep the columns up to the last one any row holds a token in: a batch of
    DeepSpeed's width (``max_new_tokens`` response columns whatever the rows did) costs the teacher, the student
    and the loss no more than the trimmed one (one host read)."""
    if isinstance(batch, ResponseTargets):
        return batch
    if isinstance(batch, ResponseTokenBatch):
        return ResponseTargets.from_token_batch(batch)
    starts = batch.response_start_idx
    prompt_length = int(starts[0])
    if not bool((starts == prompt_length).all()):
        raise ValueError("response_start_idx must be the same for every row (a RolloutBatch from this package); "
                         "for rows that start apart, pass ResponseTokenBatch.from_rollout(batch)")
    if prompt_length < 1:
        raise ValueError(f"response_start_idx must be >= 1 (a prompt token predicts the first response token); "
                         f"got {prompt_length}")
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    width = filled_width(attention_mask[:, prompt_length:])
    if prompt_length + width < input_ids.shape[1]:
        input_ids = input_ids[:, :prompt_length + width].contiguous()
        attention_mask = attention_mask[:, :prompt_length + width].contiguous()
    labels = input_ids[:, prompt_length:]
    mask = attention_mask[:, prompt_length:].bool()
    return ResponseTargets(input_ids, attention_mask, prompt_length, labels, mask)


def filled_width(response_mask: torch.Tensor) -> int:
    """Columns up to and including the last one any row's ``response_mask`` [N, R] holds a token in (one host
    read)."""
    filled = response_mask.any(dim=0)  # [R]
    if filled.numel() == 0:
        return 0
    last = filled.shape[0] - filled.flip(0).to(torch.int8).argmax()
    return int(torch.where(filled.any(), last, 0))


def reprompted(targets: ResponseTargets, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> ResponseTargets:
    """``targets``' responses after other prompts: the teacher's own (``prompt_ids``, ``prompt_mask`` [N, P'],
    left-padded, one a row), so a teacher shown another context than the student (the reference, for
    self-distillation) scores exactly the student's response tokens. Labels and mask are ``targets``' own: window
    position ``j`` predicts the same response token on both sides, whatever the two prompts' lengths and padding."""
    rows = targets.labels.shape[0]
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != rows or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"the teacher's prompts must be [N, P'] ids and a mask of the same shape, a row for each of "
                         f"the {rows} response rows; got {tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}")
    if prompt_ids.shape[1] < 1 or not bool(prompt_mask[:, -1].bool().all()):
        raise ValueError("the teacher's prompts must be left-padded (every row's last column a real token), so that "
                         "each response follows its prompt")
    start = targets.prompt_length
    device = targets.input_ids.device
    input_ids = torch.cat([prompt_ids.to(device, targets.input_ids.dtype), targets.input_ids[:, start:]], dim=1)
    attention_mask = torch.cat([prompt_mask.to(device, targets.attention_mask.dtype),
                                targets.attention_mask[:, start:]], dim=1)
    return ResponseTargets(input_ids, attention_mask, prompt_ids.shape[1], targets.labels, targets.mask)


def expanded_prompts(request: RolloutRequest, samples_per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``RolloutRequest``'s prompts ``[B, P]`` as ``[B * n, P]`` ids and mask, row ``i`` prompt ``i // n`` (the
    rollout's row order), for ``reprompted``."""
    return (request.prompt_ids.repeat_interleave(samples_per_prompt, 0),
            request.prompt_attention_mask.repeat_interleave(samples_per_prompt, 0))
