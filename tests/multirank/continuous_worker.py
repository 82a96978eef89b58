"""One rank of a 2-rank ZeRO-3 rollout with very different length distributions (launched by torchrun from
test_multirank.py).

Rank 0 has many prompts whose rows end after 2 to 8 tokens and few slots (``continuous_batch_size=3``): it
compacts and admits pending rows round after round. Rank 1 has two rows that run to the cap, all in the batch
from the start. Each variant runs on the ZeRO-3 engine and, as the reference, on an unpartitioned copy of the
same model in this process alone; OUT_DIR/rank{r}.json gets both batches and the forwards each rank ran (all,
and decode forwards: one token per row).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import chain_table, left_padded, make_tokenizer, transition_model  # noqa: E402
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig  # noqa: E402
from opsd_rollout.bench.workload import WorkloadRollout  # noqa: E402
from opsd_rollout.deepspeed_engine import build_engine  # noqa: E402

TABLE = chain_table(16, {7: 2})  # t -> t + 1, and 7 -> EOS (2): a row ends when its chain reaches 7
SHORT = [[5, 6], [4], [3, 4], [6], [5], [12, 13]]  # rows end after 2, 4, 4, 2, 3 and 8 (the cap) tokens
LONG = [[9], [10, 11]]  # never reach 7 within 8 tokens
# name: (rank 0's config and sampling, rank 1's)
VARIANTS = {
    "continuous-greedy": (({}, dict(n_samples_per_prompt=2, continuous_batch_size=3)), ({}, {})),
    "compaction-greedy-per-layer": (({"zero3_gather": "per_layer"}, dict(n_samples_per_prompt=2)),
                                    ({"zero3_gather": "per_layer"}, {})),
    "continuous-sampled-forced-lengths": (
        (dict(seed=5, lengths="geometric:mean=3"),
         dict(n_samples_per_prompt=2, continuous_batch_size=3, temperature=1.0)),
        (dict(seed=5), dict(continuous_batch_size=1, temperature=1.0))),
}


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = transition_model(TABLE)
    forwards = []
    model.register_forward_pre_hook(lambda _module, args, kwargs: forwards.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]), with_kwargs=True)
    reference_model = transition_model(TABLE)
    engine = build_engine(model, 3)
    request = left_padded(SHORT if rank == 0 else LONG, 0)
    results = {}
    for name, per_rank in VARIANTS.items():
        options, sampling = per_rank[rank]
        sampling = SamplingConfig(**{"max_new_tokens": 8, "temperature": 0.0, **sampling})
        forwards.clear()
        options = dict(options)
        lengths = options.pop("lengths", "natural")  # a benchmark workload's lengths, through the bench's own hook
        config = HybridEngineRolloutConfig(enable_profiling=True, **options)

        def engine_for(module):
            rollout = HybridEngineRollout(module, make_tokenizer(0, 2), config)
            return WorkloadRollout(rollout, lengths, rollout.eos_token_ids, seed=config.seed or 0)

        batch = engine_for(engine).generate(request, sampling)
        count = {"all": len(forwards), "decode": forwards.count(1)}
        alone = engine_for(reference_model).generate(request, sampling)
        results[name] = {"input_ids": batch.input_ids.tolist(), "attention_mask": batch.attention_mask.tolist(),
                         "reference_ids": alone.input_ids.tolist(), "forwards": count["all"],
                         "decode_forwards": count["decode"]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1])
