"""Profiles are easy to log: ``to_dict()`` is one flat, JSON-safe record whose keys are what the profile answers
(DeepSpeed's names included) and which reads back as the profile; ``str()`` is a few lines for a person."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import left_padded
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutProfile, SamplingConfig
from opsd_rollout.opsd import StepProfile
from opsd_rollout.profiling.profile import DEEPSPEED_ALIASES, DERIVED_KEYS

SCALARS = (int, float, str, bool, type(None))


@pytest.fixture()
def profile(tiny_models, tokenizer) -> RolloutProfile:
    config = HybridEngineRolloutConfig(enable_profiling=True)
    rollout = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer, config)
    rollout.generate(left_padded([[5, 6, 7], [9]], 0), SamplingConfig(max_new_tokens=4, n_samples_per_prompt=2))
    return rollout.get_last_profile()


def step_profile(rollout: RolloutProfile | None) -> StepProfile:
    return StepProfile(rollout=rollout, eval_ms=0.5, train_ms=0.25, rollout_ms=40.0, teacher_forward_ms=90.0,
                       cache_write_ms=1.0, student_forward_ms=3.0, loss_ms=0.75, backward_ms=5.5, optimizer_ms=2.0,
                       total_ms=150.0, rollout_share=0.27,
                       peak_memory_bytes={"rollout": 3 * 2**20, "teacher": 5 * 2**20},
                       part_start_ms={"rollout": 0.5, "teacher": 41.0}, response_tokens=96, teacher_cache_bytes=2**20,
                       teacher_cache_mode="topk", fused_loss=True, loss=0.125)


def test_keys_are_every_key_the_profile_answers(profile):
    names = {f.name for f in dataclasses.fields(RolloutProfile)}
    assert set(profile.keys()) == names | set(DERIVED_KEYS) | set(DEEPSPEED_ALIASES)
    assert len(profile) == len(list(profile.keys()))
    for key in profile.keys():
        profile[key]  # every listed key reads
    with pytest.raises(KeyError):
        profile["not_a_key"]


def test_the_record_is_flat_json_safe_and_carries_deepspeeds_names(profile):
    record = profile.to_dict()
    assert list(record) == list(profile.keys())
    assert all(isinstance(value, SCALARS) for value in record.values())
    for alias, name in DEEPSPEED_ALIASES.items():
        assert record[alias] == record[name] == getattr(profile, name)
    assert record["generation_overhead_ms"] == profile.generation_overhead_ms
    assert json.loads(json.dumps(record, allow_nan=False)) == record


def test_nan_and_tensors_become_json_values(profile):
    odd = dataclasses.replace(profile, tpot_ms=float("nan"), ttft_ms=float("inf"), decode_steps=torch.tensor(3))
    record = odd.to_dict()
    assert record["tpot_ms"] is None and record["ttft_ms"] is None
    assert record["decode_steps"] == 3 and type(record["decode_steps"]) is int
    json.dumps(record, allow_nan=False)


def test_a_record_reads_back_as_the_profile(profile):
    assert RolloutProfile(**profile.to_dict()) == profile
    record = {k: v for k, v in profile.to_dict().items() if k != "prefill_ms"}
    assert RolloutProfile(**record).prefill_ms == profile.prefill_ms, "a DeepSpeed name stands for a missing field"
    with pytest.raises(TypeError):
        RolloutProfile(**{**profile.to_dict(), "unknown_ms": 1.0})


def test_str_is_a_few_readable_lines_and_repr_keeps_every_field(profile):
    text = str(profile)
    assert 3 <= len(text.splitlines()) <= 5
    assert f"total {profile.total_ms:.1f}" in text and "decode" in text and "tok/s" in text
    assert "peak memory" in text and "2 prompts x 2 samples" in text and profile.timer in text
    assert "=" not in text.replace(" = ", ""), "no field=value dump"
    assert repr(profile).startswith("RolloutProfile(") and "total_ms=" in repr(profile)


def test_the_step_record_is_flat_with_the_rollout_under_its_prefix(profile):
    step = step_profile(profile)
    record = step.to_dict()
    assert all(isinstance(value, SCALARS) for value in record.values())
    assert record["rollout/total_ms"] == profile.total_ms
    assert record["rollout/num_generated_tokens"] == profile.generated_tokens
    assert {k.removeprefix("rollout/") for k in record if k.startswith("rollout/")} == set(profile.keys())
    assert (record["peak_memory_bytes"], record["peak_rollout_bytes"], record["peak_teacher_bytes"]) == (
        5 * 2**20, 3 * 2**20, 5 * 2**20)
    assert (record["rollout_start_ms"], record["teacher_start_ms"]) == (0.5, 41.0)
    assert record["tokens_per_second"] == pytest.approx(96 / 0.150)
    assert json.loads(json.dumps(record, allow_nan=False)) == record
    unprofiled = step_profile(None).to_dict()
    assert not any(k.startswith("rollout/") for k in unprofiled) and unprofiled["loss"] == 0.125


def test_the_step_str_says_loss_parts_and_the_rollout(profile):
    text = str(step_profile(profile))
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("StepProfile: loss 0.1250, 150.0 ms, rollout share 27%")
    assert "teacher 90.0" in lines[1] and "5.0 MiB" in lines[2] and lines[3].startswith("  rollout: 2 prompts")
    assert len(str(step_profile(None)).splitlines()) == 3
