"""Several teachers in one step (``opsd_step(..., teacher={name: teacher}, routes=[...])``): each prompt's rows
scored by its own teacher, in process or served. The routed step's per-teacher losses are those of one-teacher
steps on the same prompts, its loss their token-weighted mean, and its update (plain SGD: the gradient) the one a
step on the summed per-teacher losses takes; bad routes are refused before any work."""

from __future__ import annotations

import copy

import pytest
import torch

from opsd_rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from opsd_rollout.opsd import DivergenceConfig, TeacherCacheConfig, opsd_step
from opsd_rollout.serve import ServeConfig, TeacherServer
from opsd_rollout.opsd import ServedTeacher
from test_fused_loss import sgd_engine

PROMPTS = ["The student writes", "hi", "distillation on policy", "a teacher scores"]
ROUTES = ["a", "b", "a", "b"]
SAMPLING = SamplingConfig(max_new_tokens=7, n_samples_per_prompt=2, temperature=0)


def confident(model, scale: float):
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # distinct teachers, losses well above rounding
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def teachers(tiny_models):
    return {"a": confident(tiny_models["qwen2-tiny"], 10.0), "b": confident(tiny_models["gpt2-tiny"], 6.0)}


def request(tokenizer, indices) -> RolloutRequest:
    enc = tokenizer([PROMPTS[i] for i in indices], padding=True, return_tensors="pt")
    return RolloutRequest(enc.input_ids, enc.attention_mask)


def step(student, teacher, tokenizer, indices, **kwargs):
    engine = sgd_engine(copy.deepcopy(student).train(), 0, lr=0.5)
    profile = opsd_step(engine, teacher, HybridEngineRollout(engine, tokenizer), request(tokenizer, indices),
                        SAMPLING, **kwargs)
    return profile, engine


@pytest.mark.parametrize("divergence,cache", [
    (DivergenceConfig(loss="jsd"), TeacherCacheConfig(mode="full")),
    (DivergenceConfig(loss="sampled_reverse_kl", estimator="k3"), TeacherCacheConfig(mode="sampled")),
], ids=["jsd-full", "sampled-k3"])
def test_each_teachers_loss_is_its_prompts_alone(tiny_models, tokenizer, teachers, divergence, cache):
    student = tiny_models["llama-tiny"]
    routed, _ = step(student, teachers, tokenizer, range(4), routes=ROUTES, divergence=divergence,
                     teacher_cache=cache)
    alone = {name: step(student, teachers[name], tokenizer, [i for i, r in enumerate(ROUTES) if r == name],
                        divergence=divergence, teacher_cache=cache)[0] for name in teachers}
    assert set(routed.teacher_losses) == {"a", "b"}
    for name, profile in alone.items():
        assert routed.teacher_losses[name] == pytest.approx(profile.loss, rel=1e-5)
        assert routed.teacher_tokens[name] == profile.response_tokens
    assert routed.teacher_losses["a"] != pytest.approx(routed.teacher_losses["b"], rel=1e-2)
    mean = sum(routed.teacher_losses[n] * routed.teacher_tokens[n] for n in teachers) / routed.response_tokens
    assert routed.loss == pytest.approx(mean, rel=1e-5)
    record = routed.to_dict()
    assert record["loss/a"] == routed.teacher_losses["a"] and record["response_tokens/b"] == routed.teacher_tokens["b"]


def test_the_routed_update_is_the_summed_losses_gradient(tiny_models, tokenizer, teachers):
    """One teacher for every prompt, routed by name, takes the update of the same teacher given alone."""
    student = tiny_models["llama-tiny"]
    _, routed = step(student, {"a": teachers["a"], "b": teachers["b"]}, tokenizer, range(4), routes=["a"] * 4)
    _, alone = step(student, teachers["a"], tokenizer, range(4))
    for (name, ours), theirs in zip(routed.module.named_parameters(), alone.module.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)


def test_a_served_teacher_and_an_in_process_one_route_alike(tiny_models, tokenizer, teachers):
    served = TeacherServer(ServeConfig(model="gpt2-tiny", port=0), model=teachers["b"], tokenizer=tokenizer).start()
    try:
        mixed = {"a": teachers["a"], "b": ServedTeacher(served.url, tokenizer=tokenizer)}
        cache, divergence = TeacherCacheConfig(mode="topk", top_k=8), DivergenceConfig(loss="jsd", top_k_rest="tail")
        there, _ = step(tiny_models["llama-tiny"], mixed, tokenizer, range(4), routes=ROUTES, divergence=divergence,
                        teacher_cache=cache)
        here, _ = step(tiny_models["llama-tiny"], teachers, tokenizer, range(4), routes=ROUTES,
                       divergence=divergence, teacher_cache=cache)
    finally:
        served.stop()
    assert there.teacher_losses == pytest.approx(here.teacher_losses, rel=1e-5)
    assert there.teacher_latency_ms > 0 and here.teacher_latency_ms == 0


def test_a_served_teacher_routed_no_prompt_is_not_asked(tiny_models, tokenizer, teachers):
    """Every prompt routed to the in-process teacher: the served one (a server that is never started, so a request
    to it would fail) sits the step out, and the step is the in-process teacher's alone."""
    served = ServedTeacher("http://127.0.0.1:9", tokenizer=tokenizer)  # the discard port: nothing answers
    served.connect = lambda vocab: None  # the checks before any work would ask it for its model
    cache = TeacherCacheConfig(mode="topk", top_k=8)
    routed, _ = step(tiny_models["llama-tiny"], {"a": teachers["a"], "b": served}, tokenizer, range(4),
                     routes=["a"] * 4, teacher_cache=cache)
    alone, _ = step(tiny_models["llama-tiny"], teachers["a"], tokenizer, range(4), teacher_cache=cache)
    assert set(routed.teacher_losses) == {"a"} and routed.loss == pytest.approx(alone.loss, rel=1e-5)


class Untouchable:
    def generate(self, *args, **kwargs):
        raise AssertionError("the rollout ran")


@pytest.mark.parametrize("routes,match", [
    (["a", "b", "c", "a"], r"routes name teachers \['c'\] the step was not given; its teachers are \['a', 'b'\]"),
    (["a", "b"], "routes must name one teacher for each of the request's 4 prompts"),
    ("abab", "routes must name one teacher"),
    (None, "routes must name one teacher"),
])
def test_bad_routes_are_refused_before_any_work(tiny_models, tokenizer, teachers, routes, match):
    with pytest.raises(ValueError, match=match):
        opsd_step(tiny_models["llama-tiny"], teachers, Untouchable(), request(tokenizer, range(4)), SAMPLING,
                  routes=routes)


def test_routes_need_named_teachers_and_every_vocabulary_is_checked(tiny_models, tokenizer, teachers):
    with pytest.raises(ValueError, match=r"routes name each prompt's teacher: give teacher as a mapping"):
        opsd_step(tiny_models["llama-tiny"], teachers["a"], Untouchable(), request(tokenizer, range(4)), SAMPLING,
                  routes=ROUTES)
    wide = copy.deepcopy(teachers["b"])
    wide.resize_token_embeddings(300)
    with pytest.raises(ValueError, match=r"teacher 'b''s vocabulary \(300 tokens\) differs from the student's \(259\)"):
        opsd_step(tiny_models["llama-tiny"], {"a": teachers["a"], "b": wide}, Untouchable(),
                  request(tokenizer, range(4)), SAMPLING, routes=ROUTES)
