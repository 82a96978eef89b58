"""On-policy self-distillation in the step: the teacher scores the student's responses after its own prompts
(``teacher_request``: a privileged context, the reference), and the student is its own teacher (``SelfTeacher``:
its starting weights, a LoRA student's base with the adapters off, or its live weights without gradient).

Every response position must meet its twin: the teacher's cache is checked token by token against a teacher forward
built by hand, one row at a time, on the unpadded teacher prompt followed by the row's real response tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from opsd_rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from opsd_rollout.opsd import DivergenceConfig, OPSDStep, TeacherCacheConfig, build_teacher_cache, opsd_step
from opsd_rollout.opsd.self_teacher import SelfTeacher
from opsd_rollout.opsd.targets import reprompted, response_targets
from opsd_rollout.opsd.teacher import TeacherCacheBuffers
from test_fused_loss import sgd_engine

STUDENT_PROMPTS = ["Add 12 and 30.", "hi", "What is 7 plus 8?"]
TEACHER_PROMPTS = ["Add 12 and 30.\nA reference solution: 42\nNow solve it yourself:\n", "hi, answer: hello\n",
                   "What is 7 plus 8? (15)\n"]
SAMPLING = SamplingConfig(max_new_tokens=9, n_samples_per_prompt=2, temperature=1.0)


def encode(tokenizer, texts) -> RolloutRequest:
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return RolloutRequest(enc.input_ids, enc.attention_mask)


def hand_built_teacher_logprobs(teacher, tokenizer, targets, n, teacher_prompts) -> list[torch.Tensor]:
    """Per response row: the teacher's log-probabilities [r, V] of the row's real response tokens, from one unpadded
    forward on (its teacher prompt, its response up to the last real token)."""
    out = []
    for row in range(targets.labels.shape[0]):
        prompt = tokenizer(teacher_prompts[row // n])["input_ids"]
        response = targets.labels[row][targets.mask[row]].tolist()
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = teacher(input_ids=ids).logits[0].float()
        out.append(torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(response)], dim=-1))
    return out


def with_eos_inside(batch, tokenizer):
    """The batch with row 1's response ended early by an EOS (later columns padding, masked), so the rows' lengths
    differ inside the batch."""
    start = int(batch.response_start_idx[0])
    ids, mask = batch.input_ids.clone(), batch.attention_mask.clone()
    ids[1, start + 2] = tokenizer.eos_token_id
    ids[1, start + 3:] = tokenizer.pad_token_id
    mask[1, start + 3:] = 0
    return type(batch)(input_ids=ids, attention_mask=mask, response_start_idx=batch.response_start_idx)


def multi_turn_prompts(tokenizer) -> tuple[list[str], list[str]]:
    """Student and teacher prompts of three multi-turn chats, rendered as training renders them: the teacher's with
    the reference filled into the last user turn (``data.context_prompt``)."""
    from opsd_rollout.train.data import context_prompt, render_messages

    chats = [[{"role": "system", "content": "You add."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 12+30?"}],
             [{"role": "user", "content": "hi"}],
             [{"role": "user", "content": "7+8?"}, {"role": "assistant", "content": "It is"}]]  # continued
    template = "{prompt}\nReference: {reference}\nNow you."
    students = [render_messages(chat, tokenizer).prompt for chat in chats]
    teachers = [context_prompt(template, None, answer, chat, tokenizer) for chat, answer in zip(chats, ["42", "hello",
                                                                                                          " 15"])]
    return students, teachers


@pytest.mark.parametrize("kind", ["text", "multi-turn chat"])
def test_the_teacher_scores_each_response_token_after_its_own_prompt(tiny_models, tokenizer, kind):
    """Left-padded prompts of other lengths on the two sides, two samples a prompt, an EOS inside the batch, text or
    multi-turn chat: the cache of the reprompted targets is, position by position, the hand-built teacher's
    log-probabilities of the same tokens; padding positions are masked on both sides."""
    students, teachers = (STUDENT_PROMPTS, TEACHER_PROMPTS) if kind == "text" else multi_turn_prompts(tokenizer)
    assert all(len(t) > len(s) for s, t in zip(students, teachers))
    student, teacher = tiny_models["llama-tiny"], tiny_models["llama-tiny"]
    rollout = HybridEngineRollout(student, tokenizer)
    batch = with_eos_inside(rollout.generate(encode(tokenizer, students), SAMPLING, seed=3), tokenizer)
    targets = response_targets(batch)
    theirs = encode(tokenizer, teachers)
    n = SAMPLING.n_samples_per_prompt
    scored = reprompted(targets, theirs.prompt_ids.repeat_interleave(n, 0),
                        theirs.prompt_attention_mask.repeat_interleave(n, 0))
    assert scored.prompt_length == theirs.prompt_ids.shape[1] != targets.prompt_length
    assert torch.equal(scored.labels, targets.labels) and torch.equal(scored.mask, targets.mask)
    cache = build_teacher_cache(teacher, scored, TeacherCacheConfig(mode="full", micro_batch_size=2))
    by_hand = hand_built_teacher_logprobs(teacher, tokenizer, targets, n, teachers)
    assert int(targets.mask[1].sum()) == 3  # the EOS row is shorter
    for row, expected in enumerate(by_hand):
        got = torch.log_softmax(cache.values[row][targets.mask[row]].float(), dim=-1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_teacher_prompts_that_are_not_left_padded_or_not_one_a_row_are_refused(tokenizer):
    targets = response_targets(_fake_batch())
    with pytest.raises(ValueError, match="a row for each of the 2 response rows"):
        reprompted(targets, torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long))
    right_padded = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="must be left-padded"):
        reprompted(targets, torch.ones(2, 3, dtype=torch.long), right_padded)


def _fake_batch():
    from deepspeed.runtime.rollout.base import RolloutBatch

    ids = torch.tensor([[5, 6, 7, 8], [0, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    return RolloutBatch(input_ids=ids, attention_mask=mask, response_start_idx=torch.tensor([2, 2]))


def test_the_step_with_teacher_prompts_equals_the_step_on_a_cache_built_by_hand(tiny_models, tokenizer):
    """``opsd_step(..., teacher_request=...)``: its loss is the divergence to the cache of the reprompted targets,
    built separately (a whole step on each side, the same seed: the same samples)."""
    student, teacher = tiny_models["llama-tiny"], copy.deepcopy(tiny_models["llama-tiny"])
    with torch.no_grad():
        teacher.lm_head.weight.mul_(3.0)  # another distribution than the student's
    request, theirs = encode(tokenizer, STUDENT_PROMPTS), encode(tokenizer, TEACHER_PROMPTS)
    divergence = DivergenceConfig(loss="reverse_kl", fused=False)
    engine = sgd_engine(copy.deepcopy(student).train(), 0, lr=0.0)
    rollout = HybridEngineRollout(engine, tokenizer)
    reprompt = opsd_step(engine, teacher, rollout, request, SAMPLING, divergence=divergence, seed=5,
                         teacher_request=theirs)
    plain = opsd_step(engine, teacher, rollout, request, SAMPLING, divergence=divergence, seed=5)
    assert reprompt.loss != pytest.approx(plain.loss, rel=1e-3)  # the context changed what the teacher says

    from opsd_rollout.modeling import position_ids
    from opsd_rollout.opsd.divergence import token_divergence

    batch = rollout.generate(request, SAMPLING, seed=5)
    targets = response_targets(batch)
    n = SAMPLING.n_samples_per_prompt
    scored = reprompted(targets, theirs.prompt_ids.repeat_interleave(n, 0),
                        theirs.prompt_attention_mask.repeat_interleave(n, 0))
    cache = build_teacher_cache(teacher, scored, TeacherCacheConfig())
    with torch.no_grad():
        logits = engine(input_ids=targets.input_ids, attention_mask=targets.attention_mask,
                        position_ids=position_ids(targets.attention_mask)).logits[:, targets.window]
    kl = token_divergence(logits.float(), cache.values.float(), divergence)
    expected = float((kl * targets.mask).sum() / targets.mask.sum())
    assert reprompt.loss == pytest.approx(expected, rel=1e-4)


def test_a_teacher_request_of_another_batch_size_is_refused_before_any_work(tiny_models, tokenizer):
    engine = sgd_engine(copy.deepcopy(tiny_models["llama-tiny"]).train(), 0)
    step = OPSDStep(engine=engine, teacher=tiny_models["qwen2-tiny"], rollout=HybridEngineRollout(engine, tokenizer),
                    sampling=SAMPLING)
    with pytest.raises(ValueError, match="one prompt for each of the request's 3 prompts"):
        step(encode(tokenizer, STUDENT_PROMPTS), teacher_request=encode(tokenizer, TEACHER_PROMPTS[:2]))


def test_the_live_self_teacher_is_the_student_now_without_gradient_or_dropout(tiny_models):
    student = copy.deepcopy(tiny_models["llama-tiny"]).train()
    teacher = SelfTeacher.live(student)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        student.eval()
        expected = student(input_ids=ids).logits
        student.train()
    got = teacher(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad and student.training  # put back in train mode
    assert list(teacher.parameters()) == []  # no memory of its own
    with torch.no_grad():
        student.lm_head.weight.mul_(2.0)
    assert not torch.allclose(teacher(input_ids=ids).logits, got)  # it follows the student


def test_the_initial_self_teacher_of_a_full_student_is_a_frozen_copy(tiny_models):
    student = copy.deepcopy(tiny_models["llama-tiny"])
    teacher = SelfTeacher.initial(student)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    before = teacher(input_ids=ids).logits
    with torch.no_grad():
        student.lm_head.weight.mul_(2.0)
    torch.testing.assert_close(teacher(input_ids=ids).logits, before)
    assert sum(p.numel() for p in teacher.parameters()) == sum(p.numel() for p in student.parameters())
    assert not any(p.requires_grad for p in teacher.parameters())


def test_the_initial_self_teacher_of_a_lora_student_is_its_base_with_the_adapters_off(tiny_models):
    peft = pytest.importorskip("peft")
    base = copy.deepcopy(tiny_models["llama-tiny"])
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    student = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                        init_lora_weights=False))  # adapters that change outputs
    with torch.no_grad():
        adapted = student(input_ids=ids).logits
    assert not torch.allclose(adapted, expected)
    teacher = SelfTeacher.initial(student)
    torch.testing.assert_close(teacher(input_ids=ids).logits, expected)
    assert list(teacher.parameters()) == []  # the base is the student's: no second copy
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids=ids).logits, adapted)  # adapters back on after


def test_a_step_distils_the_student_from_itself_with_the_reference_in_context(tiny_models, tokenizer):
    """The self-teacher's loss is not zero (its context differs), no warning of a teacher with the student's weights,
    no teacher memory counted for the live and LoRA teachers, and the update moves the student."""
    student = copy.deepcopy(tiny_models["llama-tiny"]).train()
    engine = sgd_engine(student, 0, lr=0.5)
    teacher = SelfTeacher.initial(engine.module)
    rollout = HybridEngineRollout(engine, tokenizer)
    before = engine.module.lm_head.weight.detach().clone()
    profile = opsd_step(engine, teacher, rollout, encode(tokenizer, STUDENT_PROMPTS), SAMPLING, seed=1,
                        teacher_request=encode(tokenizer, TEACHER_PROMPTS))
    assert profile.loss > 0 and not torch.equal(engine.module.lm_head.weight, before)
    assert profile.teacher_parameter_bytes == sum(p.numel() * 4 for p in teacher.parameters())
    live = opsd_step(engine, SelfTeacher.live(engine.module), rollout, encode(tokenizer, STUDENT_PROMPTS), SAMPLING,
                     seed=1, teacher_request=encode(tokenizer, TEACHER_PROMPTS))
    assert live.loss > 0 and live.teacher_parameter_bytes == 0


def test_the_buffers_are_reused_across_reprompted_steps(tiny_models, tokenizer):
    engine = sgd_engine(copy.deepcopy(tiny_models["llama-tiny"]).train(), 0, lr=0.0)
    step = OPSDStep(engine=engine, teacher=SelfTeacher.live(engine.module),
                    rollout=HybridEngineRollout(engine, tokenizer), sampling=SAMPLING)
    first = step(encode(tokenizer, STUDENT_PROMPTS), seed=2, teacher_request=encode(tokenizer, TEACHER_PROMPTS))
    second = step(encode(tokenizer, STUDENT_PROMPTS), seed=2, teacher_request=encode(tokenizer, TEACHER_PROMPTS))
    assert first.loss == pytest.approx(second.loss, rel=1e-6)  # lr 0: the same step twice
    assert isinstance(step.state.buffers, TeacherCacheBuffers) and step.state.buffers.nbytes > 0
