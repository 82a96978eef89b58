"""Strategy ``static``: our own decode loop over a preallocated, reusable KV cache.

prefill -> (share the prompt's cache across its n samples) -> decode_one_token + sample, until every row
has finished or ``max_new_tokens`` is reached. The loop stops only at checks every ``k`` steps (one host
read each; under ZeRO-3 with several ranks, an all-reduce so every rank stops at the same step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from opsd_rollout.modeling import position_ids
from opsd_rollout.rollout.compiled import LENGTH_BUCKET_MIN, CompiledStep, bucket
from opsd_rollout.rollout.sampling import sample
from opsd_rollout.rollout.target import RolloutTarget
from opsd_rollout.rollout.validation import RolloutPlan
from opsd_rollout.rollout.workspace import KVWorkspace, RolloutMasks, check_written, set_filled


def prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache_mask: torch.Tensor | None,
            cache: Any, cache_keyword: str) -> torch.Tensor:
    """ids, mask: [B, P] left-padded prompts; cache_mask: [B, cache width] or None (no padding).
    Fills ``cache`` (passed as ``cache_keyword``, the name the model's forward takes it by); returns the last
    logits [B, V]."""
    out = model(input_ids=ids, attention_mask=cache_mask, position_ids=position_ids(mask), use_cache=True,
                logits_to_keep=1, **{cache_keyword: cache})
    return out.logits[:, -1]


def decode_one_token(model: torch.nn.Module, token: torch.Tensor, position: torch.Tensor,
                     mask: torch.Tensor | None, cache: Any, cache_keyword: str) -> torch.Tensor:
    """token, position: [N, 1]; mask: [N, kv], [N, 1, 1, kv] or None. Returns logits [N, V] for the next token."""
    out = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True,
                **{cache_keyword: cache})
    return out.logits[:, -1]


def replicate_cache(source: Any, target: Any, repeats: int, prompt_length: int) -> None:
    """Copy each prompt's prefilled keys/values into its ``repeats`` sample rows ([B..] -> [B*n..]), as one
    broadcast copy per tensor (no ``[B*n, ...]`` temporary)."""
    for src, dst in zip(source.layers, target.layers):
        for a, b in ((src.keys, dst.keys), (src.values, dst.values)):
            rows, heads, _, dim = a.shape
            b.view(rows, repeats, heads, -1, dim)[:, :, :, :prompt_length].copy_(
                a[:, :, :prompt_length].unsqueeze(1))
        set_filled(dst, prompt_length)


class StaticDecode:
    """Prefill once (B prompts, not B*n, with ``shared_prefill``), then a static-shape decode loop."""

    name = "static"

    def __init__(self, *, shared_prefill: bool = True, stop_check_interval: int | None = None,
                 seed: int | None = None, compile_decode: bool = False, static_shapes: bool = False,
                 compile_options: dict[str, Any] | None = None):
        self.shared_prefill = shared_prefill
        # A compiled step needs the same shapes every step: the whole cache, masked (``static_shapes``).
        # Eager decoding attends to the filled positions only, which is cheaper.
        self.static_shapes = static_shapes or compile_decode
        # only the one-token step is compiled (CUDA-graph friendly); prefill stays eager
        options = compile_options or {"mode": "reduce-overhead", "dynamic": False}
        self.compiled = CompiledStep(decode_one_token, options) if compile_decode else None
        self._decode_step = self.compiled or decode_one_token
        self.stop_check_interval = stop_check_interval
        self.seed = seed
        self.workspace = KVWorkspace()
        self._generator: torch.Generator | None = None

    def release_workspace(self) -> None:
        self.workspace.release()

    def unsupported_reason(self, target: RolloutTarget) -> str | None:
        """Why this strategy cannot run ``target`` (the rollout then uses ``generate``), or ``None``."""
        if target.hybrid_engine:
            return "the hybrid engine generates through its own patched generate()"
        if target.spec.static_cache_problem:
            return target.spec.static_cache_problem
        if target.spec.generation_processors:
            return (f"the model's generation_config sets {list(target.spec.generation_processors)}, which only "
                    "generate() applies")
        return None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self.seed is not None:
                self._generator.manual_seed(self.seed)
        if self.seed is None:  # follow torch's global RNG, so torch.manual_seed makes runs repeatable
            self._generator.manual_seed(int(torch.randint(0, 2**62, ())))
        return self._generator

    def generate(self, target: RolloutTarget, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 plan: RolloutPlan) -> torch.Tensor:
        """prompt_ids, prompt_mask: [N, P] expanded prompts. Returns [N, P + R'] (a fresh tensor)."""
        model, config, device = target.model, target.forward_module.config, prompt_ids.device
        n, (rows, P) = plan.samples_per_prompt, prompt_ids.shape
        length = P + plan.max_new_tokens
        if self.compiled is not None:  # a bounded set of cache lengths: one graph per bucket, not per length
            length = bucket(length, LENGTH_BUCKET_MIN)
        dtype = target.dtype if target.dtype.is_floating_point else torch.float32
        attention = getattr(config, "_attn_implementation", None)
        # flex attention compiles its kernel for each key length: the whole-cache layout keeps one length
        static_shapes = self.static_shapes or attention == "flex_attention"
        cache = self.workspace.cache(config, rows, length, dtype, device, static_shapes=static_shapes)
        masks = self.workspace.masks(prompt_mask, length, static_shapes=static_shapes, sdpa=attention == "sdpa")
        keyword = target.cache_keyword
        if self.shared_prefill and n > 1:
            # prefill the B distinct prompts, then copy their keys/values into the n rows of each
            shared = self.workspace.prefill_cache(config, rows // n, P, dtype, device)
            logits = prefill(model, prompt_ids[::n], prompt_mask[::n], masks.prefill(P, rows=slice(None, None, n)),
                             shared, keyword)
            check_written(shared, P, "prefill")
            replicate_cache(shared, cache, n, P)
            logits = logits.repeat_interleave(n, dim=0)
        else:
            logits = prefill(model, prompt_ids, prompt_mask, masks.prefill(length if static_shapes else P), cache,
                             keyword)
            check_written(cache, P, "prefill")
        if self.compiled is not None:
            self.compiled.note_shape((rows, length, masks.step_shape, dtype, device.type))
        lockstep = target.zero_stage == 3 and target.world_size > 1
        tokens = self._decode(model, logits, prompt_mask, masks, cache, plan, lockstep, keyword)
        return torch.cat([prompt_ids, tokens], dim=1)

    def _decode(self, model: torch.nn.Module, logits: torch.Tensor, prompt_mask: torch.Tensor,
                masks: RolloutMasks, cache: Any, plan: RolloutPlan, lockstep: bool, keyword: str) -> torch.Tensor:
        """The decode loop; returns the generated tokens [N, steps run]."""
        device = logits.device
        prompt_length = prompt_mask.shape[1]
        generator = None if plan.greedy else self._generator_for(device)
        eos = torch.tensor(plan.eos_token_ids, dtype=torch.int64, device=device)
        check_every = self.stop_check_interval or (8 if device.type == "cuda" else 1)
        tokens = self.workspace.tokens(logits.shape[0], plan.max_new_tokens, plan.pad_token_id, device)
        position = prompt_mask.long().sum(dim=1, keepdim=True)  # [N, 1]: next token's position
        token = sample(logits, plan, generator)
        tokens[:, 0] = token
        running = ~torch.isin(token, eos)
        steps = 1
        while steps < plan.max_new_tokens:
            if steps % check_every == 0 and not plan.ignore_eos and self._all_done(running, lockstep):
                break
            mask = masks.step(prompt_length + steps)  # the token fed now sits at prompt_length + steps - 1
            logits = self._decode_step(model, token.unsqueeze(1), position, mask, cache, keyword)
            token = sample(logits, plan, generator)
            tokens[:, steps] = token
            running &= ~torch.isin(token, eos)
            position += 1
            steps += 1
        return tokens[:, :steps].clone()

    @staticmethod
    def _all_done(running: torch.Tensor, lockstep: bool) -> bool:
        """One host read; with several ranks, all agree (a rank that is done keeps stepping with the rest)."""
        done = (~running.any()).to(torch.int32)
        if lockstep:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())
