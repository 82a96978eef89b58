"""The fused LM head + divergence: the same loss and gradients (hidden states, head weight, bias) as the unfused
reference for every loss, beta, temperature, top-k cache, clip and logit transform, with masked and padded
rows; logits never whole; DeepSpeed's ``generalized_jsd_loss`` on materialized logits agrees; and a whole
``opsd_step`` gives the unfused step's loss and parameter update on ZeRO-0 and ZeRO-3."""

from __future__ import annotations

import copy
import itertools
import logging
import zlib

import deepspeed
import pytest
import torch
from deepspeed.runtime.rollout import generalized_jsd_loss as deepspeed_loss
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from opsd_rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from opsd_rollout.deepspeed_engine import deepspeed_config, init_distributed
from opsd_rollout.opsd import DivergenceConfig, TeacherCacheConfig, chunked_divergence, opsd_step
from opsd_rollout.opsd.fused import chunk_tokens, fused_divergence, fusion_problem, head_divergence
from opsd_rollout.rollout.linears import forwards_replaced

N, R, H, V = 3, 7, 8, 19


def problem(seed: int, dtype=torch.float64, bias: bool = False):
    """Hidden states, head and teacher logits; row 1 wholly masked (a row that never trains), row 2 padded
    after its fourth token (a response that ended at EOS)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, R, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.7
    head_bias = torch.randn(V, generator=g, dtype=dtype) if bias else None
    teacher = torch.randn(N, R, V, generator=g, dtype=dtype) * 2
    mask = torch.rand(N, R, generator=g) > 0.25
    mask[1] = False
    mask[2, 4:] = False
    return hidden, weight, head_bias, teacher, mask


def run(hidden, weight, bias, teacher, mask, config, *, fused: bool, scale=1.0, cap=None):
    """The loss (sum / count) and its gradients w.r.t. hidden, weight and bias, fused or by the reference
    (whole logits, the model's transform, then ``chunked_divergence``)."""
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    if fused:
        total, count = fused_divergence(h, w, b, teacher, mask, config, logit_scale=scale, softcap=cap)
    else:
        logits = torch.nn.functional.linear(h, w, b) * scale
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if isinstance(teacher, tuple):
            values, indices = teacher
            chunk = lambda s, e: (values[:, s:e], indices[:, s:e])  # noqa: E731
        else:
            chunk = lambda s, e: teacher[:, s:e]  # noqa: E731
        total, count = chunked_divergence(logits, chunk, mask, config)
    (total / count).backward()
    return total.detach(), count, [t.grad if t is not None else None for t in leaves]


def assert_same(reference, fused, rtol=1e-9, atol=1e-12):
    torch.testing.assert_close(fused[0], reference[0], rtol=rtol, atol=atol)
    assert float(fused[1]) == float(reference[1])
    for ref_grad, fused_grad in zip(reference[2], fused[2]):
        if ref_grad is not None:
            torch.testing.assert_close(fused_grad, ref_grad, rtol=rtol, atol=atol)


LOSSES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 0.5), ("jsd", 1.0)]


