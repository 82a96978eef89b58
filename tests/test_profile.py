"""RolloutProfile: fields consistent, DeepSpeed's keys readable, None before a call and after a failure."""

from __future__ import annotations

import pytest
import torch

from conftest import chain_table, left_padded, make_tokenizer, transition_model
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutOptions, RolloutProfile, SamplingConfig
from opsd_rollout.profiling import Clock, ForwardTimer

PROFILED = HybridEngineRolloutConfig(enable_profiling=True)


def test_profile_is_none_until_a_profiled_call(tiny_models, tokenizer):
    request = left_padded([[5, 6, 7]], 0)
    plain = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer)
    plain.generate(request, SamplingConfig(max_new_tokens=2))
    assert plain.get_last_profile() is None
    profiled = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer, PROFILED)
    assert profiled.get_last_profile() is None
    profiled.generate(request, SamplingConfig(max_new_tokens=2))
    assert isinstance(profiled.get_last_profile(), RolloutProfile)


def test_stages_nest_and_tokens_exclude_padding_after_eos():
    # Row 0 stops after 2 tokens, row 1 runs 6: 8 real tokens, 4 padded positions.
    model = transition_model(chain_table(16, {6: 2}))
    rollout = HybridEngineRollout(model, make_tokenizer(0, 2), PROFILED)
    batch = rollout.generate(left_padded([[5], [8]], 0), SamplingConfig(max_new_tokens=6, temperature=0))
    p = rollout.get_last_profile()
    assert batch.attention_mask[:, 1:].sum() == 8
    assert (p.generated_tokens, p.padded_tokens, p.response_length) == (8, 4, 6)
    assert p.tokens_per_second == pytest.approx(8 / (p.total_ms / 1e3))
    assert p.decode_tokens_per_second == pytest.approx((8 - 2) / (p.decode_ms / 1e3))
    for name, value in p.to_dict().items():
        if isinstance(value, float):
            assert value >= 0, name
    assert p.prompt_expansion_ms + p.generation_ms + p.post_processing_ms <= p.total_ms
    assert p.prefill_ms + p.decode_ms <= p.generation_ms
    assert p.attention_mask_ms <= p.post_processing_ms
    assert (p.prefill_forwards, p.decode_steps) == (1, 5)
    assert p.peak_memory_bytes > 0 and p.peak_memory_source.startswith("process_rss")
    assert (p.batch_size, p.samples_per_prompt, p.effective_batch_size, p.prompt_length) == (2, 1, 2, 1)
    assert (p.decoding, p.zero_stage, p.world_size, p.rank, p.device, p.dtype) == ("greedy", 0, 1, 0, "cpu", "fp32")


def test_profile_reads_as_a_mapping_with_deepspeed_keys(tiny_models, tokenizer):
    rollout = HybridEngineRollout(tiny_models["gpt2-tiny"], tokenizer, PROFILED)
    rollout.generate(left_padded([[5, 6, 7], [9]], 0), SamplingConfig(max_new_tokens=4, n_samples_per_prompt=2))
    p = rollout.get_last_profile()
    as_dict = dict(p)
    assert as_dict["prefill_forward_ms"] == p.prefill_ms
    assert as_dict["decode_forward_ms"] == p.decode_ms
    assert as_dict["num_decode_forwards"] == p.decode_steps
    assert as_dict["num_generated_tokens"] == p.generated_tokens
    assert as_dict["num_samples_per_prompt"] == 2
    assert p["generation_overhead_ms"] == pytest.approx(p.generation_ms - p.prefill_ms - p.decode_ms
                                                        - p.attributed_ms)
    assert "param_gather_ms" in p and p.get("param_gather_ms") is None
    with pytest.raises(KeyError):
        p["no_such_key"]
    with pytest.raises(AttributeError):
        p.total_ms = 0.0  # frozen


def test_a_call_that_raises_inside_the_model_leaves_no_profile_and_no_hooks(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]
    rollout = HybridEngineRollout(model, tokenizer, PROFILED)
    rollout.generate(left_padded([[5, 6]], 0), SamplingConfig(max_new_tokens=2))
    hooks_before = (len(model._forward_pre_hooks), len(model._forward_hooks))

    def boom(*_):
        raise RuntimeError("device fell over")

    handle = model.model.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="device fell over"):
            rollout.generate(left_padded([[5, 6]], 0), SamplingConfig(max_new_tokens=2))
    finally:
        handle.remove()
    assert rollout.get_last_profile() is None
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks_before


def test_unprofiled_rollout_registers_no_hooks_and_no_probes(tiny_models, tokenizer):
    import gc

    model = tiny_models["qwen2-tiny"]
    callbacks, during = list(gc.callbacks), []
    handle = model.model.register_forward_pre_hook(lambda *_: during.append(gc.callbacks == callbacks))
    seen = []
    original = model.register_forward_hook
    model.register_forward_hook = lambda *a, **k: seen.append(a) or original(*a, **k)
    try:
        HybridEngineRollout(model, tokenizer).generate(left_padded([[5, 6]], 0), SamplingConfig(max_new_tokens=3))
    finally:
        del model.register_forward_hook
        handle.remove()
    assert seen == []
    assert during and all(during), "no garbage-collection callback while an unprofiled rollout runs"


