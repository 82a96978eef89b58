"""A trainer written against ``deepspeed.runtime.rollout`` runs unchanged after switching its imports to
``opsd_rollout``: the same function, given either module, builds its rollout with the factory, rolls out,
derives DeepSpeed's response targets, computes the OPSD loss and trains. Greedy rollouts of the same weights
are the same tokens, so both runs see the same losses step after step."""

from __future__ import annotations

import copy
import importlib
from contextlib import nullcontext

import pytest
import torch

from opsd_rollout.deepspeed_engine import build_engine

STEPS = 3


def train(api, engine, teacher, tokenizer, prompts: list[str]) -> tuple[list[float], list[tuple[list, list]]]:
    """A small OPSD trainer that knows only ``api``'s public names (DeepSpeed's rollout module or ours)."""
    # as DeepSpeedExamples' OPSD trainer calls it: with a keyword DeepSpeed's factory ignores
    rollout = api.build_rollout(api.RolloutConfig(engine="hybrid_engine"), engine, tokenizer,
                                student_model_path="checkpoints/student")
    assert isinstance(rollout, api.RolloutEngine)
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    request = api.RolloutRequest(prompt_ids=enc.input_ids, prompt_attention_mask=enc.attention_mask)
    sampling = api.SamplingConfig(max_new_tokens=6, temperature=0.0, n_samples_per_prompt=2)
    losses, responses = [], []
    for step in range(STEPS):
        engine.eval()
        batch = rollout.generate(request, sampling)
        engine.train()
        assert isinstance(batch, api.RolloutBatch) and batch.batch_size == 2 * len(prompts)
        targets = api.ResponseTokenBatch.from_rollout(batch)
        student_logits = targets.select_causal_logits(
            engine(input_ids=targets.input_ids, attention_mask=targets.attention_mask).logits)
        with torch.no_grad():
            teacher_logits = targets.select_causal_logits(
                teacher(input_ids=targets.input_ids, attention_mask=targets.attention_mask).logits)
        out = api.generalized_jsd_loss(student_logits, teacher_logits, targets.response_mask, beta=0.5,
                                       temperature=1.0, teacher_top_k=16, pointwise_clip=1.0)
        engine.backward(out.loss)
        engine.step()
        assert rollout.sync_weights(step) is None
        losses.append(float(out.loss.detach()))
        responses.append((batch.input_ids.tolist(), batch.attention_mask.tolist()))  # the whole batch, as returned
    rollout.shutdown()
    return losses, responses


@pytest.fixture(scope="module")
def trained(tiny_models, tokenizer):
    """module name -> what ``train`` returned, each from the same initial student."""
    teacher = copy.deepcopy(tiny_models["qwen2-tiny"]).requires_grad_(False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(5)  # a teacher that disagrees with the student, so the loss moves
    results = {}
    for name in ("deepspeed.runtime.rollout", "opsd_rollout"):
        engine = build_engine(copy.deepcopy(tiny_models["llama-tiny"]).train(), 0, lr=1e-2)
        # DeepSpeed's factory drops the keyword in silence; ours drops it with a warning naming it
        said = pytest.warns(UserWarning, match="student_model_path") if name == "opsd_rollout" else nullcontext()
        with said:
            results[name] = train(importlib.import_module(name), engine, teacher, tokenizer,
                                  ["The student writes", "hi", "distil this"])
    return results


@pytest.mark.parametrize("name", ["deepspeed.runtime.rollout", "opsd_rollout"])
def test_the_trainer_runs_with_either_module(trained, name):
    losses, responses = trained[name]
    assert len(losses) == STEPS and all(loss > 0 for loss in losses)
    assert losses[-1] != losses[0], "the student was trained"
    assert all(len(row) == len(ids[0]) for ids, _ in responses for row in ids)


def test_both_runs_see_the_same_tokens_and_losses(trained):
    (ds_losses, ds_responses), (our_losses, our_responses) = trained.values()
    assert our_responses == ds_responses  # the same batches: ids, masks and DeepSpeed's width
    assert our_losses == pytest.approx(ds_losses, rel=1e-4, abs=1e-6)