@pytest.mark.parametrize("loss,beta", LOSSES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("top_k", [None, 1, 5, V])
@pytest.mark.parametrize("clip", [None, 0.0, 0.02])
def test_loss_and_gradients_equal_the_unfused_reference(loss, beta, temperature, top_k, clip):
    hidden, weight, _, teacher, mask = problem(zlib.crc32(repr((loss, beta, temperature, top_k, clip)).encode()))
    if top_k is not None:
        teacher = tuple(torch.topk(teacher, top_k, dim=-1))
    config = DivergenceConfig(loss=loss, beta=beta, temperature=temperature, pointwise_clip=clip,
                              fused_chunk_tokens=4)
    reference = run(hidden, weight, None, teacher, mask, config, fused=False)
    assert_same(reference, run(hidden, weight, None, teacher, mask, config, fused=True))
    assert reference[2][0][1].abs().max() == 0, "a masked row gets no gradient"


@pytest.mark.parametrize("top_k", [None, 4])
@pytest.mark.parametrize("scale,cap", [(1.0, None), (0.25, None), (1.0, 1.5), (3.0, 2.0)])
def test_head_bias_and_the_models_logit_transform_are_differentiated_like_the_model(top_k, scale, cap):
    """Cohere/Granite scale their logits, Gemma 2 soft-caps them: the fused loss applies both and their
    derivatives; a bias gets its gradient too."""
    hidden, weight, bias, teacher, mask = problem(11, bias=True)
    if top_k is not None:
        teacher = tuple(torch.topk(teacher, top_k, dim=-1))
    config = DivergenceConfig(loss="jsd", beta=0.4, temperature=1.3, pointwise_clip=0.05, fused_chunk_tokens=3)
    reference = run(hidden, weight, bias, teacher, mask, config, fused=False, scale=scale, cap=cap)
    assert_same(reference, run(hidden, weight, bias, teacher, mask, config, fused=True, scale=scale, cap=cap))


@pytest.mark.parametrize("top_k", [None, 6])
def test_weighted_masks_are_used_as_given(top_k):
    """As DeepSpeed's mask: 0 leaves a token out, other values weigh it."""
    hidden, weight, _, teacher, mask = problem(12)
    weights = mask * torch.rand(N, R, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    teacher = tuple(torch.topk(teacher, top_k, dim=-1)) if top_k else teacher
    config = DivergenceConfig(beta=0.5, fused_chunk_tokens=5)
    assert_same(run(hidden, weight, None, teacher, weights, config, fused=False),
                run(hidden, weight, None, teacher, weights, config, fused=True))


@pytest.mark.parametrize("top_k", [None, 5])
def test_bfloat16_heads_compute_the_divergence_in_float32(top_k):
    """A bf16 model: the logits come out of the head in bf16 (as the model's own head gives them), everything
    after in float32; the loss is float32 and the gradients come back in bf16, close to the reference's."""
    hidden, weight, _, teacher, mask = problem(13, dtype=torch.float32)
    teacher = tuple(torch.topk(teacher, top_k, dim=-1)) if top_k else teacher
    config = DivergenceConfig(beta=0.5, temperature=1.5, fused_chunk_tokens=4)
    low = hidden.bfloat16(), weight.bfloat16()
    reference = run(*low, None, teacher, mask, config, fused=False)
    fused = run(*low, None, teacher, mask, config, fused=True)
    assert fused[0].dtype == torch.float32 and fused[2][0].dtype == fused[2][1].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-5, atol=1e-5)
    for ref_grad, fused_grad in zip(reference[2][:2], fused[2][:2]):
        torch.testing.assert_close(fused_grad.float(), ref_grad.float(), rtol=2e-2, atol=2e-4)


def test_chunking_changes_nothing_and_no_grad_skips_the_gradients():
    hidden, weight, _, teacher, mask = problem(14)
    results = [run(hidden, weight, None, teacher, mask, DivergenceConfig(beta=0.2, fused_chunk_tokens=c), fused=True)
               for c in (1, 2, 7, 1000)]
    for other in results[1:]:
        assert_same(results[0], other, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        total, count = fused_divergence(hidden, weight, None, teacher, mask, DivergenceConfig(beta=0.2))
    torch.testing.assert_close(total, results[0][0], rtol=1e-12, atol=1e-14)
    assert chunk_tokens(DivergenceConfig(), 151936, 896, None) == (32 << 20) // (4 * 151936)
    assert chunk_tokens(DivergenceConfig(), 151936, 896, 64) == (32 << 20) // (4 * 64 * 896)
    assert chunk_tokens(DivergenceConfig(fused_chunk_tokens=3), 151936, 896, None) == 3


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator produced (views excluded: they allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for item in tree_leaves(out):
            if isinstance(item, torch.Tensor):
                self.largest = max(self.largest, item.numel())
        return out


@pytest.mark.parametrize("top_k", [None, 3])
def test_the_logits_are_never_whole(top_k):
    """Forward and backward produce nothing with [N, R, V] elements: at most a chunk's logits or the [V, H] head
    gradient (with top-k not even a chunk's full logits)."""
    g = torch.Generator().manual_seed(15)
    rows, window, size, vocab = 4, 16, 4, 97  # [N * R, V] is 6,208 elements, the head 388
    hidden = torch.randn(rows, window, size, generator=g).requires_grad_()
    weight = (torch.randn(vocab, size, generator=g) * 0.5).requires_grad_()
    teacher = torch.randn(rows, window, vocab, generator=g)
    teacher = tuple(torch.topk(teacher, top_k, dim=-1)) if top_k else teacher
    with LargestTensor() as probe:
        total, count = fused_divergence(hidden, weight, None, teacher, torch.ones(rows, window),
                                        DivergenceConfig(fused_chunk_tokens=8))
        total.backward()
    bound = vocab * size if top_k else 8 * vocab
    assert probe.largest <= max(bound, rows * window * size), probe.largest
    assert probe.largest < rows * window * vocab


@pytest.mark.parametrize("beta,top_k,clip", [(0.5, None, None), (0.0, 5, 0.02), (1.0, None, 0.01), (0.3, 8, None)])
def test_deepspeeds_loss_over_materialized_logits_agrees(beta, top_k, clip):
    """DeepSpeed's ``generalized_jsd_loss`` over ``hidden @ W.T`` and the teacher's whole logits: the same value
    and gradients (a top-k cache holds what DeepSpeed's ``teacher_top_k`` selects)."""
    hidden, weight, _, teacher, mask = problem(16)
    theirs_h, theirs_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    theirs = deepspeed_loss(theirs_h @ theirs_w.T, teacher, mask, beta=beta, temperature=1.5, teacher_top_k=top_k,
                            pointwise_clip=clip)
    theirs.loss.backward()
    cache = tuple(torch.topk(teacher, top_k, dim=-1)) if top_k else teacher
    config = DivergenceConfig(beta=beta, temperature=1.5, pointwise_clip=clip, fused_chunk_tokens=4)
    total, count, (grad_h, grad_w, _) = run(hidden, weight, None, cache, mask, config, fused=True)
    torch.testing.assert_close(total, theirs.loss_sum, rtol=1e-9, atol=1e-12)
    assert int(count) == int(theirs.valid_token_count)
    torch.testing.assert_close(grad_h, theirs_h.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_w, theirs_w.grad, rtol=1e-9, atol=1e-12)


def test_bad_shapes_are_refused_naming_the_argument():
    hidden, weight, _, teacher, mask = problem(17)
    config = DivergenceConfig()
    with pytest.raises(ValueError, match=r"weight must be \[V, 8\]"):
        fused_divergence(hidden, weight[:, :5], None, teacher, mask, config)
    with pytest.raises(ValueError, match=r"bias must be \[19\]"):
        fused_divergence(hidden, weight, torch.zeros(5, dtype=weight.dtype), teacher, mask, config)
    with pytest.raises(ValueError, match=r"teacher must be \[3, 7, 19\]"):
        fused_divergence(hidden, weight, None, teacher[:, :4], mask, config)
    with pytest.raises(ValueError, match=r"teacher must be two \[3, 7, k\]"):
        fused_divergence(hidden, weight, None, (teacher[..., :3], teacher[..., :4].long()), mask, config)
    with pytest.raises(ValueError, match=r"mask must be \[3, 7\]"):
        fused_divergence(hidden, weight, None, teacher, mask[:, :4], config)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="fused_chunk_tokens must be an int >= 1"):
            DivergenceConfig(fused_chunk_tokens=bad)


class ScaledHead(torch.nn.Linear):
    """A head that is not a plain Linear: it computes something else, so the fused loss must not stand in."""

    def forward(self, x):
        return super().forward(x) * 2


def test_models_the_fused_loss_cannot_take_are_named(tiny_models):
    assert fusion_problem(tiny_models["llama-tiny"]) is None
    model = copy.deepcopy(tiny_models["llama-tiny"])
    model.lm_head = ScaledHead(64, 259, bias=False)
    assert "ScaledHead, not a plain torch.nn.Linear" in fusion_problem(model)
    with pytest.raises(ValueError, match="fused=False"):
        head_divergence(model, torch.zeros(1, 1, 64), torch.zeros(1, 1, 259), torch.ones(1, 1), DivergenceConfig())


def sgd_engine(model, zero_stage: int, lr: float = 0.5):
    """A DeepSpeed engine with plain SGD: its update is ``-lr * grad``, so equal updates mean equal gradients
    (Adam's first step is ``-lr * sign(grad)``, which would hide gradient differences or blow up noise)."""
    init_distributed()
    config = deepspeed_config(zero_stage, lr=lr)
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True  # plain SGD is fine under ZeRO
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=lr), config=config)
    return engine