def test_forward_timer_counts_chunked_prefill_as_prefill(tiny_models):
    from transformers import DynamicCache

    model = tiny_models["llama-tiny"]
    timer = ForwardTimer(model, Clock("cpu")).attach()
    try:
        cache = DynamicCache(config=model.config)
        ids = torch.arange(3, 15).view(1, 12)
        with torch.no_grad():
            model(ids[:, :6], past_key_values=cache, use_cache=True)  # prefill chunk 1
            model(ids[:, 6:], past_key_values=cache, use_cache=True)  # prefill chunk 2
            for token in (20, 21, 22):
                model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        phases = [f.kind for f in timer.read()]
    finally:
        timer.remove()
    assert phases == ["prefill", "prefill", "decode", "decode", "decode"]
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_forward_timing_off_leaves_forward_fields_empty(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]
    rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(
        enable_profiling=True, options=RolloutOptions(profile_forwards=False)))
    rollout.generate(left_padded([[5, 6]], 0), SamplingConfig(max_new_tokens=3))
    p = rollout.get_last_profile()
    assert p.prefill_ms is None and p.decode_steps is None and p.tpot_ms is None
    assert p["generation_overhead_ms"] == pytest.approx(p.generation_ms - p.attributed_ms)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("strategy", ["static", "generate"])
def test_fixed_lengths_run_every_step_but_return_the_same_batch(strategy):
    """The bench's ``fixed`` workload: EOS ends no row (every step runs), and the batch is still cut at it."""
    from opsd_rollout.bench.workload import FixedLengths

    table = chain_table(16, {6: 2})
    model = transition_model(table, eos_token_id=2)  # generate() must not stop on the model's own EOS either
    request = left_padded([[5], [5]], 0)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0)
    normal = HybridEngineRollout(model, make_tokenizer(0, 2), HybridEngineRolloutConfig(enable_profiling=True,
                                                                                        strategy=strategy))
    fixed = HybridEngineRollout(model, make_tokenizer(0, 2), HybridEngineRolloutConfig(enable_profiling=True,
                                                                                       strategy=strategy))
    a, b = normal.generate(request, sampling), fixed.generate(request, sampling, logits_processor=FixedLengths())
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    assert normal.get_last_profile().decode_steps == 1  # both rows stop after 2 tokens
    assert fixed.get_last_profile().decode_steps == 5  # ran the full budget
    assert fixed.get_last_profile().response_length == 6  # the batch's response columns: max_new_tokens
    assert fixed.get_last_profile().generated_tokens == 2 * 2


def test_release_policy_times_the_release_and_timeline_nests(tiny_models, tokenizer):
    rollout = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer,
                                  HybridEngineRolloutConfig(enable_profiling=True, cache_policy="release"))
    rollout.generate(left_padded([[5, 6, 7]], 0), SamplingConfig(max_new_tokens=4, n_samples_per_prompt=2))
    p = rollout.get_last_profile()
    assert p.inference_cache_ms is not None and 0 <= p.inference_cache_ms <= p.generation_ms
    assert p.ttft_ms is not None and p.prefill_ms <= p.ttft_ms <= p.total_ms
    assert p.prefill_tokens == 1 * 3 and p.tpot_ms > 0  # the prompt is prefilled once for both samples
    spans = {s.name: s for s in rollout.get_last_timeline() if not s.name.endswith("forward")}
    forwards = [s for s in rollout.get_last_timeline() if s.name.endswith("forward")]
    assert len(forwards) == 4 and all(s.parent == "generation" for s in forwards)
    assert spans["generation"].parent == "total"
    assert spans["attention_mask"].parent == "post_processing"
    for span in rollout.get_last_timeline():
        parent = spans.get(span.parent) if span.parent else None
        if parent is not None:
            assert parent.start_ms <= span.start_ms + 1e-6
            assert span.start_ms + span.duration_ms <= parent.start_ms + parent.duration_ms + 1e-6


def test_every_profile_field_is_documented_in_the_repository():
    """docs/CONTRACT.md carries what users rely on: each RolloutProfile and StepProfile field has a row."""
    import dataclasses
    from pathlib import Path

    from opsd_rollout.opsd import StepProfile
    from opsd_rollout.profiling import RolloutProfile

    text = (Path(__file__).resolve().parents[1] / "docs" / "CONTRACT.md").read_text()
    for cls in (RolloutProfile, StepProfile):
        missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in text]
        assert not missing, f"{cls.__name__} fields without a row in docs/CONTRACT.md: {missing}"
