"""Shared-prefix attention: each prompt's keys/values stored once for its n samples. The attention it computes
(prefix part + suffix part merged by log-sum-exp) against the plain formula; greedy tokens against transformers'
generate in every mode (padded prompts with holes, GQA, eager and SDPA, compaction, continuous batching with
prefix slots reused); logits against the copied layout's; when it is used, what it reports, what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import (TINY_PRESETS, rollout_engine, assert_batch_contract, left_padded, make_tokenizer, prompts_with_padding_and_holes,
                      reference_rollout)
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutOptions, SamplingConfig
from opsd_rollout.modeling import ModelSpec
from opsd_rollout.models import EOS_ID, PAD_ID
from opsd_rollout.rollout.shared_prefix import (additive_mask, matmul_attention, merge, partial_attention,
                                                slots_within)

SHARED = dict(shared_prefix=True, shared_prefix_min_prompt=1)


def rollout(model, tokenizer, **config):
    return rollout_engine(model, tokenizer, enable_profiling=True, **config)


def greedy(n, max_new_tokens=8, **kwargs):
    return SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n, temperature=0, **kwargs)


# ---- the attention itself --------------------------------------------------------------------------------------


def reference_attention(q, k, v, visible, scale):
    """Plain softmax attention in float64: q [.., M, D], k/v [.., N, D], visible [.., M, N] or broadcastable."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1) @ v.double()


