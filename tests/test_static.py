"""Strategy ``static``: equivalence with transformers' generate, shared prefill, workspace reuse, seeded and
correctly distributed sampling, early exit."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import (TINY_PRESETS, rollout_engine, assert_batch_contract, assert_chi_square_fit, chain_table, left_padded,
                      make_tokenizer, prompts_with_padding_and_holes, reference_rollout, transition_model)
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.models import EOS_ID, PAD_ID
from opsd_rollout.rollout.strategies.static import StaticDecode


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Plain float64 temperature / top-k / top-p, with transformers' warper semantics."""
    scaled = logits.double().numpy() / temperature
    keep = np.ones_like(scaled, dtype=bool)
    if 0 < top_k < scaled.size:
        keep &= scaled >= np.sort(scaled)[-top_k]
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        ascending = np.argsort(probs, kind="stable")
        cumulative = np.cumsum(probs[ascending])
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        probs[ascending[drop]] = 0.0
        probs /= probs.sum()
    return probs


def static(model, tokenizer, **kwargs):
    return rollout_engine(model, tokenizer, strategy="static", enable_profiling=True, **kwargs)


def unpadded_prompts(tokenizer) -> RolloutRequest:
    """Prompts without padding: the static strategy then passes no attention mask at all."""
    enc = tokenizer(["The student", "writes a bc", "on policy!!"], return_tensors="pt")
    return RolloutRequest(enc.input_ids, enc.attention_mask)


PROMPTS = {"padded": prompts_with_padding_and_holes, "unpadded": unpadded_prompts}


def assert_greedy_equals_generate(model, tokenizer, rollout, prompts, n):
    request = PROMPTS[prompts](tokenizer)
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=10, n_samples_per_prompt=n, temperature=0))
    ref_ids, ref_mask = reference_rollout(model, request, n=n, max_new_tokens=10, pad_token_id=PAD_ID,
                                          eos_ids=[EOS_ID])
    assert torch.equal(batch.input_ids, ref_ids) and torch.equal(batch.attention_mask, ref_mask)
    return request


@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("prompts", PROMPTS)
@pytest.mark.parametrize("n,shared", [(1, True), (3, True), (3, False)])
def test_greedy_equals_generate(tiny_models, tokenizer, name, prompts, n, shared):
    model = tiny_models[name]
    rollout = static(model, tokenizer, shared_prefill=shared)
    assert rollout.strategy.name == "static"
    request = assert_greedy_equals_generate(model, tokenizer, rollout, prompts, n)
    profile = rollout.get_last_profile()
    assert profile.strategy == "static"
    rows_prefilled = 3 if shared else 3 * n
    assert profile.prefill_tokens == rows_prefilled * request.prompt_ids.shape[1]


@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("prompts", PROMPTS)
@pytest.mark.parametrize("n", [1, 3])
def test_static_shapes_decode_equals_generate(tiny_models, tokenizer, name, prompts, n):
    """The layout a compiled step uses (whole cache every step, masked) decodes the same tokens, eagerly."""
    model = tiny_models[name]
    rollout = static(model, tokenizer, whole_cache=True)
    assert_greedy_equals_generate(model, tokenizer, rollout, prompts, n)


