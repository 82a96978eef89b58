"""Long-tailed rollouts: rows that finish leave the decode batch (compaction) and pending prompts take their
slots (continuous batching), and the returned batch is exactly the plain path's: same rows, order, trimming,
padding and masks; greedy tokens equal transformers' generate; sampled tokens do not depend on scheduling."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import (TINY_PRESETS, rollout_engine, assert_batch_contract, chain_table, left_padded, make_tokenizer,
                      prompts_with_padding_and_holes, reference_rollout, transition_model)
from opsd_rollout import SamplingConfig
from opsd_rollout.models import PAD_ID, byte_tokenizer
from opsd_rollout.rollout.scheduler import batch_buckets

MODES = {"plain": dict(compact_rows=False), "compacted": dict(compact_rows=True)}
SLOTS = [None, 1, 2, 5]


def rollout(model, tokenizer, **config):
    return rollout_engine(model, tokenizer, enable_profiling=True, **config)


def eos_that_stops_some_rows(model, request, n):
    """A token greedy decoding produces early in some rows and late or never in others: as EOS it gives rows
    of very different lengths on a random-weight model."""
    ids, _ = reference_rollout(model, request, n=n, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[])
    return int(ids[0, request.prompt_ids.shape[1] + 2])


@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("n", [1, 3])
def test_every_mode_returns_the_plain_batch_and_generates_greedy_tokens(tiny_models, name, n):
    model = copy.deepcopy(tiny_models[name])
    request = prompts_with_padding_and_holes(byte_tokenizer())
    eos = eos_that_stops_some_rows(model, request, n)
    tokenizer = make_tokenizer(PAD_ID, eos)
    model.generation_config.eos_token_id = None
    expected_ids, expected_mask = reference_rollout(model, request, n=n, max_new_tokens=12, pad_token_id=PAD_ID,
                                                    eos_ids=[eos])
    for mode, config in MODES.items():
        for slots in SLOTS:
            got = rollout(model, tokenizer, **config).generate(
                request, SamplingConfig(max_new_tokens=12, n_samples_per_prompt=n, temperature=0,
                                        continuous_batch_size=slots))
            assert torch.equal(got.input_ids, expected_ids), (mode, slots)
            assert torch.equal(got.attention_mask, expected_mask), (mode, slots)
            assert_batch_contract(got, request, n=n, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[eos])


def sampled(slots, n=4, **kwargs):
    return SamplingConfig(max_new_tokens=10, n_samples_per_prompt=n, temperature=1.0, top_k=6, top_p=0.95,
                          continuous_batch_size=slots, **kwargs)


def soft_transition_model():
    """Next-token logits are exact (one-hot embeddings, no attention output), so they do not depend on which
    rows share a batch; soft enough (sharpness 3) that sampling has real choices; token 2 is EOS."""
    return transition_model(chain_table(24, {5: 2, 9: 2, 13: 2}), eos_token_id=2, sharpness=3.0)


def test_sampled_tokens_do_not_depend_on_scheduling():
    model, tokenizer = soft_transition_model(), make_tokenizer(0, 2)
    request = left_padded([[4, 5], [8], [12, 13, 14], [3]], 0)
    batches = {(mode, slots): rollout(model, tokenizer, seed=7, **config).generate(request, sampled(slots))
               for mode, config in MODES.items() for slots in [None, 1, 3, 16]}
    first = next(iter(batches.values()))
    lengths = first.attention_mask[:, request.prompt_ids.shape[1]:].sum(dim=1)
    assert len(set(lengths.tolist())) > 2, "rows of different lengths, or nothing was scheduled"
    for key, batch in batches.items():
        assert torch.equal(batch.input_ids, first.input_ids), key
        assert torch.equal(batch.attention_mask, first.attention_mask), key


def test_the_same_seed_repeats_and_the_next_call_differs():
    model, tokenizer = soft_transition_model(), make_tokenizer(0, 2)
    request = left_padded([[4, 5], [8]], 0)
    a, b = rollout(model, tokenizer, seed=3), rollout(model, tokenizer, seed=3)
    first_a, first_b = a.generate(request, sampled(None)), b.generate(request, sampled(2))
    assert torch.equal(first_a.input_ids, first_b.input_ids)
    assert not torch.equal(a.generate(request, sampled(None)).input_ids, first_a.input_ids)


def test_finished_rows_leave_the_batch_in_size_buckets_and_utilisation_counts_what_was_computed():
    """Rows per decode forward, spied: they shrink to buckets as rows finish, and the profile's row-steps are
    exactly the rows' first tokens plus those rows, its utilisation the real tokens over them."""
    from opsd_rollout.rollout.decode.loop import decode_one_token

    model, tokenizer = soft_transition_model(), make_tokenizer(0, 2)
    request = left_padded([[4, 5], [8], [12, 13, 14], [3], [7], [11], [16], [20]], 0)
    sizes = []

    def spy(model, token, *args, **kwargs):
        sizes.append(token.shape[0])
        return decode_one_token(model, token, *args, **kwargs)

    engine = rollout(model, tokenizer, seed=5)
    engine.strategy.decode_step = spy
    batch = engine.generate(request, sampled(None, n=2))
    profile = engine.get_last_profile()
    rows = 16
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < rows, sizes
    assert set(sizes) <= set(batch_buckets(rows)), sizes
    assert profile.compactions == len(set(sizes)) - 1 and profile.compaction_ms is not None
    assert profile.row_steps == rows + sum(sizes)
    assert profile.decode_steps == len(sizes)
    assert profile.live_row_utilisation == pytest.approx(profile.generated_tokens / (rows + sum(sizes)))
    lengths = batch.attention_mask[:, request.prompt_ids.shape[1]:].sum(dim=1)
    assert profile.generated_tokens == int(lengths.sum())


