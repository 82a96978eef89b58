"""Post-processing, ours vs DeepSpeed 0.19.8's HybridEngineRollout, on the same generated batch.

Both rollouts run over a stand-in model whose ``generate`` returns a fixed, precomputed output instantly,
so each profile's ``post_processing_ms`` is post-processing alone, on identical tensors.

    python scripts/compare_postprocess.py --prompts 256 --samples-per-prompt 4 --prompt-length 512
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedRollout
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig as DeepSpeedConfig

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.bench.stats import median

VOCAB, PAD, EOS = 32000, 0, 2


class ReplayLM(torch.nn.Module):
    """A causal-LM stand-in whose generate() returns prompt + precomputed responses."""

    def __init__(self, responses: torch.Tensor):
        super().__init__()
        self.responses = responses
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20)
        self.generation_config = SimpleNamespace(eos_token_id=EOS)

    def generate(self, input_ids=None, *args, **kwargs):
        return torch.cat([input_ids, self.responses[:input_ids.shape[0]]], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    rows = args.prompts * args.samples_per_prompt
    prompt_ids = torch.randint(3, VOCAB, (args.prompts, args.prompt_length), generator=g)
    lengths = torch.randint(1, args.prompt_length + 1, (args.prompts, 1), generator=g)
    mask = (torch.arange(args.prompt_length) >= args.prompt_length - lengths).long()
    prompt_ids = prompt_ids.masked_fill(mask == 0, PAD)
    responses = torch.randint(3, VOCAB, (rows, args.response_length), generator=g)
    stop = torch.randint(0, args.response_length * 2, (rows, ), generator=g)  # about half the rows stop early
    has_stop = stop < args.response_length
    responses[has_stop, stop[has_stop]] = EOS

    model = ReplayLM(responses)
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    ours = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
    theirs = DeepSpeedRollout(SimpleNamespace(module=model), tokenizer, DeepSpeedConfig(enable_profiling=True))
    request = RolloutRequest(prompt_ids, mask)
    sampling = SamplingConfig(max_new_tokens=args.response_length, n_samples_per_prompt=args.samples_per_prompt,
                              temperature=0.0)
    times = {"opsd_rollout": [], "deepspeed": []}
    for _ in range(args.repeats + 1):  # first round is warmup
        for name, rollout in (("opsd_rollout", ours), ("deepspeed", theirs)):
            rollout.generate(request, sampling)
            times[name].append(rollout.get_last_profile()["post_processing_ms"])
    ours_ms = median(times["opsd_rollout"][1:])
    theirs_ms = median(times["deepspeed"][1:])
    print(f"batch: {rows} rows, prompt {args.prompt_length}, response <= {args.response_length}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    print("| post-processing | median ms |")
    print("|---|---:|")
    print(f"| opsd_rollout | {ours_ms:.2f} |")
    print(f"| DeepSpeed 0.19.8 HybridEngineRollout | {theirs_ms:.2f} |")
    print(f"| ratio (DeepSpeed / ours) | {theirs_ms / ours_ms:.1f}x |")


if __name__ == "__main__":
    main()
