"""The sampled-token reverse KL (k1/k3) and the ``sampled`` teacher cache: values and gradients against the formulas
and against autograd over materialized logits (masked and padded rows included), the fused LM head, the cache's 4
bytes a token, whole OPSD steps under ZeRO-0 and ZeRO-3, and the pairings refused before any work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.opsd import DivergenceConfig, TeacherCacheConfig, build_teacher_cache, opsd_step
from opsd_rollout.opsd.sampled import (estimate, fused_sampled_divergence, sampled_divergence, token_loss,
                                       token_loss_and_grad)
from opsd_rollout.opsd.targets import response_targets


def test_the_estimators_are_the_formulas():
    lp, lq = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    r = lp - lq
    torch.testing.assert_close(estimate(lp, lq, "k1"), r)
    torch.testing.assert_close(estimate(lp, lq, "k3"), torch.exp(-r) - 1 + r)
    assert bool((estimate(lp, lq, "k3") >= 0).all())


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_on_policy_the_loss_is_the_estimate_with_the_estimators_gradient(estimator):
    lp = torch.tensor([-1.0, -2.0, -0.3], requires_grad=True)
    lq = torch.tensor([-1.5, -1.0, -0.9])
    loss = token_loss(lp, lq, None, estimator)
    torch.testing.assert_close(loss.detach(), estimate(lp, lq, estimator))  # rho = 1
    loss.sum().backward()
    r = (lp - lq).detach()
    # k1: the advantage -r as a policy gradient; k3: verl's estimator differentiated, 1 - exp(-r)
    torch.testing.assert_close(lp.grad, r if estimator == "k1" else 1 - torch.exp(-r))
    value, grad = token_loss_and_grad(lp.detach(), lq, None, estimator)  # the fused path's closed form
    torch.testing.assert_close(value, loss.detach())
    torch.testing.assert_close(grad, lp.grad)


def test_sampled_gradients_estimate_the_kls_gradients():
    """Over many samples of one position: k1's gradient is the reverse KL's, k3's the forward KL's; k3 as a
    stop-gradient advantage (not what we train) would be neither, and points away from the teacher here."""
    torch.manual_seed(0)
    z = torch.randn(6, dtype=torch.float64, requires_grad=True)
    lq = torch.log_softmax(torch.randn(6, dtype=torch.float64) * 2, -1)
    def kl_gradient(direction: str) -> torch.Tensor:
        lp = torch.log_softmax(z, -1)
        kl = lp.exp() * (lp - lq) if direction == "reverse" else lq.exp() * (lq - lp)
        return torch.autograd.grad(kl.sum(), z)[0]

    reverse, forward = kl_gradient("reverse"), kl_gradient("forward")
    y = torch.multinomial(torch.softmax(z, -1).detach(), 400_000, replacement=True, generator=torch.Generator().manual_seed(1))
    grads = {}
    for estimator in ("k1", "k3"):
        logp = torch.log_softmax(z, -1)[y]
        grads[estimator] = torch.autograd.grad(token_loss(logp, lq[y], None, estimator).mean(), z)[0]
    torch.testing.assert_close(grads["k1"], reverse, atol=0.01, rtol=0.05)
    torch.testing.assert_close(grads["k3"], forward, atol=0.01, rtol=0.05)
    logp = torch.log_softmax(z, -1)[y]
    as_advantage = torch.autograd.grad((estimate(logp, lq[y], "k3") * logp).mean(), z)[0]
    assert float(as_advantage @ reverse) < 0 and float(as_advantage @ forward) < 0


def test_off_policy_the_importance_ratio_weighs_the_estimate():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    lq, lm = torch.tensor([-1.5, -1.0]), torch.tensor([-0.5, -2.5])
    loss = token_loss(lp, lq, lm, "k1")
    rho = torch.exp(lp.detach() - lm)
    torch.testing.assert_close(loss.detach(), (lp.detach() - lq) * rho)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, (lp.detach() - lq) * rho)
    for estimator in ("k1", "k3"):
        lp.grad = None
        loss = token_loss(lp, lq, lm, estimator)
        loss.sum().backward()
        value, grad = token_loss_and_grad(lp.detach(), lq, lm, estimator)
        torch.testing.assert_close(value, loss.detach())
        torch.testing.assert_close(grad, lp.grad)


def _reference(hidden, weight, bias, labels, teacher, mask, estimator, behaviour=None, scale=1.0, cap=None):
    """Autograd over materialized logits."""
    logits = F.linear(hidden, weight, bias) * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return sampled_divergence(logits, labels, teacher, mask, DivergenceConfig(loss="sampled_reverse_kl",
                                                                              estimator=estimator), behaviour)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("off_policy,bias,transform", [(False, False, None), (True, True, None),
                                                       (False, True, (2.0, None)), (False, False, (1.0, 3.0))])
def test_the_fused_head_equals_autograd_over_whole_logits(estimator, off_policy, bias, transform):
    torch.manual_seed(0)
    rows, window, size, vocab = 3, 5, 8, 40
    hidden = torch.randn(rows, window, size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, size, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (rows, window))
    teacher = -torch.rand(rows, window, dtype=torch.float64) * 4
    behaviour = -torch.rand(rows, window, dtype=torch.float64) * 4 if off_policy else None
    mask = torch.ones(rows, window)
    mask[0, 3:] = 0  # a row that ended early (padding after EOS)
    mask[2] = 0  # a row with no trained token at all
    scale, cap = transform or (1.0, None)
    expected, count = _reference(hidden, weight, b, labels, teacher, mask, estimator, behaviour, scale, cap)
    grads = torch.autograd.grad(expected, [t for t in (hidden, weight, b) if t is not None])
    config = DivergenceConfig(loss="sampled_reverse_kl", estimator=estimator, fused_chunk_tokens=2)
    got, got_count = fused_sampled_divergence(hidden, weight, b, labels, teacher, mask, config,
                                              behaviour_logp=behaviour, logit_scale=scale, softcap=cap)
    torch.testing.assert_close(got, expected)
    assert got_count == count == 8
    for a, e in zip(torch.autograd.grad(got, [t for t in (hidden, weight, b) if t is not None]), grads):
        torch.testing.assert_close(a, e)


def test_the_sampled_cache_is_the_teachers_log_probability_of_each_token_in_4_bytes(tiny_models, tokenizer):
    teacher = tiny_models["qwen2-tiny"]
    request = synthetic_prompts(2, 6, vocab_size=259, seed=1)
    batch = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer, HybridEngineRolloutConfig(seed=3)).generate(
        request, SamplingConfig(max_new_tokens=7, n_samples_per_prompt=2))
    targets = response_targets(batch)
    sampled = build_teacher_cache(teacher, targets, TeacherCacheConfig(mode="sampled", chunk_size=3))
    full = build_teacher_cache(teacher, targets, TeacherCacheConfig(mode="full"))
    expected = F.log_softmax(full.values.float(), dim=-1).gather(-1, targets.labels.unsqueeze(-1)).squeeze(-1)
    assert sampled.mode == "sampled" and sampled.values.shape == targets.labels.shape
    torch.testing.assert_close(sampled.values, expected)
    assert sampled.nbytes == 4 * targets.labels.numel() and sampled.nbytes * 259 == full.nbytes


@pytest.mark.parametrize("zero_stage,student_name", [(0, "llama-tiny"), (0, "gpt2-tiny"), (3, "llama-tiny")])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_a_fused_step_equals_the_unfused_step(tiny_models, tokenizer, zero_stage, student_name, estimator):
    """The same rollout, loss and parameter update, every parameter (SGD: the update is the gradient), ZeRO-3's
    partitioned head gathered for the fused forward and backward; the cache 4 bytes a response token."""
    import copy

    from test_fused_loss import assert_same_update, one_step

    student = copy.deepcopy(tiny_models[student_name]).train()
    teacher = copy.deepcopy(tiny_models["qwen2-tiny"])
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10)  # a confident teacher: gradients well above rounding
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    cache = TeacherCacheConfig(mode="sampled")
    reference, reference_params = one_step(student, teacher, tokenizer, zero_stage, DivergenceConfig(
        loss="sampled_reverse_kl", estimator=estimator, fused=False), cache)
    fused, fused_params = one_step(student, teacher, tokenizer, zero_stage, DivergenceConfig(
        loss="sampled_reverse_kl", estimator=estimator, fused_chunk_tokens=5), cache)
    assert fused.fused_loss and not reference.fused_loss and fused.teacher_cache_mode == "sampled"
    assert fused.teacher_cache_bytes == 4 * 4 * 7  # 4 rows x 7 response positions x 4 bytes
    assert abs(reference.loss) > 1e-3 and fused.loss == pytest.approx(reference.loss, rel=1e-5)
    assert_same_update(before, reference_params, fused_params)


@pytest.mark.parametrize("divergence,cache,message", [
    (dict(loss="jsd"), "sampled", "needs the teacher's whole distribution"),
    (dict(loss="sampled_reverse_kl"), "full", "use TeacherCacheConfig\\(mode='sampled'\\)"),
])
def test_a_loss_and_a_cache_that_do_not_go_together_are_refused_before_the_rollout(tiny_models, tokenizer,
                                                                                  divergence, cache, message):
    class Untouchable:
        def generate(self, *args):
            raise AssertionError("the rollout ran")

    with pytest.raises(ValueError, match=message):
        opsd_step(tiny_models["llama-tiny"], tiny_models["qwen2-tiny"], Untouchable(), None, None,
                  divergence=DivergenceConfig(**divergence), teacher_cache=TeacherCacheConfig(mode=cache))


@pytest.mark.parametrize("kwargs,message", [(dict(estimator="k2"), "estimator must be one of"),
                                            (dict(loss="sampled_reverse_kl", temperature=2.0), "at temperature 1")])
def test_bad_divergence_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DivergenceConfig(**kwargs)


def test_a_zero3_teacher_of_another_vocabulary_is_refused_before_any_work(tiny_models, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from opsd_rollout.deepspeed_engine import build_engine, build_inference_engine

    other = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    teacher = build_inference_engine(other, 3)
    student = build_engine(__import__("copy").deepcopy(tiny_models["llama-tiny"]).train(), 0)

    class Untouchable:
        def generate(self, *args):
            raise AssertionError("the rollout ran")

    with pytest.raises(ValueError, match=r"teacher's vocabulary \(300 tokens\) differs from the student's \(259\)"):
        opsd_step(student, teacher, Untouchable(), None, None)
