"""Input checks that run before any model work: every failure is a ``ValueError``/``TypeError`` naming
the argument, the value and what was expected. The result is a ``RolloutPlan``: the call's resolved shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opsd_rollout import checks
from opsd_rollout.rollout.target import RolloutTarget


@dataclass(frozen=True)
class RolloutPlan:
    """One ``generate`` call, resolved and validated."""

    batch_size: int
    prompt_length: int
    samples_per_prompt: int
    max_new_tokens: int
    greedy: bool
    temperature: float
    top_k: int
    """``<= 0`` disables top-k."""
    top_p: float
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    continuous_batch_size: int | None = None
    """At most this many rows decode at once; pending prompts take the slots finished rows free."""
    lockstep: bool = False
    """Several ZeRO-3 ranks: every rank runs the same number of forwards and stops at the same step."""
    layerwise_gather: bool = False
    """ZeRO-3 gathers parameters layer by layer inside every forward (DeepSpeed's hooks): the decode step stays
    eager even with ``compile_decode``."""
    collective_forwards: bool = False
    """Forwards gather parameters collectively (ZeRO-3 per-layer gathering on several ranks): a rank with
    nothing to prefill still runs a prefill when another rank does."""

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size * self.samples_per_prompt

    @property
    def decoding(self) -> str:
        return "greedy" if self.greedy else "sampling"


def resolve_special_tokens(tokenizer: Any, target: RolloutTarget) -> tuple[int, tuple[int, ...]]:
    """``(pad_token_id, eos_token_ids)``: pad is the tokenizer's (0 included), else its EOS; EOS ids are the
    tokenizer's plus the model's ``generation_config.eos_token_id``."""
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    tokenizer_eos_ids = [] if tokenizer_eos is None else (
        [int(tokenizer_eos)] if isinstance(tokenizer_eos, (int,)) or getattr(tokenizer_eos, "ndim", 1) == 0
        else [int(e) for e in tokenizer_eos])
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None and tokenizer_eos_ids:
        pad = tokenizer_eos_ids[0]
    if pad is None:
        raise ValueError("tokenizer has neither pad_token_id nor eos_token_id; set tokenizer.pad_token_id "
                         "(the rollout pads finished rows with it)")
    eos_ids: list[int] = []
    for token in tokenizer_eos_ids + list(target.config_eos_ids):
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    return int(pad), tuple(eos_ids)


def check_sampling(sampling: Any) -> tuple[float, int, float]:
    """A ``SamplingConfig``'s values checked (``ValueError``/``TypeError`` naming the field): (temperature, top_k,
    top_p)."""
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "n_samples_per_prompt"):
        if not hasattr(sampling, name):
            raise TypeError(f"sampling must be a SamplingConfig; {type(sampling).__name__} has no {name!r}")
    checks.integer("sampling.continuous_batch_size", getattr(sampling, "continuous_batch_size", None),
                   optional=True)
    temperature = checks.number("sampling.temperature", sampling.temperature, hint="<= 0 means greedy")
    top_p = checks.number("sampling.top_p", sampling.top_p, above=0, at_most=1)
    top_k = checks.integer("sampling.top_k", sampling.top_k, minimum=None, hint="<= 0 disables top-k")
    return float(temperature), top_k, float(top_p)


def _check_prompts(request: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids = getattr(request, "prompt_ids", None)
    mask = getattr(request, "prompt_attention_mask", None)
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"request.prompt_ids must be a torch.Tensor [B, P]; got {type(ids).__name__}")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"request.prompt_attention_mask must be a torch.Tensor [B, P]; got {type(mask).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"request.prompt_ids must be 2-D [B, P]; got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"request.prompt_ids must hold integer token ids; got dtype {ids.dtype}")
    if mask.shape != ids.shape:
        raise ValueError(f"request.prompt_attention_mask must have the shape of prompt_ids {tuple(ids.shape)}; "
                         f"got {tuple(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        # DeepSpeed's contract is a tokenizer's mask (integers, 1 on real tokens), and the batch's mask repeats the
        # prompt's as given: a float mask would come back float. Refused, with the one-call fix
        raise ValueError(f"request.prompt_attention_mask must hold integers or bools (1 on real tokens); got dtype "
                         f"{mask.dtype}: pass mask.long()")
    if ids.shape[0] == 0:
        raise ValueError("request.prompt_ids is an empty batch (B = 0); pass at least one prompt")
    if ids.shape[1] == 0:
        raise ValueError("request.prompt_ids has no columns (P = 0); every prompt needs at least one token")
    return ids, mask


def plan_rollout(request: Any, sampling: Any, target: RolloutTarget, tokenizer: Any) -> RolloutPlan:
    """Validate a ``generate`` call and resolve its plan. Raises before any model work."""
    pad_token_id, eos_token_ids = resolve_special_tokens(tokenizer, target)
    temperature, top_k, top_p = check_sampling(sampling)
    n = checks.integer("sampling.n_samples_per_prompt", sampling.n_samples_per_prompt)
    max_new_tokens = checks.integer("sampling.max_new_tokens", sampling.max_new_tokens)
    ids, mask = _check_prompts(request)
    batch_size, prompt_length = ids.shape
    if target.max_positions is not None and prompt_length + max_new_tokens > target.max_positions:
        raise ValueError(f"prompt length {prompt_length} + sampling.max_new_tokens {max_new_tokens} = "
                         f"{prompt_length + max_new_tokens} exceeds the model's {target.max_positions} positions")

    # One host read for every value check.
    id_min, id_max, mask_ok, rows_ok, ends_ok = torch.stack([
        ids.min().long(), ids.max().long(), ((mask == 0) | (mask == 1)).all().long(), (mask != 0).any(dim=1).all().long(),
        (mask[:, -1] != 0).all().long()
    ]).tolist()
    vocab = target.vocab_size
    if id_min < 0 or (vocab is not None and id_max >= vocab):
        raise ValueError(f"request.prompt_ids holds token ids in [{id_min}, {id_max}], outside the model's "
                         f"vocabulary [0, {vocab})")
    if not mask_ok:
        raise ValueError("request.prompt_attention_mask must hold only 0 and 1")
    if not rows_ok:
        raise ValueError("request.prompt_attention_mask has a row with no real token (all 0); "
                         "every prompt needs at least one")
    if not ends_ok:
        rows = (mask[:, -1] == 0).nonzero().flatten().tolist()
        raise ValueError(f"request.prompt_attention_mask: rows {rows[:8]}{' ...' if len(rows) > 8 else ''} end in "
                         "padding (right-padded prompts). The response continues from each prompt's last column, "
                         "so pad on the left (tokenizer.padding_side = 'left'); masked positions inside a prompt "
                         "are fine")
    for name, token in [("pad_token_id", pad_token_id)] + [("eos_token_id", e) for e in eos_token_ids]:
        if token < 0 or (vocab is not None and token >= vocab):
            raise ValueError(f"tokenizer {name} {token} is outside the model's vocabulary [0, {vocab})")
    return RolloutPlan(batch_size=batch_size, prompt_length=prompt_length, samples_per_prompt=n,
                       max_new_tokens=max_new_tokens, greedy=temperature <= 0.0, temperature=temperature,
                       top_k=top_k, top_p=top_p, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                       continuous_batch_size=getattr(sampling, "continuous_batch_size", None),
                       lockstep=target.zero_stage == 3 and target.world_size > 1)