def test_continuous_batching_holds_at_most_its_slots_and_prefills_each_prompt_once(monkeypatch):
    from opsd_rollout.rollout.decode import loop as loop_module

    model, tokenizer = soft_transition_model(), make_tokenizer(0, 2)
    request = left_padded([[4, 5], [8], [12, 13, 14], [3], [7], [11]], 0)
    decode_rows, prefill_rows = [], []
    original_decode, original_prefill = loop_module.decode_one_token, loop_module.prefill

    def spy_decode(model, token, *args, **kwargs):
        decode_rows.append(token.shape[0])
        return original_decode(model, token, *args, **kwargs)

    def spy_prefill(model, ids, *args):
        prefill_rows.append(ids.shape[0])
        return original_prefill(model, ids, *args)

    monkeypatch.setattr(loop_module, "prefill", spy_prefill)
    engine = rollout(model, tokenizer, seed=2)
    engine.strategy.decode_step = spy_decode
    batch = engine.generate(request, sampled(4, n=3))
    profile = engine.get_last_profile()
    assert max(decode_rows) <= 4 and profile.decode_slots == 4
    assert sum(prefill_rows) == 6, "each of the 6 prompts prefilled once, for its 3 samples"
    assert profile.admission_rounds >= len(prefill_rows) - 1 > 0  # some rounds copy a sibling's prompt: no prefill
    assert profile.prefill_forwards == len(prefill_rows)
    assert batch.input_ids.shape[0] == 18
    assert profile.row_latency_p50_ms <= profile.row_latency_p95_ms <= profile.row_latency_max_ms <= profile.total_ms


def test_a_kv_budget_chooses_the_slots(tiny_models, tokenizer):
    """kv_budget_bytes bounds the decode cache: the rollout runs continuously within it, same rows."""
    from opsd_rollout.modeling import ModelSpec

    model = tiny_models["qwen2-tiny"]
    request = prompts_with_padding_and_holes(tokenizer)
    sampling = SamplingConfig(max_new_tokens=6, n_samples_per_prompt=2, temperature=0)
    per_row = ModelSpec.of(model).kv.bytes_per_token(4) * (request.prompt_ids.shape[1] + 6)
    expected = rollout(model, tokenizer).generate(request, sampling).input_ids
    budgeted = rollout(model, tokenizer, kv_budget_bytes=int(2.5 * per_row))
    assert torch.equal(budgeted.generate(request, sampling).input_ids, expected)
    assert budgeted.get_last_profile().decode_slots == 2
    with pytest.raises(ValueError, match="kv_budget_bytes .* holds no row"):
        rollout(model, tokenizer, kv_budget_bytes=per_row - 1).generate(request, sampling)


