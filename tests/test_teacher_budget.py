"""The teacher cache's host-memory budget: checked before the teacher runs, refused with the fixes named, or a
full cache switched to top-k when allowed; the default budget is a share of available memory; the step's
profile reports the budget and the bytes used."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import chain_table, left_padded, make_tokenizer, transition_model
from opsd_rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from opsd_rollout.bench.scenarios import step as step_scenario
from opsd_rollout.deepspeed_engine import build_engine
from opsd_rollout.opsd import (DivergenceConfig, TeacherCacheBuffers, TeacherCacheConfig, build_teacher_cache,
                               opsd_step, response_targets)
from opsd_rollout.opsd import teacher as teacher_module
from opsd_rollout.opsd.teacher import cache_bytes


@pytest.fixture
def targets():
    """4 rows x 5 response positions (rows 0-1 end at EOS), for the 259-token tiny teachers."""
    batch = HybridEngineRollout(transition_model(chain_table(16, {6: 2})), make_tokenizer(0, 2)).generate(
        left_padded([[4, 5], [9]], 0), SamplingConfig(max_new_tokens=5, n_samples_per_prompt=2, temperature=0))
    return response_targets(batch)


def test_a_full_cache_over_its_budget_is_refused_before_the_teacher_runs(tiny_models, targets):
    teacher = tiny_models["gpt2-tiny"]
    forwards = []
    handle = teacher.base_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    full = cache_bytes(4, 5, 259, torch.float32, False)
    assert full == 4 * 5 * 259 * 4
    try:
        with pytest.raises(ValueError) as error:
            build_teacher_cache(teacher, targets, TeacherCacheConfig(host_budget_bytes=full - 1),
                                buffers=TeacherCacheBuffers())
        assert not forwards, "refused before any teacher work"
        cache = build_teacher_cache(teacher, targets, TeacherCacheConfig(host_budget_bytes=full),
                                    buffers=TeacherCacheBuffers())
    finally:
        handle.remove()
    for part in ("full teacher cache needs 20.2 KiB", "4 rows x 5 response positions x 259 logits",
                 "host_budget_bytes", "mode='topk', top_k=64", "over_budget='topk'", "dtype=torch.bfloat16",
                 "fewer rows"):
        assert part in str(error.value), (part, str(error.value))
    assert cache.mode == "full" and cache.nbytes == full and cache.budget_bytes == full and forwards


def test_a_top_k_cache_over_its_budget_names_its_own_fixes(tiny_models, targets):
    needed = cache_bytes(4, 5, 8, torch.float32, True)
    assert needed == 4 * 5 * 8 * 8  # a value and an int32 index per entry
    with pytest.raises(ValueError, match="top-8 teacher cache needs .* 8 \\(value, index\\) pairs.*a smaller top_k"):
        build_teacher_cache(tiny_models["gpt2-tiny"], targets,
                            TeacherCacheConfig(mode="topk", top_k=8, host_budget_bytes=needed - 1),
                            buffers=TeacherCacheBuffers())


def test_over_budget_topk_switches_a_full_cache_to_top_k_with_a_warning(tiny_models, targets):
    config = TeacherCacheConfig(top_k=6, host_budget_bytes=cache_bytes(4, 5, 6, torch.float32, True),
                                over_budget="topk")
    with pytest.warns(UserWarning, match="over its host-memory budget.*top-6"):
        cache = build_teacher_cache(tiny_models["gpt2-tiny"], targets, config, buffers=TeacherCacheBuffers())
    assert cache.mode == "topk" and cache.values.shape == (4, 5, 6) and cache.indices is not None
    reference = build_teacher_cache(tiny_models["gpt2-tiny"], targets, TeacherCacheConfig(mode="topk", top_k=6),
                                    buffers=TeacherCacheBuffers())
    torch.testing.assert_close(cache.values, reference.values)
    with pytest.raises(ValueError, match="top-6 \\(over_budget='topk': the full one needs 20.2 KiB\\) teacher cache "
                       "needs 960 bytes.*a smaller top_k"):  # not even top-k fits: refused
        build_teacher_cache(tiny_models["gpt2-tiny"], targets,
                            TeacherCacheConfig(top_k=6, host_budget_bytes=100, over_budget="topk"),
                            buffers=TeacherCacheBuffers())


def test_the_default_budget_is_a_share_of_available_memory_plus_reusable_buffers(monkeypatch):
    monkeypatch.setattr(teacher_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=10_000))
    assert TeacherCacheConfig().budget() == 5_000
    assert TeacherCacheConfig(host_budget_fraction=0.8).budget(reusable_bytes=2_000) == 9_600
    assert TeacherCacheConfig(host_budget_bytes=123).budget(reusable_bytes=2_000) == 123


@pytest.mark.parametrize("field,value,message", [
    ("host_budget_bytes", 0, "host_budget_bytes must be an int >= 1 or None"),
    ("host_budget_bytes", 1.5, "host_budget_bytes must be an int >= 1 or None"),
    ("host_budget_fraction", 0.0, "host_budget_fraction must be in \\(0, 1\\]"),
    ("host_budget_fraction", 1.5, "host_budget_fraction must be in \\(0, 1\\]"),
    ("over_budget", "shrink", "over_budget must be one of \\['error', 'topk'\\]"),
])
def test_bad_budget_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        TeacherCacheConfig(**{field: value})


def test_the_benchmark_settings_offer_the_caches_own_choices():
    assert step_scenario.OVER_BUDGET == teacher_module.OVER_BUDGET


def test_the_step_profile_reports_the_budget_the_mode_and_the_bytes(tiny_models, tokenizer):
    engine = build_engine(copy.deepcopy(tiny_models["llama-tiny"]).train(), 0, lr=1e-3)
    rollout = HybridEngineRollout(engine, tokenizer)
    enc = tokenizer(["hi there", "distil"], padding=True, return_tensors="pt")
    request = RolloutRequest(enc.input_ids, enc.attention_mask)
    sampling = SamplingConfig(max_new_tokens=4, n_samples_per_prompt=2, temperature=0)
    budget = cache_bytes(4, 1, 259, torch.float32, False) - 1  # under any full cache, over any top-5 one
    with pytest.warns(UserWarning, match="top-5"):
        profile = opsd_step(engine, tiny_models["qwen2-tiny"], rollout, request, sampling,
                            divergence=DivergenceConfig(loss="forward_kl"),
                            teacher_cache=TeacherCacheConfig(top_k=5, host_budget_bytes=budget, over_budget="topk"))
    assert profile.teacher_cache_budget_bytes == budget and profile.teacher_cache_mode == "topk"
    window = profile.teacher_cache_bytes // cache_bytes(4, 1, 5, torch.float32, True)
    assert 1 <= window <= 4 and profile.teacher_cache_bytes == cache_bytes(4, window, 5, torch.float32, True)
    data = profile.to_dict()
    assert data["teacher_cache_budget_bytes"] == budget and data["teacher_cache_mode"] == "topk"
    assert data["fused_loss"] is True