@pytest.mark.parametrize("whole_cache", [False, True])
@pytest.mark.parametrize("prompts", PROMPTS)
def test_decode_steps_attend_to_the_filled_positions_and_skip_the_mask_without_padding(
        tiny_models, tokenizer, whole_cache, prompts):
    """Each decode step is told where its rows write (one column, the fed token's, after the columns written),
    its keys span the positions written so far (the whole cache with ``whole_cache``), and its mask is ``None``
    when no prompt is padded, else the same width, switched on up to the fed token (every row kept in the batch:
    compaction off)."""
    from opsd_rollout.rollout.decode.loop import decode_one_token

    model = tiny_models["llama-tiny"]
    rollout = static(model, tokenizer, whole_cache=whole_cache, compact_rows=False)
    seen = []

    def spy(*args, **kwargs):
        logits = decode_one_token(*args, **kwargs)
        column, written, mask, cache = args[3:7]
        seen.append((None if mask is None else mask.clone(), cache.get_mask_sizes(1, 0)[0], column, written))
        return logits

    rollout.strategy.decode_step = spy
    request = assert_greedy_equals_generate(model, tokenizer, rollout, prompts, 1)
    P, length = request.prompt_ids.shape[1], request.prompt_ids.shape[1] + 10
    for step, (mask, width, column, written) in enumerate(seen, start=1):
        assert (column, written) == (P + step - 1, P + step - 1)  # passed with the forward: one column for all rows
        assert width == (length if whole_cache else P + step)
        if prompts == "unpadded" and not whole_cache:
            assert mask is None
            continue
        assert mask.shape == (3, 1, 1, length if whole_cache else P + step)
        assert torch.equal(mask[:, 0, 0, :P], request.prompt_attention_mask.bool())
        assert mask[:, 0, 0, P:P + step].all() and not mask[:, 0, 0, P + step:].any()


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("whole_cache", [False, True])
def test_eager_attention_gets_two_dimensional_masks_and_equals_generate(tiny_models, tokenizer, name,
                                                                        whole_cache):
    """Without SDPA the decode steps pass 2-D masks (transformers builds the 4-D one) of the cache's width."""
    model = copy.deepcopy(tiny_models[name])
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    rollout = static(model, tokenizer, whole_cache=whole_cache)
    for prompts in PROMPTS:
        assert_greedy_equals_generate(model, tokenizer, rollout, prompts, 2)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_compiled_decode_step_is_one_graph_and_equals_generate(tiny_models, tokenizer, name):
    """``compile_decode`` traces the one-token step whole (``fullgraph``: no graph break, so a GPU replays
    it as one CUDA graph). Here with a CPU backend; the engine refuses ``compile_decode`` on CPU."""
    torch._dynamo.reset()
    model = tiny_models[name]
    rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy="static"))
    rollout.strategy = StaticDecode(compile_decode=True, compile_options={"backend": "aot_eager", "fullgraph": True,
                                                                          "dynamic": False})
    for prompts in PROMPTS:
        assert_greedy_equals_generate(model, tokenizer, rollout, prompts, 2)


