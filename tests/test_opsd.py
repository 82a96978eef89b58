"""OPSD: divergences against float64 formulas (values and gradients), chunking, the teacher cache, response
targets, and whole steps on DeepSpeed ZeRO-0 and ZeRO-3."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import chain_table, jsd_by_hand, left_padded, make_tokenizer, transition_model
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.deepspeed_engine import build_engine
from opsd_rollout.modeling import position_ids
from opsd_rollout.models import PRESETS
from opsd_rollout.opsd import (DivergenceConfig, TeacherCacheBuffers, TeacherCacheConfig, build_teacher_cache,
                               chunked_divergence, opsd_step, response_targets, token_divergence)
from opsd_rollout.profiling import Clock, StageRecorder


def reference(student_logits, teacher_logits, beta, temperature):
    """Plain float64 formulas, on probabilities."""
    return jsd_by_hand(torch.softmax(student_logits.double() / temperature, -1),
                       torch.softmax(teacher_logits.double() / temperature, -1), beta)


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.3), ("jsd", 0.5),
                                       ("jsd", 0.0), ("jsd", 1.0)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_divergence_and_gradient_match_float64_formulas(loss, beta, temperature):
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(3, 5, 11, generator=g) * 2).requires_grad_()
    teacher = torch.randn(3, 5, 11, generator=g) * 2
    config = DivergenceConfig(loss=loss, beta=beta, temperature=temperature)
    ours = token_divergence(student, teacher, config)
    student64 = student.detach().double().requires_grad_()
    ref = reference(student64, teacher, config.effective_beta, temperature)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(student.grad.double(), student64.grad, rtol=1e-4, atol=1e-6)
    assert (ours >= -1e-6).all()


def test_top_k_restricts_both_distributions_to_the_teacher_support():
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 4, 20, generator=g), torch.randn(2, 4, 20, generator=g)
    top = torch.topk(teacher, 5, dim=-1)
    ours = token_divergence(student, (top.values, top.indices), DivergenceConfig(loss="forward_kl"))
    ref = reference(student.gather(-1, top.indices), top.values, 0.0, 1.0)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("topk", [False, True])
def test_chunked_equals_unchunked_with_gradients(topk):
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(3, 17, 13, generator=g)
    mask = torch.rand(3, 17, generator=g) > 0.3
    cached = torch.topk(teacher, 4, dim=-1) if topk else None

    def chunk(start, stop):
        return (cached.values[:, start:stop], cached.indices[:, start:stop]) if topk else teacher[:, start:stop]

    results = []
    for size in (3, 1000):
        student = torch.randn(3, 17, 13, generator=torch.Generator().manual_seed(3)).requires_grad_()
        total, count = chunked_divergence(student, chunk, mask, DivergenceConfig(loss="jsd", beta=0.4,
                                                                                  chunk_size=size))
        (total / count).backward()
        results.append((total.detach(), count, student.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    assert results[0][1] == results[1][1] == mask.sum()
    torch.testing.assert_close(results[0][2], results[1][2])


def test_checkpointed_chunks_do_not_keep_the_teachers_device_copies_for_backward():
    """Each chunk's teacher slice is fetched inside the checkpointed function: autograd saves the student's
    chunk, never the teacher's (on a GPU, those would all stay on the device until backward)."""
    g = torch.Generator().manual_seed(5)
    cached = torch.topk(torch.randn(2, 12, 11, generator=g), 5, dim=-1)
    fetched = []

    def chunk(start, stop):
        fetched.append((start, stop))
        return cached.values[:, start:stop].clone(), cached.indices[:, start:stop].clone()  # a fresh "device copy"

    saved = []
    student = torch.randn(2, 12, 11, generator=g).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        total, count = chunked_divergence(student, chunk, torch.ones(2, 12), DivergenceConfig(chunk_size=4))
    assert saved and not any(shape[-1] == 5 for shape in saved), saved
    total.backward()
    assert sorted(fetched) == sorted([(0, 4), (4, 8), (8, 12)] * 2), "fetched once forward, once in backward"


def rollout_batch(table, prompts, max_new=6, n=2):
    model = transition_model(table)
    rollout = HybridEngineRollout(model, make_tokenizer(0, 2))
    return rollout.generate(left_padded(prompts, 0), SamplingConfig(max_new_tokens=max_new, n_samples_per_prompt=n,
                                                                    temperature=0))


def test_response_mask_is_response_tokens_up_to_eos_only():
    batch = rollout_batch(chain_table(16, {6: 2}), [[5], [0, 9, 10]])  # row 0/1 stop at EOS, rows 2/3 run on
    targets = response_targets(batch)
    assert targets.prompt_length == 3
    assert targets.mask.tolist()[0] == [True, True, False, False, False, False]
    assert targets.mask.tolist()[2] == [True] * 6
    assert torch.equal(targets.labels, batch.input_ids[:, 3:])
    assert targets.window == slice(2, 8)
    # a generated token equal to the pad id, before EOS, is a response token
    with_pad = response_targets(rollout_batch(chain_table(16, {5: 0, 0: 7, 7: 2}), [[5]], n=1))
    assert with_pad.labels.tolist()[0][:3] == [0, 7, 2] and with_pad.mask.tolist()[0] == [True, True, True]


