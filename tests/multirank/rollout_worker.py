"""One rank of a 2-rank ZeRO-3 rollout (launched by torchrun from test_multirank.py).

Rank 0's prompts hit EOS at their first response token; rank 1's never do. Each rank writes its batch and
the number of forwards its model ran to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import chain_table, left_padded, make_tokenizer, transition_model  # noqa: E402
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutOptions, SamplingConfig  # noqa: E402
from opsd_rollout.deepspeed_engine import build_engine  # noqa: E402
from opsd_rollout.rollout.phases import zero3_coordinator  # noqa: E402

MANGLED = "_PartitionedParameterCoordinator__all_gather_params_"


def count_gathers(engine) -> list[int]:
    """Counts DeepSpeed's own all-gather launches (per-layer fetches, and GatheredParameters' all_gather),
    independently of the rollout's probes."""
    coordinator = zero3_coordinator(engine)
    first = next(engine.module.parameters())
    original, original_all_gather, gathers = getattr(coordinator, MANGLED), first.all_gather, []

    def counting(params, forward, quantize=False):
        if any(p.ds_status.name == "NOT_AVAILABLE" for p in params):
            gathers.append(1)
        return original(params, forward, quantize)

    def all_gather(param_list=None, **kwargs):
        if any(p.ds_status.name == "NOT_AVAILABLE" for p in (param_list or [first])):
            gathers.append(1)
        return original_all_gather(param_list=param_list, **kwargs)

    setattr(coordinator, MANGLED, counting)
    first.all_gather = all_gather
    return gathers


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = transition_model(chain_table(16, {7: 2}))
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    engine = build_engine(model, 3)
    prompts = [[5, 7], [6, 7]] if rank == 0 else [[9], [10, 11]]
    gathers = count_gathers(engine)
    results = {}
    for strategy, gather in (("generate", "per_layer"), ("static", "per_layer"), ("static", "once")):
        forwards.clear()
        gathers.clear()
        config = HybridEngineRolloutConfig(enable_profiling=True, strategy=strategy, zero3_gather=gather)
        rollout = HybridEngineRollout(engine, make_tokenizer(0, 2), config)
        batch = rollout.generate(left_padded(prompts, 0), SamplingConfig(max_new_tokens=6, temperature=0.0))
        results[f"{strategy}-{gather}"] = {
            "input_ids": batch.input_ids.tolist(), "attention_mask": batch.attention_mask.tolist(),
            "forwards": len(forwards), "gathers": len(gathers), "profile": rollout.get_last_profile().to_dict()}
    # the trimmed width, agreed across ranks: rank 0's rows stop at once, rank 1's after 12 and 10 of 14 tokens
    for strategy in ("static", "generate"):
        config = HybridEngineRolloutConfig(strategy=strategy, response_width="longest")
        longer = [[5, 7], [6, 7]] if rank == 0 else [[9], [10, 11]]
        batch = HybridEngineRollout(engine, make_tokenizer(0, 2), config).generate(
            left_padded(longer, 0), SamplingConfig(max_new_tokens=14, temperature=0.0))
        results[f"{strategy}-longest"] = {"input_ids": batch.input_ids.tolist(),
                                          "attention_mask": batch.attention_mask.tolist()}
    # 2 samples per prompt, each rank admitting on its own schedule (one slot, or every row at once): a rank whose
    # admitted rows need no prefill (their prompt is already held) still joins the others' prefill collectives
    for layout, gather, slots in (("shared", "per_layer", 1), ("shared", "once", None), ("copied", "per_layer", 1)):
        forwards.clear()
        config = HybridEngineRolloutConfig(enable_profiling=True, zero3_gather=gather, options=RolloutOptions(
            shared_prefix_min_prompt=1, shared_prefix=layout == "shared"))
        rollout = HybridEngineRollout(engine, make_tokenizer(0, 2), config)
        batch = rollout.generate(left_padded(prompts, 0), SamplingConfig(
            max_new_tokens=6, temperature=0.0, n_samples_per_prompt=2, continuous_batch_size=slots))
        results[f"{layout}-{gather}-{slots}"] = {"input_ids": batch.input_ids.tolist(), "forwards": len(forwards),
                                                 "profile": rollout.get_last_profile().to_dict()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1])
