"""``postprocess``: a rollout's post-processing, ours against DeepSpeed's ``HybridEngineRollout``, on one batch.

Both rollouts replay a precomputed generation at once, so each profile's ``post_processing_ms`` is post-processing
alone, on identical tokens: DeepSpeed's through a stand-in model's ``generate``; ours through the same stand-in
(strategy ``generate``: the EOS searched for) or through a stand-in for our decode loop (strategy ``static``: the
loop's tokens, padding after each row's end as the loop leaves them, and each row's length, which the loop records
while it stops the row, in generation, so post-processing searches nothing)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from kernel_bench.contest import Contest, Timed
from opsd_rollout.rollout.decode.stats import DecodeStats
from opsd_rollout.rollout.postprocess import response_lengths

VOCAB, PAD, EOS = 32000, 0, 2


class ReplayLM(torch.nn.Module):
    """A causal-LM stand-in whose ``generate`` returns the prompt + precomputed responses [rows, R]."""

    def __init__(self, responses: torch.Tensor):
        super().__init__()
        self.responses = responses
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # a parameter: the rollouts read the device from it
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20)
        self.generation_config = SimpleNamespace(eos_token_id=EOS)

    def generate(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.cat([input_ids, self.responses[:input_ids.shape[0]]], dim=1)


class ReplayDecode:
    """A stand-in for strategy ``static`` (the protocol of ``rollout/strategies/base.py``): the prompts + precomputed
    responses, and each row's length handed over as the decode loop hands it (``DecodeStats.lengths``)."""

    name = "static"
    workspace = None
    weight_layout_bytes = None

    def __init__(self, responses: torch.Tensor, lengths: torch.Tensor):
        self.responses, self.lengths = responses, lengths
        self.last_stats = DecodeStats()

    def generate(self, target: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, plan: Any, recorder: Any,
                 processor: Any = None, seed: int | None = None) -> torch.Tensor:
        rows = prompt_ids.shape[0]
        self.last_stats = DecodeStats(lengths=self.lengths[:rows].clone())
        return torch.cat([prompt_ids, self.responses[:rows]], dim=1)

    def unsupported_reason(self, target: Any) -> None:
        return None

    def prepare(self, target: Any) -> None:
        """Nothing to prepare."""

    def release_workspace(self) -> None:
        """Nothing kept."""

    def probe_points(self) -> list:
        return []


def replay_batch(prompts: int, samples: int, prompt_length: int, response_length: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts [B, P] with their mask, and responses [B*n, R] of which about half stop at an EOS, padding
    after it (as ``generate`` and our decode loop leave them)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (prompts, prompt_length), generator=g)
    lengths = torch.randint(1, prompt_length + 1, (prompts, 1), generator=g)
    mask = (torch.arange(prompt_length) >= prompt_length - lengths).long()
    responses = torch.randint(3, VOCAB, (prompts * samples, response_length), generator=g)
    stop = torch.randint(0, response_length * 2, (prompts * samples,), generator=g)
    early = stop < response_length
    responses[early, stop[early]] = EOS
    responses.masked_fill_(torch.arange(response_length) > stop.unsqueeze(1), PAD)
    return prompt_ids.masked_fill(mask == 0, PAD), mask, responses


class PostprocessContest(Contest):
    def __init__(self, config: Any, settings: Any, device: torch.device):
        from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedRollout
        from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig as DeepSpeedConfig

        from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig

        super().__init__(torch.device("cpu"))  # the stand-in model lives on the CPU
        n = config.samples_per_prompt
        prompt_ids, mask, responses = replay_batch(config.rows // n, n, config.prompt_length,
                                                   config.response_length, settings.seed)
        model = ReplayLM(responses)
        tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
        self.mine = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(
            enable_profiling=True, strategy="generate", response_width=config.response_width or "max_new_tokens"))
        if config.postprocess_strategy == "static":
            self.mine.strategy = ReplayDecode(responses, response_lengths(responses, torch.tensor([EOS])))
        self.theirs = DeepSpeedRollout(SimpleNamespace(module=model), tokenizer, DeepSpeedConfig(enable_profiling=True))
        self.request = RolloutRequest(prompt_ids, mask)
        self.sampling = SamplingConfig(max_new_tokens=config.response_length, n_samples_per_prompt=n, temperature=0.0)

    def ours(self) -> tuple[float, torch.Tensor]:
        batch = self.mine.generate(self.request, self.sampling)
        return self.mine.get_last_profile()["post_processing_ms"], batch.input_ids

    def baseline(self) -> tuple[float, torch.Tensor]:
        batch = self.theirs.generate(self.request, self.sampling)
        return self.theirs.get_last_profile()["post_processing_ms"], batch.input_ids

    def figures(self, sides: dict[str, Timed]) -> dict[str, Any]:
        return {"kernel_ms": sides["ours"].result[0], "baseline_ms": sides["baseline"].result[0],
                "call_ms": sides["ours"].ms, "baseline_call_ms": sides["baseline"].ms}

    def same(self, ours: Any, baseline: Any) -> bool:
        """The same token ids, DeepSpeed's ``max_new_tokens`` wide (ours trimmed to the longest response with
        ``response_width='longest'``: DeepSpeed's columns past ours all padding); the masks differ by design (DeepSpeed
        masks by value, wrong for generated pad tokens)."""
        width = ours[1].shape[1]
        return torch.equal(ours[1], baseline[1][:, :width]) and bool((baseline[1][:, width:] == PAD).all())


def build(config: Any, settings: Any, built: Any, device: torch.device) -> PostprocessContest:
    return PostprocessContest(config, settings, device)