def parameters(engine, zero_stage: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=zero_stage == 3):
            out[name] = param.detach().clone()
    return out


def one_step(student, teacher, tokenizer, zero_stage, divergence, cache):
    engine = sgd_engine(copy.deepcopy(student), zero_stage)
    rollout = HybridEngineRollout(engine, tokenizer)
    enc = tokenizer(["The student writes", "hi"], padding=True, return_tensors="pt")
    sampling = SamplingConfig(max_new_tokens=7, n_samples_per_prompt=2, temperature=0)
    profile = opsd_step(engine, teacher, rollout, RolloutRequest(enc.input_ids, enc.attention_mask), sampling,
                        divergence=divergence, teacher_cache=cache)
    return profile, parameters(engine, zero_stage)


@pytest.mark.parametrize("zero_stage,student_name,cache", [
    (0, "qwen2-tiny", TeacherCacheConfig(mode="full")),
    (0, "gpt2-tiny", TeacherCacheConfig(mode="topk", top_k=7)),   # tied embeddings: the head is the embedding
    (3, "llama-tiny", TeacherCacheConfig(mode="full")),
    (3, "gpt2-tiny", TeacherCacheConfig(mode="topk", top_k=7)),
])
def test_a_fused_step_equals_the_unfused_step(tiny_models, tokenizer, zero_stage, student_name, cache):
    """The same rollout (greedy), the same loss and the same parameter update, every parameter, ZeRO-3's
    partitioned head gathered for the fused forward and backward."""
    student = copy.deepcopy(tiny_models[student_name]).train()
    teacher = copy.deepcopy(tiny_models["qwen2-tiny" if student_name == "llama-tiny" else "llama-tiny"])
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10)  # a confident teacher: gradients well above rounding
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    divergence = dict(loss="jsd", beta=0.3, temperature=1.2, pointwise_clip=0.05)
    reference, reference_params = one_step(student, teacher, tokenizer, zero_stage,
                                           DivergenceConfig(**divergence, fused=False), cache)
    fused, fused_params = one_step(student, teacher, tokenizer, zero_stage,
                                   DivergenceConfig(**divergence, fused=True, fused_chunk_tokens=5), cache)
    assert fused.fused_loss and not reference.fused_loss
    assert reference.loss > 1e-3 and fused.loss == pytest.approx(reference.loss, rel=1e-5)
    assert_same_update(before, reference_params, fused_params)


