"""Sampling primitives: the inverse-CDF draw, and top-k/top-p filtering equal to transformers' warpers on
both paths (k candidates on CPU, whole vocabulary otherwise), ties with the k-th logit included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import assert_chi_square_fit
from opsd_rollout.rollout.counter_rng import rollout_key, uniforms
from opsd_rollout.rollout.sampling import _tied_candidates, _top_k_candidates, draw, sample


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Every kept index drawn, none other, in proportions that fit ``probs``."""
    assert (counts > 0).sum() == (probs > 0).sum(), "not every kept index was drawn"
    assert_chi_square_fit(counts, probs)


def counter_uniforms(rows: int, seed: int = 0) -> torch.Tensor:
    """[rows, 1] uniforms from the rollout's counter-based generator: rows 0.. at step 0."""
    return uniforms(rollout_key(seed, 0), torch.arange(rows), torch.zeros(rows, dtype=torch.int64))


def test_counter_uniforms_are_uniform_and_depend_on_seed_row_and_step_only():
    u = counter_uniforms(20000).squeeze(1)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert_chi_square_fit(torch.histc(u, bins=50, min=0, max=1).double(), torch.ones(50))
    rows, steps = torch.tensor([3, 7, 3, 9]), torch.tensor([0, 4, 0, 2])
    key = rollout_key(11, 2)
    assert torch.equal(uniforms(key, rows, steps)[0], uniforms(key, rows, steps)[2])  # same row and step
    assert torch.equal(uniforms(key, rows[[3, 0]], steps[[3, 0]]), uniforms(key, rows, steps)[[3, 0]])  # any order
    assert not torch.equal(uniforms(rollout_key(12, 2), rows, steps), uniforms(key, rows, steps))
    assert not torch.equal(uniforms(rollout_key(11, 3), rows, steps), uniforms(key, rows, steps))  # next call
    single = uniforms(key, rows, steps, torch.float32)
    assert single.dtype == torch.float32 and 0 <= single.min() and single.max() < 1


def test_draw_follows_unnormalized_probabilities_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.0])  # zeros first, inside and last
    picks = draw(probs.expand(20000, -1), counter_uniforms(20000))
    assert_follows(torch.bincount(picks, minlength=probs.numel()).double(), probs)
    one = torch.tensor([[0.0, 0.0, 1e-30, 0.0]])  # a single tiny mass still wins every draw
    assert draw(one.expand(100, -1), counter_uniforms(100)).eq(2).all()
    broken = torch.tensor([[float("nan")] * 4, [0.0] * 4])  # no distribution: still an index, never V
    assert draw(broken, counter_uniforms(2)).lt(4).all()


def transformers_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)[0]


TIED = slice(3, 9)


def pool_ties(values: torch.Tensor) -> torch.Tensor:
    """Which tied tokens top-p keeps is up to the sort's order among ties: compare the tied group's total."""
    return torch.cat([values[:TIED.start], values[TIED].sum().reshape(1), values[TIED.stop:]])


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (4, 0.99), (0, 0.9), (8, 0.8), (2, 1.0), (9, 0.9)])
def test_sampling_equals_transformers_warpers_with_ties_at_the_kth_logit(top_k, top_p):
    """Logits 5, 4, 3 and six tied at 2 (the 4th largest), then lower ones: transformers' top-k keeps all
    six ties, so must we (they join the CPU path's candidates; with k = 9 top-p cuts through them)."""
    logits = torch.tensor([[5.0, 4.0, 3.0] + [2.0] * 6 + [1.0, 0.5, 0.0, -1.0] * 4])
    temperature = 0.9
    candidates = _top_k_candidates(logits, temperature, top_k)
    assert (candidates is None) == (top_k == 0)
    if top_k in (4, 8):
        assert torch.isfinite(candidates[0]).sum() == 9, "all six ties are candidates"
    probs = transformers_probs(logits, temperature, top_k, top_p)
    plan = SimpleNamespace(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p)
    picks = sample(logits.expand(10000, -1), plan, counter_uniforms(10000, seed=5))
    counts = torch.bincount(picks, minlength=logits.shape[1]).double()
    assert (counts[TIED] > 0).sum() == (probs[TIED] > 0).sum(), "a different number of tied tokens kept"
    assert_follows(pool_ties(counts), pool_ties(probs))