@pytest.mark.parametrize("mode", ["full", "topk"])
def test_teacher_cache_round_trip_and_device_chunk_bound(tiny_models, mode):
    teacher = tiny_models["gpt2-tiny"]
    request = RolloutRequest(torch.randint(3, 259, (5, 7), generator=torch.Generator().manual_seed(4)),
                             torch.ones(5, 7, dtype=torch.long))
    batch = HybridEngineRollout(tiny_models["llama-tiny"], make_tokenizer(0, 2)).generate(
        request, SamplingConfig(max_new_tokens=9, temperature=0))
    targets = response_targets(batch)
    shapes = []
    handle = teacher.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(out.numel()))
    recorder = StageRecorder(Clock("cpu"), time_forwards=False)
    try:
        config = TeacherCacheConfig(mode=mode, top_k=6, micro_batch_size=2, chunk_size=4)
        cache = build_teacher_cache(teacher, targets, config, recorder=recorder)
    finally:
        handle.remove()
    assert max(shapes) <= 4 * 259, "the device never holds more than chunk x V logits"
    with torch.no_grad():
        positions = position_ids(batch.attention_mask)  # the convention every forward here uses
        full = teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=positions).logits[:, targets.window]
    if mode == "full":
        torch.testing.assert_close(cache.values, full, rtol=1e-5, atol=1e-5)
        assert cache.nbytes == full.numel() * 4
    else:
        top = torch.topk(full, 6, dim=-1)  # the cache holds their log-probabilities over the whole vocabulary
        torch.testing.assert_close(cache.values, top.values - full.logsumexp(-1, keepdim=True), rtol=1e-5, atol=1e-5)
        assert torch.equal(cache.indices.long(), top.indices)
        assert cache.nbytes == top.values.numel() * 4 + top.indices.numel() * 4
    stages = recorder.resolve().stages
    assert stages["teacher_forward"] > 0 and stages["cache_write"] >= 0


def test_teacher_cache_buffers_are_reused_from_step_to_step(tiny_models):
    teacher = tiny_models["gpt2-tiny"]
    buffers = TeacherCacheBuffers()
    batches = [rollout_batch(chain_table(16, {}), [[5, 6], [7]], max_new=m) for m in (6, 4, 6)]
    caches = []
    for batch in batches:
        cache = build_teacher_cache(teacher, response_targets(batch), TeacherCacheConfig(mode="topk", top_k=3),
                                    buffers=buffers)
        caches.append((cache.values.data_ptr(), cache.indices.data_ptr(), cache.values.shape))
    assert caches[0][:2] == caches[1][:2] == caches[2][:2], "a smaller or equal cache reuses the first buffers"
    assert buffers.nbytes == caches[0][2].numel() * 8


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_opsd_steps_run_and_the_loss_falls(tiny_models, tokenizer, zero_stage):
    teacher = copy.deepcopy(PRESETS["qwen2-tiny"].build())
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10)  # a confident teacher, so there is something to learn
    engine = build_engine(copy.deepcopy(tiny_models["llama-tiny"]), zero_stage, lr=1e-2)
    rollout = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
    enc = tokenizer(["The student writes", "hi there", "distil"], padding=True, return_tensors="pt")
    request = RolloutRequest(enc.input_ids, enc.attention_mask)
    sampling = SamplingConfig(max_new_tokens=12, n_samples_per_prompt=2, temperature=0)
    profiles = [opsd_step(engine, teacher, rollout, request, sampling, divergence=DivergenceConfig(loss="forward_kl"))
                for _ in range(5)]
    losses = [p.loss for p in profiles]
    assert losses[-1] < losses[0] and sum(losses[-2:]) < sum(losses[:2]), losses
    for p in profiles:
        parts = (p.eval_ms + p.rollout_ms + p.train_ms + p.teacher_forward_ms + p.cache_write_ms
                 + p.student_forward_ms + p.loss_ms + p.backward_ms + p.optimizer_ms)
        assert parts <= p.total_ms + 1e-6 and 0 < p.rollout_share < 1
        assert p.rollout is not None and p.rollout.zero_stage == zero_stage
        assert p.response_tokens > 0 and p.teacher_cache_bytes > 0
        assert set(p.peak_memory_bytes) >= {"rollout", "teacher", "backward"}
    assert engine.module.training  # train() restored after the rollout


def test_teacher_cache_from_a_zero3_teacher_engine_matches_the_bare_teacher(tiny_models):
    teacher = tiny_models["qwen2-tiny"]
    engine = build_engine(copy.deepcopy(teacher), 3)
    batch = rollout_batch(chain_table(16, {}), [[5, 6], [7]], max_new=4)
    batch.input_ids.clamp_(max=15)  # token ids of the 16-token table are valid for the 259-token teacher
    targets = response_targets(batch)
    config = TeacherCacheConfig(mode="topk", top_k=5, micro_batch_size=3, chunk_size=2)
    from_engine = build_teacher_cache(engine, targets, config, buffers=TeacherCacheBuffers())
    from_model = build_teacher_cache(teacher, targets, config, buffers=TeacherCacheBuffers())
    torch.testing.assert_close(from_engine.values, from_model.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(from_engine.indices, from_model.indices)


def test_teacher_cache_applies_final_logit_softcapping_like_the_model():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0,
                          max_position_embeddings=64, sliding_window=64)
    torch.manual_seed(0)
    teacher = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(50)  # logits well past the cap, so capping changes them
    batch = rollout_batch(chain_table(16, {}), [[5, 6], [7]], max_new=4)
    targets = response_targets(batch)
    cache = build_teacher_cache(teacher, targets, TeacherCacheConfig(mode="full", chunk_size=2))
    with torch.no_grad():
        full = teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=position_ids(batch.attention_mask)).logits[:, targets.window]
    assert full.abs().max() <= 2.0 + 1e-5
    torch.testing.assert_close(cache.values, full, rtol=1e-4, atol=1e-4)