def assert_same_update(before: dict, reference_params: dict, fused_params: dict) -> None:
    """Every parameter moved alike by both steps, and at least three of them moved."""
    moved = 0
    for name, value in reference_params.items():
        reference_update, fused_update = value - before[name], fused_params[name] - before[name]
        scale = float(reference_update.abs().max())
        # tolerance: 1e-4 of the update, plus the parameters' own rounding (an ulp of 0.1 is 7e-9)
        torch.testing.assert_close(fused_update, reference_update, rtol=1e-4, atol=1e-4 * scale + 2e-8, msg=name)
        moved += int(scale > 1e-6)
    assert moved >= 3, "the step moved the student (head, body), so equal updates mean something"


def test_a_student_whose_head_cannot_be_fused_runs_the_reference_with_a_warning(tiny_models, tokenizer, caplog):
    student = copy.deepcopy(tiny_models["llama-tiny"]).train()
    student.lm_head = ScaledHead(64, 259, bias=False)
    with caplog.at_level(logging.WARNING, logger="opsd_rollout.opsd.step"):
        profile, _ = one_step(student, tiny_models["qwen2-tiny"], tokenizer, 0, DivergenceConfig(fused=True),
                              TeacherCacheConfig(mode="topk", top_k=4))
    assert not profile.fused_loss and profile.loss > 0
    assert "the fused loss cannot run on this student" in caplog.text


