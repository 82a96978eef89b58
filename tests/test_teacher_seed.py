"""A teacher that is the student trains nothing: presets take a seed, so the same preset can be another model, and
the OPSD step says so (once) when the teacher has the student's weights."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from opsd_rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from opsd_rollout.deepspeed_engine import build_engine
from opsd_rollout.models import PRESETS, load_model
from opsd_rollout.opsd import DivergenceConfig, opsd_step
from opsd_rollout.opsd.step import _same_weights
from opsd_rollout.presets import PRESET_SEED

STEP_LOGGER = "opsd_rollout.opsd.step"


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def test_the_default_seed_keeps_the_presets_weights_and_another_draws_others():
    default = weights(load_model("llama-tiny")[0])
    assert all(torch.equal(a, b) for a, b in zip(default, weights(PRESETS["llama-tiny"].build(seed=PRESET_SEED))))
    other = weights(load_model("llama-tiny", seed=1)[0])
    again = weights(load_model("llama-tiny", seed=1)[0])
    assert all(torch.equal(a, b) for a, b in zip(other, again)), "a seed's weights repeat"
    assert not torch.equal(default[0], other[0])


def test_a_seed_is_an_int_for_a_preset_only(tmp_path):
    with pytest.raises(TypeError, match="seed must be an int"):
        load_model("llama-tiny", seed=1.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        load_model("llama-tiny", seed=True)
    with pytest.raises(ValueError, match="checkpoint directory, which keeps its own"):
        load_model(str(tmp_path), seed=3)


def test_same_weights_sees_the_same_module_and_equal_copies_not_other_seeds():
    student = load_model("llama-tiny")[0]
    assert _same_weights(student, student)
    assert _same_weights(student, load_model("llama-tiny")[0])
    assert not _same_weights(student, load_model("llama-tiny", seed=1)[0])
    assert not _same_weights(student, load_model("qwen2-tiny")[0])
    assert not _same_weights(student, torch.nn.Module()), "a teacher without parameters says nothing"


def run_steps(teacher: torch.nn.Module, tokenizer, steps: int = 2) -> list[float]:
    student = copy.deepcopy(load_model("llama-tiny")[0]).train()
    engine = build_engine(student, 0, lr=1e-2)
    rollout = HybridEngineRollout(engine, tokenizer)
    enc = tokenizer(["The student writes", "hi"], padding=True, return_tensors="pt")
    sampling = SamplingConfig(max_new_tokens=6, n_samples_per_prompt=2, temperature=0)
    return [opsd_step(engine, teacher.requires_grad_(False), rollout, RolloutRequest(enc.input_ids, enc.attention_mask),
                      sampling, divergence=DivergenceConfig(loss="forward_kl")).loss for _ in range(steps)]


def test_the_step_warns_once_when_the_teacher_has_the_students_weights(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger=STEP_LOGGER):
        losses = run_steps(load_model("llama-tiny")[0], tokenizer)
    said = [r for r in caplog.records if "the teacher has the student's weights" in r.getMessage()]
    assert len(said) == 1 and "seed=" in said[0].getMessage()
    assert losses[0] == pytest.approx(0.0, abs=1e-6), "what the warning is about: nothing to learn"


def test_a_teacher_of_another_seed_is_not_warned_about(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger=STEP_LOGGER):
        losses = run_steps(load_model("llama-tiny", seed=1)[0], tokenizer)
    assert not [r for r in caplog.records if "student's weights" in r.getMessage()]
    assert losses[0] > 0