def test_length_models_parse_and_their_hazards_give_their_distribution():
    from opsd_rollout.bench.lengths import LengthModel

    model = LengthModel.parse("lognormal:median=48,sigma=1.0")
    assert model.spec == "lognormal:median=48,sigma=1" and model.synthetic
    mass = model.probabilities(512)
    assert sum(mass) == pytest.approx(1.0) and max(range(512), key=mass.__getitem__) < 48  # mode below median
    survive, rebuilt = 1.0, []
    for hazard in model.hazards(512):
        rebuilt.append(survive * hazard)
        survive *= 1 - hazard
    rebuilt[-1] += survive
    assert rebuilt == pytest.approx(mass, abs=1e-9)
    assert LengthModel.parse("geometric:mean=64").probabilities(4)[0] == pytest.approx(1 / 64)
    assert LengthModel.parse("uniform:low=2,high=5").probabilities(8) == pytest.approx([0, .25, .25, .25, .25, 0, 0, 0])
    assert LengthModel.parse("uniform:low=2,high=20").probabilities(4)[-1] == pytest.approx(17 / 19)  # capped
    assert not LengthModel.parse("fixed").synthetic and not LengthModel.parse("natural").synthetic
    for bad in ("uniform:max=3", "uniform:low=5,high=2", "uniform:low=1.5,high=3", "lognormal:median=48", "geometric:mean=-1", "geometric:mean=x"):
        with pytest.raises(ValueError, match="response lengths"):
            LengthModel.parse(bad)


def test_forced_lengths_follow_the_distribution_and_are_the_same_on_every_engine():
    """Greedy rows force the same lengths in our loop (every schedule) and in transformers' generate (same
    content, same coins); sampled rows' lengths fit the distribution (chi-square)."""
    from conftest import assert_chi_square_fit
    from opsd_rollout.bench.lengths import LengthModel

    model, tokenizer = soft_transition_model(), make_tokenizer(0, 2)
    model.lm_head.weight.data[2] = -100.0  # the model itself never ends a row: only the forcing does
    request = left_padded([[4, 5], [8], [12, 13, 14], [3], [7], [11], [16], [20]], 0)
    spec, cap = "geometric:mean=6", 16

    def lengths(batch):
        return batch.attention_mask[:, int(batch.response_start_idx[0]):].sum(dim=1)

    greedy = SamplingConfig(max_new_tokens=cap, n_samples_per_prompt=2, temperature=0)
    runs = [rollout(model, tokenizer, response_lengths=spec, strategy=strategy).generate(
        request, SamplingConfig(**{**vars(greedy), "continuous_batch_size": slots}))
            for strategy, slots in (("static", None), ("static", 3), ("generate", None))]
    assert len(set(lengths(runs[0]).tolist())) > 2
    for run in runs[1:]:
        assert torch.equal(run.input_ids, runs[0].input_ids)
    many = left_padded([[3 + i % 20, 4 + i % 7] for i in range(60)], 0)
    batch = rollout(model, tokenizer, response_lengths=spec, seed=4).generate(
        many, SamplingConfig(max_new_tokens=cap, n_samples_per_prompt=25, temperature=1.0))
    counts = torch.bincount(lengths(batch), minlength=cap + 1)[1:].double()
    assert_chi_square_fit(counts, torch.tensor(LengthModel.parse(spec).probabilities(cap), dtype=torch.float64))


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_rows_that_finished_step_on_to_the_next_check_without_leaving_the_cache(tiny_models, shared_prefix):
    """Checks every 3 steps over the whole cache (as a compiled step sees it), one slot at a time: rows that all started
    together reach the cache's last column, finish, and step on until the check retires them. They keep writing
    that column (an IndexError before); the tokens are generate's."""
    model = tiny_models["llama-tiny"]
    request = left_padded([[5, 6, 7, 8], [9, 10, 11, 12]], PAD_ID)
    expected, _ = reference_rollout(model, request, n=3, max_new_tokens=4, pad_token_id=PAD_ID, eos_ids=[])
    engine = rollout(model, make_tokenizer(PAD_ID, None), whole_cache=True, stop_check_interval=3, ignore_eos=True,
                     shared_prefix=shared_prefix, shared_prefix_min_prompt=1)
    for slots in (1, 2):
        got = engine.generate(request, SamplingConfig(max_new_tokens=4, n_samples_per_prompt=3, temperature=0,
                                                      continuous_batch_size=slots))
        assert torch.equal(got.input_ids, expected), slots