@pytest.mark.parametrize("cap", [None, 2.0])
def test_head_divergence_uses_the_models_own_head_and_transform(tiny_models, cap):
    """Through the model: its head's weight and its config's soft cap, as its forward applies them."""
    model = copy.deepcopy(tiny_models["qwen2-tiny"])
    model.config.final_logit_softcapping = cap
    g = torch.Generator().manual_seed(18)
    hidden = torch.randn(2, 5, 64, generator=g)
    teacher = torch.randn(2, 5, 259, generator=g)
    mask = torch.ones(2, 5)
    total, count = head_divergence(model, hidden, teacher, mask, DivergenceConfig(beta=0.5))
    logits = model.lm_head(hidden)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    expected, _ = chunked_divergence(logits, lambda s, e: teacher[:, s:e], mask, DivergenceConfig(beta=0.5))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert float(count) == 10
    assert "forward" not in model.lm_head.__dict__, "the head's own forward is back"


def test_a_head_with_someone_elses_forward_still_gets_the_loss_and_its_forward_back(tiny_models):
    """The fused loss needs its forward in the head's call, so it replaces an instance forward another library put
    there (where the decode loop's swaps leave one alone), and puts that one back after."""
    model = copy.deepcopy(tiny_models["qwen2-tiny"])
    theirs = model.lm_head.forward  # a bound method set on the instance, as a wrapping library would
    model.lm_head.forward = theirs
    g = torch.Generator().manual_seed(19)
    hidden, teacher, mask = torch.randn(1, 3, 64, generator=g), torch.randn(1, 3, 259, generator=g), torch.ones(1, 3)
    total, _ = head_divergence(model, hidden, teacher, mask, DivergenceConfig(beta=0.5))
    expected, _ = chunked_divergence(model.lm_head(hidden), lambda s, e: teacher[:, s:e], mask,
                                     DivergenceConfig(beta=0.5))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert model.lm_head.__dict__["forward"] is theirs
    with forwards_replaced([(model.lm_head, lambda states: states)]):  # the decode loop's swap leaves it alone
        assert model.lm_head.forward is theirs


ALL = list(itertools.product([0.0, 0.5, 1.0], [None, 3]))


@pytest.mark.parametrize("beta,top_k", ALL)
def test_divergences_are_non_negative_and_zero_when_the_student_is_the_teacher(beta, top_k):
    hidden, weight, _, _, mask = problem(19)
    teacher = hidden @ weight.T
    teacher = tuple(torch.topk(teacher, top_k, dim=-1)) if top_k else teacher
    total, count = fused_divergence(hidden, weight, None, teacher, mask, DivergenceConfig(beta=beta))
    assert abs(float(total)) < 1e-12
    other = torch.randn(N, R, V, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    total, _ = fused_divergence(hidden, weight, None, other, mask, DivergenceConfig(beta=beta))
    assert float(total) > 0