def test_bf16_logits_with_rows_of_different_tie_counts_keep_each_rows_ties():
    """bf16 logits tie often; each row keeps its own k-th's ties and nothing below its k-th."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0], [3.0, 2.5, 2.0, 1.0, 1.0, 0.0]], dtype=torch.bfloat16)
    values, ids = _top_k_candidates(logits, 1.0, 2)
    kept = [sorted(i for v, i in zip(vs, row) if v > float("-inf")) for vs, row in zip(values.tolist(), ids.tolist())]
    assert kept == [[0, 1, 2, 3], [0, 1]]
    plan = SimpleNamespace(greedy=False, temperature=1.0, top_k=2, top_p=1.0)
    picks = sample(logits.repeat_interleave(3000, dim=0), plan, counter_uniforms(6000))
    for row in range(2):
        counts = torch.bincount(picks.view(2, 3000)[row], minlength=6).double()
        assert_follows(counts, transformers_probs(logits[row:row + 1].float(), 1.0, 2, 1.0))


def test_candidate_path_equals_transformers_without_ties():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(1)) * 3
    for top_k, top_p in [(10, 1.0), (40, 0.9)]:
        assert _top_k_candidates(logits, 1.2, top_k)[1].shape == (1, top_k)
        probs = transformers_probs(logits, 1.2, top_k, top_p)
        plan = SimpleNamespace(greedy=False, temperature=1.2, top_k=top_k, top_p=top_p)
        picks = sample(logits.expand(10000, -1), plan, counter_uniforms(10000, seed=top_k))
        assert_follows(torch.bincount(picks, minlength=logits.shape[1]).double(), probs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_candidates_equal_the_whole_vocabularys(dtype):
    """The k + 1 largest raw logits, scaled alone, give the candidates that scaling and counting ties over the whole
    vocabulary gives: fp32 rows without ties take the one pass, bf16 rows (ties everywhere) the counted path."""
    generator = torch.Generator().manual_seed(7)
    logits = (torch.randn(16, 5000, generator=generator) * 4).to(dtype)
    for temperature, top_k in [(1.0, 50), (0.7, 1), (1.3, 10)]:
        got = _top_k_candidates(logits, temperature, top_k)
        expected = _tied_candidates(logits.float() / temperature, top_k)
        width = got[0].shape[1]
        assert width >= top_k and (width == top_k) == (dtype == torch.float32)
        assert torch.equal(got[1], expected[1][:, :width]) and torch.equal(got[0], expected[0][:, :width])
        assert torch.isinf(expected[0][:, width:]).all()



@pytest.mark.parametrize("strategy", ["static", "generate"])
def test_a_calls_own_seed_gives_its_samples_whatever_came_before_and_leaves_torchs_generators(strategy, tiny_models,
                                                                                             tokenizer):
    """``generate(..., seed=)``: the samples are a function of the seed alone (a resumed trainer repeats them), not
    of the calls before nor of the rollout's own seed, and torch's generators are as they were."""
    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig

    model = tiny_models["llama-tiny"]
    enc = tokenizer(["Distil this:", "Hi"], padding=True, return_tensors="pt")
    request = RolloutRequest(enc.input_ids, enc.attention_mask)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, n_samples_per_prompt=3)
    first = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy=strategy))
    expected = first.generate(request, sampling, seed=123).input_ids
    other = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy=strategy, seed=9))
    other.generate(request, sampling)  # calls before change nothing
    state = torch.random.get_rng_state()
    assert torch.equal(other.generate(request, sampling, seed=123).input_ids, expected)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not torch.equal(other.generate(request, sampling, seed=124).input_ids, expected)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        other.generate(request, sampling, seed=-1)
