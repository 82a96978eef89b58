"""Two CPU ranks under ZeRO-3 (gloo, torchrun): ranks that finish at different steps do not hang, run the
same number of forwards, and each returns its own padded batch, as wide as every other rank's; and an optimizer
step's gradient norm across two ranks at ZeRO-0 and ZeRO-2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import clean_env, run_named
from opsd_rollout.distributed import free_port

HERE = Path(__file__).parent


def run_two_ranks(worker: str, out: Path) -> list[dict]:
    env = {**clean_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), str(HERE / "multirank" / worker), str(out)]
    result = run_named(f"two ZeRO-3 ranks running {worker} (about 10 s on 2 quiet cores)", command, env=env,
                       timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_zero3_ranks_finishing_at_different_steps(tmp_path):
    ranks = run_two_ranks("rollout_worker.py", tmp_path)
    for variant in ("generate-per_layer", "static-per_layer", "static-once"):
        rank0, rank1 = ranks[0][variant], ranks[1][variant]
        # rank 0 stopped at its first token: padding to DeepSpeed's width, max_new_tokens columns
        assert [row[2:] for row in rank0["input_ids"]] == [[2] + [0] * 5] * 2, variant
        assert [row[2:] for row in rank0["attention_mask"]] == [[1] + [0] * 5] * 2, variant
        # rank 1 ran the full budget
        assert [row[2:] for row in rank1["input_ids"]] == [[10, 11, 12, 13, 14, 15], [12, 13, 14, 15, 3, 4]], variant
        # lockstep: both ranks ran as many forwards as the longest rank needed
        assert rank0["forwards"] == rank1["forwards"] == 6, variant
        # each rank's profile attributes its ZeRO-3 gathers, counted as DeepSpeed launched them
        for rank in (rank0, rank1):
            profile = rank["profile"]
            assert profile["world_size"] == 2 and profile["zero_stage"] == 3
            assert profile["param_gather_ms"] > 0 and profile["param_gather_count"] == rank["gathers"] > 0, variant
            assert profile["param_gather_bytes"] > 0
        assert {rank0["profile"]["rank"], rank1["profile"]["rank"]} == {0, 1}
    # two samples per prompt: the same rows, each twice; ranks in lockstep whatever their admission schedules
    for variant, layout in (("shared-per_layer-1", "shared_prefix"), ("shared-once-None", "shared_prefix"),
                            ("copied-per_layer-1", "copied")):
        rank0, rank1 = ranks[0][variant], ranks[1][variant]
        assert [row[2:] for row in rank0["input_ids"]] == [[2] + [0] * 5] * 4, variant
        assert [row[2:] for row in rank1["input_ids"]] == [[10, 11, 12, 13, 14, 15]] * 2 + [
            [12, 13, 14, 15, 3, 4]] * 2, variant
        assert rank0["forwards"] == rank1["forwards"], variant
        assert rank0["profile"]["kv_layout"] == rank1["profile"]["kv_layout"] == layout, variant
    # the trimmed width is the widest rank's: rank 0's rows end at 1 token, rank 1's at 12 and 10 of 14
    for strategy in ("static", "generate"):
        rank0, rank1 = ranks[0][f"{strategy}-longest"], ranks[1][f"{strategy}-longest"]
        assert [len(row) for row in rank0["input_ids"]] == [len(row) for row in rank1["input_ids"]] == [2 + 12] * 2
        assert [sum(row[2:]) for row in rank0["attention_mask"]] == [1, 1], strategy
        assert [sum(row[2:]) for row in rank1["attention_mask"]] == [12, 10], strategy
    # gathering once never moves more than per-layer gathering (on this one-layer model DeepSpeed keeps
    # everything live anyway; benchmarks/RESULTS.md has the large difference on llama-small)
    for rank in ranks:
        once, per_layer = rank["static-once"]["profile"], rank["static-per_layer"]["profile"]
        assert once["param_gather_bytes"] <= per_layer["param_gather_bytes"], (once, per_layer)


@pytest.mark.slow
def test_zero3_ranks_with_different_length_distributions_and_schedules_stay_in_lockstep(tmp_path):
    """Rank 0 compacts and admits pending rows round after round (continuous batching, short long-tailed rows);
    rank 1 runs two rows to the cap and never admits. No hang; both run the same decode steps (and, where
    forwards gather parameters collectively, the same forwards: rank 1 joins rank 0's admission prefills); each
    rank's batch is the one its rows give alone on an unpartitioned copy of the model."""
    ranks = run_two_ranks("continuous_worker.py", tmp_path)
    for variant in ranks[0]:
        rank0, rank1 = ranks[0][variant], ranks[1][variant]
        assert rank0["decode_forwards"] == rank1["decode_forwards"] >= 7, variant
        if "per-layer" in variant:
            assert rank0["forwards"] == rank1["forwards"], variant
        for rank in (rank0, rank1):
            assert rank["input_ids"] == rank["reference_ids"], variant
        assert len(rank0["input_ids"]) == 12 and len(rank1["input_ids"]) == 2
        assert [sum(row[2:]) for row in rank1["attention_mask"]] == [8, 8], variant
    # greedy on rank 0: each row ends where its chain reaches 7 (then EOS), the last at the cap
    lengths = [sum(row[2:]) for row in ranks[0]["continuous-greedy"]["attention_mask"]]
    assert lengths == [2, 2, 4, 4, 4, 4, 2, 2, 3, 3, 8, 8]


@pytest.mark.slow
def test_a_zero3_teacher_stays_in_lockstep_and_caches_what_a_replicated_teacher_does(tmp_path):
    """Ranks with different rows and response widths run different numbers of teacher micro-batches and head
    chunks of their own; the partitioned teacher still answers (no hang) with the replicated teacher's cache, in
    every mode, each rank holding about half of its parameters."""
    ranks = run_two_ranks("teacher_worker.py", tmp_path)
    for rank in ranks:
        for mode in ("full", "topk", "sampled"):
            assert rank[mode]["max_difference"] < 1e-5 and rank[mode]["indices_equal"], (rank["rank"], mode, rank[mode])
        assert rank["parameter_bytes"] <= 0.55 * rank["replicated_bytes"]
    # the cache covers the columns holding tokens: rank 1's one row ended a column early
    assert ranks[0]["sampled"]["shape"] == [5, 3] and ranks[1]["sampled"]["shape"] == [1, 10]
    assert ranks[0]["sampled"]["bytes"] == 4 * 5 * 3


@pytest.mark.slow
def test_the_gradient_norm_at_zero0_is_every_ranks_averaged_gradients(tmp_path):
    """Ranks with different rows: the norm taken before the step at ZeRO-0 is the norm of the gradient averaged over
    the ranks (the same on both), equal to DeepSpeed's own at ZeRO-2, which partitions the gradients."""
    ranks = run_two_ranks("grad_norm_worker.py", tmp_path)
    assert ranks[0]["zero0"] == pytest.approx(ranks[1]["zero0"], rel=1e-6)
    assert ranks[0]["zero0"] == pytest.approx(ranks[0]["zero2"], rel=1e-4) and ranks[0]["zero0"] > 1e-4