@pytest.mark.parametrize("attention", [partial_attention, matmul_attention], ids=["fused_on_cpu", "matmul"])
def test_two_partial_attentions_merged_equal_attention_over_both_key_sets(attention):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, 8, generator=generator)  # [rows, heads, queries, dim]
    k, v = torch.randn(3, 2, 6, 8, generator=generator), torch.randn(3, 2, 6, 8, generator=generator)
    k2, v2 = torch.randn(3, 2, 5, 8, generator=generator), torch.randn(3, 2, 5, 8, generator=generator)
    visible = torch.rand(3, 1, 1, 6, generator=generator) > 0.4
    visible[..., 0] = True  # every row sees some position of each part
    visible2 = torch.rand(3, 1, 1, 5, generator=generator) > 0.3
    visible2[..., -1] = True
    out_a, lse_a = attention(q, k, v, additive_mask(visible, torch.float32), 0.3)
    out_b, lse_b = attention(q, k2, v2, additive_mask(visible2, torch.float32), 0.3)
    expected = reference_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2),
                                   torch.cat([visible, visible2], -1), 0.3)
    torch.testing.assert_close(merge(out_a, lse_a, out_b, lse_b).double(), expected, rtol=1e-5, atol=1e-6)
    # the log-sum-exp is the scaled scores' own
    scores = ((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(lse_a, torch.logsumexp(scores, -1))


@pytest.mark.parametrize("attention", [partial_attention, matmul_attention], ids=["fused_on_cpu", "matmul"])
def test_a_part_that_sees_nothing_stays_finite_and_bf16_merges_in_float32(attention):
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    out, lse = attention(q, k, v, additive_mask(torch.zeros(1, 1, 1, 3, dtype=torch.bool), torch.float32), 1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    out16, lse16 = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 1.0)
    assert out16.dtype == torch.bfloat16 and lse16.dtype == torch.float32
    assert merge(out16, lse16, out16, lse16).dtype == torch.float32


# ---- greedy tokens equal generate -------------------------------------------------------------------------------


def eos_that_stops_some_rows(model, request, n):
    """A token greedy decoding produces early in some rows and late or never in others (as in test_continuous)."""
    ids, _ = reference_rollout(model, request, n=n, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[])
    return int(ids[0, request.prompt_ids.shape[1] + 2])


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_greedy_equals_generate_in_every_mode(tiny_models, tokenizer, name):
    """Padded prompts with a hole, n=3, rows ending at different EOS steps: the plain batch, compaction, and
    continuous batching (prefix slots reused as prompts finish; 1, 2 and 5 slots on Llama) return generate's."""
    model = copy.deepcopy(tiny_models[name])
    request = prompts_with_padding_and_holes(tokenizer)
    eos = eos_that_stops_some_rows(model, request, 3)
    model.generation_config.eos_token_id = None
    expected_ids, expected_mask = reference_rollout(model, request, n=3, max_new_tokens=12, pad_token_id=PAD_ID,
                                                    eos_ids=[eos])
    modes = [(False, None), (True, None), (True, 2)] + ([(True, 1), (False, 5)] if name == "llama-tiny" else [])
    for compact, slots in modes:
        engine = rollout(model, make_tokenizer(PAD_ID, eos), compact_rows=compact, **SHARED)
        got = engine.generate(request, greedy(3, 12, continuous_batch_size=slots))
        assert engine.get_last_profile().kv_layout == "shared_prefix"
        assert torch.equal(got.input_ids, expected_ids), (compact, slots)
        assert torch.equal(got.attention_mask, expected_mask), (compact, slots)
    assert_batch_contract(got, request, n=3, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[eos])


def test_the_prefix_part_reads_only_the_prompts_still_decoding(tiny_models, tokenizer, monkeypatch):
    """Once every row of a prompt has finished, decode steps stop reading its keys/values: a compaction moves the
    prompts with a live row to the store's first slots, and continuous batching reuses the lowest free slots and
    reads up to the last one in use. The tokens stay generate's."""
    from opsd_rollout.rollout.shared_prefix import SharedPrefix

    model = copy.deepcopy(tiny_models["llama-tiny"])
    request = prompts_with_padding_and_holes(tokenizer)
    prompts = request.prompt_ids.shape[0]
    eos = eos_that_stops_some_rows(model, request, 3)  # prompt 0's three (greedy, equal) samples stop early
    model.generation_config.eos_token_id = None
    expected, _ = reference_rollout(model, request, n=3, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[eos])
    read: list[tuple[int, int]] = []
    original = SharedPrefix._prefix_part

    def spy(self, layer, q, scale):
        read.append((self.groups, self.store.slots))
        return original(self, layer, q, scale)

    monkeypatch.setattr(SharedPrefix, "_prefix_part", spy)
    engine = rollout(model, make_tokenizer(PAD_ID, eos), **SHARED)
    for slots in (None, 2):
        read.clear()
        got = engine.generate(request, greedy(3, 12, continuous_batch_size=slots))
        assert torch.equal(got.input_ids, expected), slots
        if slots is None:  # every prompt at first, fewer after the compaction
            assert read[0] == (prompts, prompts) and engine.get_last_profile().compactions >= 1
            assert read[-1][0] < prompts, read
        else:  # 2 decode slots hold rows of at most 2 prompts: the store's third slot is never read
            assert read[0][1] == 3 and max(groups for groups, _ in read) == 2, read


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("whole_cache", [False, True])
def test_eager_attention_and_whole_cache_steps_equal_generate(tiny_models, tokenizer, name, whole_cache):
    model = copy.deepcopy(tiny_models[name])
    model.set_attn_implementation("eager")
    engine = rollout(model, tokenizer, whole_cache=whole_cache, **SHARED)
    seen = set()  # the attention implementation every forward ran under
    model.register_forward_pre_hook(lambda module, args: seen.add(module.config._attn_implementation))
    for request in (prompts_with_padding_and_holes(tokenizer), left_padded([[70, 71, 72, 73], [80, 81, 82, 83]], 0)):
        batch = engine.generate(request, greedy(2))
        ref_ids, _ = reference_rollout(model, request, n=2, max_new_tokens=8, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
        assert torch.equal(batch.input_ids, ref_ids)
        assert engine.get_last_profile().kv_layout == "shared_prefix"
    # selected once, when the rollout was built: no call changes the model's config
    assert seen == {model.config._attn_implementation} == {"opsd_shared_prefix:eager"}


def test_the_matmul_path_other_devices_take_equals_generate(tiny_models, tokenizer, monkeypatch):
    """Off the CPU the two parts are plain matmuls: the same tokens, here forced on the CPU."""
    from opsd_rollout.rollout import shared_prefix

    monkeypatch.setattr(shared_prefix, "_FUSED_CPU", None)
    model = tiny_models["qwen2-tiny"]
    request = prompts_with_padding_and_holes(tokenizer)
    ref_ids, _ = reference_rollout(model, request, n=3, max_new_tokens=8, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    for slots in (None, 4):
        batch = rollout(model, tokenizer, **SHARED).generate(request, greedy(3, continuous_batch_size=slots))
        assert torch.equal(batch.input_ids, ref_ids), slots


# ---- logits and sampling equal the copied layout's ----------------------------------------------------------------


def decode_logits(model, tokenizer, request, sampling, **config):
    """Every decode step's logits (eager steps, compaction off so the rows stay in place)."""
    from opsd_rollout.rollout.decode.loop import decode_one_token

    engine = rollout(model, tokenizer, compact_rows=False, **config)
    seen = []

    def spy(*args, **kwargs):
        logits = decode_one_token(*args, **kwargs)
        seen.append(logits.float().clone())
        return logits

    engine.strategy.decode_step = spy
    batch = engine.generate(request, sampling)
    return batch, torch.stack(seen), engine.get_last_profile()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_logits_equal_the_copied_layouts_within_the_dtypes_tolerance(tiny_models, tokenizer, dtype, tolerance):
    model = copy.deepcopy(tiny_models["qwen2-tiny"]).to(dtype)
    request = prompts_with_padding_and_holes(tokenizer)
    sampling = greedy(4, 6)
    copied, copied_logits, copied_profile = decode_logits(model, tokenizer, request, sampling, shared_prefix=False)
    shared, shared_logits, shared_profile = decode_logits(model, tokenizer, request, sampling, **SHARED)
    assert (copied_profile.kv_layout, shared_profile.kv_layout) == ("copied", "shared_prefix")
    scale = copied_logits.abs().max()
    torch.testing.assert_close(shared_logits, copied_logits, rtol=0, atol=tolerance * scale)
    if dtype == torch.float32:
        assert torch.equal(shared.input_ids, copied.input_ids)


def test_sampled_tokens_equal_the_copied_layouts_and_do_not_depend_on_scheduling(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]
    request = prompts_with_padding_and_holes(tokenizer)
    sampling = dict(max_new_tokens=8, n_samples_per_prompt=4, temperature=1.0, top_k=40, top_p=0.95)
    expected = rollout(model, tokenizer, seed=11, shared_prefix=False).generate(
        request, SamplingConfig(**sampling)).input_ids
    assert len({tuple(row) for row in expected[:4].tolist()}) > 1, "samples of one prompt differ"
    for slots in (None, 3):
        got = rollout(model, tokenizer, seed=11, **SHARED).generate(
            request, SamplingConfig(**sampling, continuous_batch_size=slots)).input_ids
        assert torch.equal(got, expected), slots


# ---- the layout: what it stores, when it is used ----------------------------------------------------------------


def test_each_prompt_is_stored_once_and_the_profile_counts_the_bytes(tiny_models, tokenizer):
    """Fresh workspaces: shared = B prompts x P + B*n rows x R positions; copied = B*n x (P + R) plus the shared
    prefill's B x P. Each prompt prefilled once either way."""
    model = tiny_models["llama-tiny"]
    per_position = ModelSpec.of(model).kv.bytes_per_token(4)
    request = prompts_with_padding_and_holes(tokenizer)
    (B, P), n, R = request.prompt_ids.shape, 4, 8
    shared, copied = rollout(model, tokenizer, **SHARED), rollout(model, tokenizer, shared_prefix=False)
    shared.generate(request, greedy(n, R))
    copied.generate(request, greedy(n, R))
    assert shared.get_last_profile().kv_workspace_bytes == per_position * (B * P + B * n * R)
    assert copied.get_last_profile().kv_workspace_bytes == per_position * (B * n * (P + R) + B * P)
    assert shared.get_last_profile().prefill_tokens == copied.get_last_profile().prefill_tokens == B * P


def test_continuous_batching_prefills_each_prompt_once_into_reused_prefix_slots(tiny_models, tokenizer, monkeypatch):
    """Six prompts x 2 samples through 3 slots: 4 prefix slots (one per slot, plus the prompt whose first sample
    finished while its second waits), every prompt prefilled once, generate's tokens."""
    from opsd_rollout.rollout.decode import loop as loop_module

    model = copy.deepcopy(tiny_models["llama-tiny"])
    request = left_padded([[70 + i, 71, 72 + i, 73] for i in range(6)], PAD_ID)
    eos = eos_that_stops_some_rows(model, request, 2)
    model.generation_config.eos_token_id = None
    prefilled = []
    original = loop_module.prefill

    def spy(model, ids, *args):
        prefilled.append(ids.shape[0])
        return original(model, ids, *args)

    monkeypatch.setattr(loop_module, "prefill", spy)
    engine = rollout(model, make_tokenizer(PAD_ID, eos), **SHARED)
    got = engine.generate(request, greedy(2, 12, continuous_batch_size=3))
    expected, _ = reference_rollout(model, request, n=2, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[eos])
    assert torch.equal(got.input_ids, expected)
    assert sum(prefilled) == 6 and len(prefilled) > 1
    per_position = ModelSpec.of(model).kv.bytes_per_token(4)
    assert engine.get_last_profile().kv_workspace_bytes == per_position * (4 * 4 + 3 * 12)


@pytest.mark.parametrize("config,n,prompt,layout", [
    ({}, 4, 128, "shared_prefix"),  # the defaults, at the threshold
    ({}, 4, 127, "copied"),  # below it
    ({}, 1, 128, "copied"),  # nothing to share
    ({"shared_prefix": False}, 4, 128, "copied"),
    ({"shared_prefill": False}, 4, 128, "copied"),  # B*n prefills: no one copy to share
    ({"shared_prefix_min_prompt": 4}, 2, 4, "shared_prefix")])
def test_when_the_shared_prefix_layout_is_used(tiny_models, tokenizer, config, n, prompt, layout):
    from opsd_rollout.rollout.config import SHARED_PREFIX_MIN_PROMPT

    assert HybridEngineRolloutConfig().options.shared_prefix and SHARED_PREFIX_MIN_PROMPT == 128
    engine = rollout(tiny_models["gpt2-tiny"], tokenizer, **config)
    request = left_padded([[5 + i % 200 for i in range(prompt)]], PAD_ID)
    engine.generate(request, greedy(n, 2))
    assert engine.get_last_profile().kv_layout == layout


def test_the_compiled_step_decodes_over_the_shared_prefix_layout(tiny_models, tokenizer):
    """compile_decode keeps each prompt once: the store's columns round up to the compiled length bucket (masked),
    rows finishing early move through compaction (queries grouped by index), tokens equal generate's, and a
    repeated call compiles nothing. Traced with aot_eager here (inductor: test_compiled, slow). An attention other
    than sdpa/eager keeps the copied layout."""
    from opsd_rollout.rollout.shared_prefix import shared_prefix_problem
    from opsd_rollout.rollout.strategies.static import StaticDecode

    torch._dynamo.reset()
    model = copy.deepcopy(tiny_models["llama-tiny"])
    request = prompts_with_padding_and_holes(tokenizer)
    eos = eos_that_stops_some_rows(model, request, 3)
    model.generation_config.eos_token_id = None
    engine = rollout(model, make_tokenizer(PAD_ID, eos), **SHARED)
    engine.strategy = StaticDecode(compile_decode=True, options=RolloutOptions(shared_prefix_min_prompt=1),
                                   compile_options={"backend": "aot_eager"})
    ref_ids, _ = reference_rollout(model, request, n=3, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[eos])
    for call in range(2):
        batch = engine.generate(request, greedy(3, 12))
        profile = engine.get_last_profile()
        assert torch.equal(batch.input_ids, ref_ids), call
        assert profile.kv_layout == "shared_prefix" and profile.compactions >= 1, profile
        assert (profile.compiled_graphs >= 1) if call == 0 else (profile.compiled_graphs == 0), profile
    flex = copy.deepcopy(model)
    flex.config._attn_implementation = "flex_attention"
    assert "flex_attention" in shared_prefix_problem(ModelSpec.of(flex))


def test_a_kv_budget_counts_each_prompt_once(tiny_models, tokenizer):
    model = tiny_models["qwen2-tiny"]
    request = prompts_with_padding_and_holes(tokenizer)
    (B, P), n, R = request.prompt_ids.shape, 3, 6
    per_position = ModelSpec.of(model).kv.bytes_per_token(4)
    # 4 slots: 3 prompts (min(B, 4 + 1)) x P + 4 x R positions; a fifth slot would not fit
    budget = per_position * (B * P + 4 * R)
    assert slots_within(budget, per_position, B * n, B, P, R, shared=True) == 4
    assert slots_within(per_position * (2 * P + R), per_position, B * n, B, P, R, shared=True) == 1
    assert slots_within(per_position * (2 * P + R) - 1, per_position, B * n, B, P, R, shared=True) == 0
    expected = rollout(model, tokenizer).generate(request, greedy(n, R)).input_ids
    budgeted = rollout(model, tokenizer, kv_budget_bytes=budget, **SHARED)
    assert torch.equal(budgeted.generate(request, greedy(n, R)).input_ids, expected)
    assert budgeted.get_last_profile().decode_slots == 4
    with pytest.raises(ValueError, match="kv_budget_bytes .* holds no row"):
        rollout(model, tokenizer, kv_budget_bytes=per_position * P, **SHARED).generate(request, greedy(n, R))


# ---- what it refuses ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,error", [("shared_prefix", 1, TypeError),
                                               ("shared_prefix_min_prompt", 0, ValueError),
                                               ("shared_prefix_min_prompt", True, ValueError),
                                               ("shared_prefix_min_prompt", None, ValueError)])
def test_bad_options_are_refused_by_name(field, value, error):
    with pytest.raises(error, match=f"options.{field}"):
        RolloutOptions(**{field: value})


def test_a_model_whose_attention_ignores_the_interface_fails_loudly(tiny_models, tokenizer):
    """Attention modules reading a config of their own never see the switch: the decode forward would attend to
    the responses only, so it raises instead of returning wrong tokens."""
    model = copy.deepcopy(tiny_models["llama-tiny"])
    for layer in model.model.layers:
        layer.self_attn.config = copy.copy(model.config)
        layer.self_attn.config._attn_implementation = "sdpa"  # a copy the rollout's selection never reaches
    with pytest.raises(RuntimeError, match="shared-prefix attention in 0 of 2 layers"):
        rollout(model, tokenizer, **SHARED).generate(prompts_with_padding_and_holes(tokenizer), greedy(2))
    assert model.config._attn_implementation == "opsd_shared_prefix:sdpa"  # selected when built, not per call


def test_the_benchmarks_roofline_reads_each_shared_prompt_once(tiny_models):
    from opsd_rollout.bench.facts import decode_bytes_per_step

    spec = ModelSpec.of(tiny_models["llama-tiny"])
    weights, per_position = (spec.matmul_parameters + 16 * spec.lookup_width) * 4, spec.kv.bytes_per_token(4)
    assert decode_bytes_per_step(spec, 16, 100 + 4) == weights + per_position * 16 * 104
    assert decode_bytes_per_step(spec, 16, 4, shared_prompts=2, prompt_length=100) == weights + per_position * (
        16 * 4 + 2 * 100)


def test_a_compiled_step_keeps_reading_every_store_slot_through_a_long_tail():
    """A compiled step reads the whole store whatever is live: each count of slots read would be a graph of its
    own (a plain int to dynamo), and a tail compacting through many buckets would reach torch's recompile limit.
    Sixteen prompts ending two steps apart, seven compactions: a few graphs, none compiled inside a decode loop,
    none on a repeated call; the eager step narrows (the store's first slots only) and agrees token for token."""
    from conftest import chain_table, transition_model
    from opsd_rollout.rollout.shared_prefix import SharedPrefix
    from opsd_rollout.rollout.strategies.static import StaticDecode

    torch._dynamo.reset()
    vocab, eos = 40, 39
    model = transition_model(chain_table(vocab, {}))
    prompts = left_padded([[4, 5, 6, 7 + 2 * i] for i in range(16)], PAD_ID)  # prompt i ends after 32 - 2i steps
    sampling = greedy(2, 40)
    eager = rollout_engine(model, make_tokenizer(PAD_ID, eos), **SHARED)
    compiled = HybridEngineRollout(model, make_tokenizer(PAD_ID, eos), HybridEngineRolloutConfig())
    compiled.strategy = StaticDecode(compile_decode=True, options=RolloutOptions(shared_prefix_min_prompt=1),
                                     compile_options={"backend": "eager"})
    read: list[int] = []
    original = SharedPrefix.step  # called before each decode forward, outside the compiled graph

    def spy(self, active, running):
        read.append(self.groups)
        return original(self, active, running)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SharedPrefix, "step", spy)
        expected = eager.generate(prompts, sampling).input_ids
    assert min(read) < 16  # the eager step narrowed
    for call in range(2):
        read.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SharedPrefix, "step", spy)
            got = compiled.generate(prompts, sampling).input_ids
        stats = compiled.strategy.last_stats
        assert torch.equal(got, expected), call
        assert stats.compactions >= 5 and set(read) == {16}, (stats, set(read))
        assert stats.compiled_graphs <= (4 if call == 0 else 0), stats
    assert compiled.strategy.compiled.graphs <= 4