def test_profiling_a_compiled_decode_step_times_its_forwards_without_recompiling(tiny_models, tokenizer):
    """The forward timer's hooks stay out of the compiled graph (one break around them, no recompiles for
    the host times they hold), and profiled and unprofiled calls share the compiled step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_models["llama-tiny"]
    step = StaticDecode(compile_decode=True, compile_options={"backend": "aot_eager", "dynamic": False})
    for profiled in (True, False, True):
        rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy="static",
                                                                                  enable_profiling=profiled))
        rollout.strategy = step
        assert_greedy_equals_generate(model, tokenizer, rollout, "padded", 1)
        if profiled:
            profile = rollout.get_last_profile()
            assert profile.prefill_forwards == 1 and profile.decode_steps == 9 and profile.decode_ms > 0
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) <= 1


def test_workspace_is_reused_across_calls_of_different_sizes(tiny_models, tokenizer):
    model = tiny_models["qwen2-tiny"]
    rollout = static(model, tokenizer)
    shapes = [(3, 2, 12, 8), (1, 1, 4, 3), (2, 3, 7, 5), (4, 2, 16, 10)]  # B, n, P, max_new
    events = []
    for B, n, P, max_new in shapes:
        ids = torch.randint(3, 259, (B, P), generator=torch.Generator().manual_seed(B * P))
        mask = torch.ones_like(ids)
        mask[0, : P // 2] = 0
        request = RolloutRequest(ids, mask)
        batch = rollout.generate(request, SamplingConfig(max_new_tokens=max_new, n_samples_per_prompt=n,
                                                         temperature=0))
        ref_ids, _ = reference_rollout(model, request, n=n, max_new_tokens=max_new, pad_token_id=PAD_ID,
                                       eos_ids=[EOS_ID])
        assert torch.equal(batch.input_ids, ref_ids)
        profile = rollout.get_last_profile()
        events.append(profile.workspace)
        assert (profile.workspace_alloc_ms is not None) == (profile.workspace == "allocated")
    assert events == ["allocated", "reused", "reused", "allocated"]
    rollout.release_workspace()
    rollout.generate(left_padded([[5, 6]], 0), SamplingConfig(max_new_tokens=2))
    assert rollout.get_last_profile().workspace == "allocated"


def test_release_policy_frees_the_workspace_after_each_call(tiny_models, tokenizer):
    rollout = static(tiny_models["llama-tiny"], tokenizer, cache_policy="release")
    for _ in range(2):
        rollout.generate(left_padded([[5, 6, 7]], 0), SamplingConfig(max_new_tokens=3))
        assert rollout.get_last_profile().workspace == "allocated"
        assert rollout.strategy.workspace.nbytes == 0


def test_same_seed_same_samples_and_global_seed_controls_unseeded(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]
    request = prompts_with_padding_and_holes(tokenizer)
    sampling = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=4, temperature=1.3, top_k=40, top_p=0.95)
    a = static(model, tokenizer, seed=7).generate(request, sampling)
    b = static(model, tokenizer, seed=7).generate(request, sampling)
    c = static(model, tokenizer, seed=8).generate(request, sampling)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert len({tuple(r) for r in a.input_ids[:4].tolist()}) > 1, "samples of one prompt differ"
    unseeded = static(model, tokenizer)
    torch.manual_seed(3)
    d = unseeded.generate(request, sampling)
    torch.manual_seed(3)
    e = unseeded.generate(request, sampling)
    assert torch.equal(d.input_ids, e.input_ids)


@pytest.mark.parametrize("top_k,top_p,temperature", [(-1, 1.0, 1.0), (20, 1.0, 0.7), (-1, 0.8, 1.5), (30, 0.9, 1.0)])
def test_first_sampled_token_follows_the_filtered_softmax(tiny_models, tokenizer, top_k, top_p, temperature):
    """Chi-square goodness of fit of 6,000 first tokens against softmax(filter(logits)), fixed seed."""
    model = copy.deepcopy(tiny_models["llama-tiny"])
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # peaked enough that the filters cut (top-p keeps 24-121 tokens)
    request = left_padded([[72, 101, 108, 108, 111]], 0)
    with torch.no_grad():
        logits = model(request.prompt_ids).logits[:, -1]
    probs = torch.from_numpy(reference_probs(logits[0], temperature, top_k, top_p))
    draws = 6000
    batch = static(model, tokenizer, seed=1234).generate(
        request, SamplingConfig(max_new_tokens=1, n_samples_per_prompt=draws, temperature=temperature,
                                top_k=top_k, top_p=top_p))
    counts = torch.bincount(batch.input_ids[:, -1], minlength=probs.numel()).double()
    assert_chi_square_fit(counts, probs)


def test_early_exit_when_every_row_has_finished():
    model = transition_model(chain_table(16, {6: 2, 9: 2}))
    rollout = static(model, make_tokenizer(0, 2))
    batch = rollout.generate(left_padded([[5], [8]], 0), SamplingConfig(max_new_tokens=12, temperature=0))
    assert batch.input_ids[:, 1:].tolist() == [[6, 2] + [0] * 10, [9, 2] + [0] * 10]  # DeepSpeed's width: padding
    assert rollout.get_last_profile().decode_steps == 1  # stopped right after both rows' EOS
    checked_every_4 = static(model, make_tokenizer(0, 2), stop_check_interval=4)
    again = checked_every_4.generate(left_padded([[5], [8]], 0), SamplingConfig(max_new_tokens=12, temperature=0))
    assert torch.equal(again.input_ids, batch.input_ids)
    assert checked_every_4.get_last_profile().decode_steps == 3  # runs on to the next check (step 4)


def test_models_without_a_static_cache_fall_back_to_generate(tokenizer, caplog):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
                           max_position_embeddings=64)
    model = MistralForCausalLM(config).eval()
    with caplog.at_level("WARNING"):
        rollout = static(model, tokenizer)
    assert rollout.strategy.name == "generate" and "using 'generate'" in caplog.text
    # DeepSpeed's name says what the rollout that runs does: generate prefills each row's prompt (the config, read
    # alone, still says what it asked for)
    assert rollout.use_shared_prefill is False and rollout.cfg.use_shared_prefill is True
    batch = rollout.generate(left_padded([[5, 6]], 0), SamplingConfig(max_new_tokens=3, temperature=0))
    assert_batch_contract(batch, left_padded([[5, 6]], 0), n=1, max_new_tokens=3, pad_token_id=0, eos_ids=[2])


def test_flash_attention_and_generation_config_processors_fall_back_to_generate(tiny_models, tokenizer, caplog):
    from opsd_rollout.rollout.strategies.static import StaticDecode
    from opsd_rollout.rollout.target import resolve_target

    model = copy.deepcopy(tiny_models["llama-tiny"])
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in StaticDecode().unsupported_reason(resolve_target(model))
    model = copy.deepcopy(tiny_models["llama-tiny"])
    model.generation_config.repetition_penalty = 1.3
    with caplog.at_level("WARNING"):
        rollout = static(model, tokenizer)
    assert rollout.strategy.name == "generate" and "repetition_penalty" in caplog.text
    request = prompts_with_padding_and_holes(tokenizer)
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=8, temperature=0))
    ref_ids, _ = reference_rollout(model, request, n=1, max_new_tokens=8, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    assert torch.equal(batch.input_ids, ref_ids)  # the penalty applied, as model.generate applies it


def test_a_list_valued_tokenizer_eos_is_the_pad_fallback():
    """The first of the tokenizer's EOS ids pads the rows that stop early."""
    model = transition_model(chain_table(16, {8: 5}))  # after 8 comes 5, an EOS; 10 runs on: 11, 12, 13
    rollout = HybridEngineRollout(model, make_tokenizer(None, [2, 5]))
    batch = rollout.generate(left_padded([[7, 8], [9, 10]], 2), SamplingConfig(max_new_tokens=3, temperature=0))
    assert batch.input_ids[:, 2:].tolist() == [[5, 2, 2], [11, 12, 13]]
    assert batch.attention_mask[:, 2:].tolist() == [[1, 0, 0], [1, 1, 1]]


