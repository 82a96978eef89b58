"""Vectorized rollout post-processing: prompt expansion, EOS trimming, padding and masks.

No Python loop over rows; the tests hold a plain per-row reference and prove equivalence.
"""

from __future__ import annotations

import torch


def expand_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   samples_per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P] -> [B*n, P]``; row ``i`` is prompt ``i // n``."""
    if samples_per_prompt == 1:
        return prompt_ids, prompt_mask
    return (prompt_ids.repeat_interleave(samples_per_prompt, dim=0),
            prompt_mask.repeat_interleave(samples_per_prompt, dim=0))


def response_lengths(responses: torch.Tensor, eos_token_ids: torch.Tensor) -> torch.Tensor:
    """Tokens up to and including each row's first EOS, or the full width when a row has none.

    responses: [N, R'] generated tokens; eos_token_ids: [E]. Returns [N] int64.
    """
    rows, width = responses.shape
    if width == 0:
        return torch.zeros(rows, dtype=torch.int64, device=responses.device)
    is_eos = torch.isin(responses, eos_token_ids)  # [N, R']
    first_eos = is_eos.to(torch.int32).argmax(dim=1)  # argmax returns the first maximal index
    return torch.where(is_eos.any(dim=1), first_eos + 1, torch.full_like(first_eos, width)).to(torch.int64)


def response_valid(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[N, width] bool: position ``j`` holds a real token (``j < length``)."""
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def finalize_input_ids(sequences: torch.Tensor, prompt_length: int, lengths: torch.Tensor, width: int,
                       pad_token_id: int) -> torch.Tensor:
    """``[N, P + width]`` from the strategy's ``[N, P + R']`` output, in place: the prompt as generated from (the
    prompt exactly as given), then each response padded after its first EOS, to ``width`` columns (wider than
    ``R'`` when every row stopped early and the batch keeps DeepSpeed's ``max_new_tokens`` columns).

    Writing into the generated tensor instead of concatenating a new one saves a full-batch copy; a copy is made
    only when the batch is trimmed (``width < R'``) or widened, so the result is always contiguous.
    """
    generated = sequences.shape[1] - prompt_length
    if width > generated:  # one allocation, the new columns padding already
        sequences = torch.nn.functional.pad(sequences, (0, width - generated), value=pad_token_id)
    input_ids = sequences[:, :prompt_length + width]
    input_ids[:, prompt_length:].masked_fill_(~response_valid(lengths, width), pad_token_id)
    return input_ids.contiguous()


def build_attention_mask(prompt_mask: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[N, P + width]``: the prompt's own mask, then 1 on every real response token, by position only
    (a generated token equal to ``pad_token_id`` before EOS stays 1)."""
    return torch.cat([prompt_mask, response_valid(lengths, width).to(prompt_mask.dtype)], dim=1)