@pytest.mark.parametrize("continuous", [None, 2])
def test_the_decode_loop_hands_each_rows_length_to_post_processing(tiny_models, tokenizer, continuous):
    """Rows the loop stopped at their first EOS: their lengths go to post-processing (``DecodeStats.lengths``, which
    then searches no token; the suite's every loop checks them against the search), and the batch is generate's.
    A processor that ignores EOS (a fixed-length workload) hands over nothing: the batch is cut at the search."""
    model = transition_model(chain_table(16, {5: EOS_ID, 9: EOS_ID}), eos_token_id=EOS_ID)
    tok = make_tokenizer(PAD_ID, EOS_ID)
    request = left_padded([[3, 4], [6, 7, 8], [10], [4]], PAD_ID)
    rollout = static(model, tok)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0, continuous_batch_size=continuous)
    batch = rollout.generate(request, sampling)
    handed = rollout.strategy.last_stats.lengths
    assert handed.tolist() == [2, 2, 6, 2]  # 3 4 -> 5 EOS; 6 7 8 -> 9 EOS; 10 -> 11..15 (no EOS); 4 -> 5 EOS
    ref_ids, ref_mask = reference_rollout(model, request, n=1, max_new_tokens=6, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    assert torch.equal(batch.input_ids, ref_ids) and torch.equal(batch.attention_mask, ref_mask)
    fixed = rollout_engine(model, tok, ignore_eos=True, strategy="static")
    fixed.generate(request, SamplingConfig(max_new_tokens=6, temperature=0))
    assert fixed.rollout.strategy.last_stats.lengths is None
