"""A served teacher (``opsd.served.ServedTeacher``) against our server on loopback (an in-process thread, a free
port, stopped at the end): the cache it builds equals the in-process teacher's (sampled and top-k), and whole OPSD
steps with it equal the in-process steps, at the first step and after five optimizer steps, whether the server gives
the compact answer or vLLM's JSON; the connect-time checks (model, tokenizer, vocabulary), a full cache refused
before any work, and a server that goes away mid-run retried until it is back or the retry time is spent."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from opsd_rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from opsd_rollout.metrics import STEP_STAGES
from opsd_rollout.opsd import (DivergenceConfig, ServedTeacher, StepState, TeacherCacheConfig, build_teacher_cache,
                               opsd_step, response_targets)
from opsd_rollout.serve import EngineLimits, ServeConfig, TeacherServer
from test_fused_loss import sgd_engine


@pytest.fixture(scope="module")
def teacher(tiny_models):
    model = copy.deepcopy(tiny_models["qwen2-tiny"])
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # a confident teacher: losses and gradients well above rounding
    return model


ANSWERS = ("compact", "json")


@pytest.fixture(scope="module")
def servers(teacher, tokenizer):
    """Our server as our client finds it (the compact answer), and as a vLLM server answers (JSON only)."""
    served = {answers: TeacherServer(ServeConfig(model="qwen2-tiny", served_model_name="teacher", port=0,
                                                 limits=EngineLimits(max_batch_tokens=4096),
                                                 compact_answers=answers == "compact"),
                                     model=teacher, tokenizer=tokenizer).start() for answers in ANSWERS}
    yield served
    for one in served.values():
        one.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["compact"]



def request(tokenizer) -> RolloutRequest:
    enc = tokenizer(["The student writes", "hi", "distillation on policy"], padding=True, return_tensors="pt")
    mask = enc.attention_mask.clone()
    mask[2, -4] = 0  # a hole in a prompt: left out of what is sent, as the in-process teacher's mask leaves it
    return RolloutRequest(enc.input_ids, mask)


def rollout_targets(tiny_models, tokenizer):
    batch = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer).generate(
        request(tokenizer), SamplingConfig(max_new_tokens=9, n_samples_per_prompt=2, temperature=1.0), seed=3)
    return response_targets(batch)


@pytest.mark.parametrize("answers", ANSWERS)
@pytest.mark.parametrize("protocol_rows", [1, 4])
def test_the_served_sampled_cache_is_the_in_process_one(servers, teacher, tiny_models, tokenizer, protocol_rows,
                                                        answers):
    targets = rollout_targets(tiny_models, tokenizer)
    config = TeacherCacheConfig(mode="sampled")
    here = build_teacher_cache(teacher, targets, config)
    client = ServedTeacher(servers[answers].url, rows_per_request=protocol_rows, tokenizer=tokenizer)
    there = client.build_cache(targets, config)
    assert client.compact == (answers == "compact")
    assert there.mode == "sampled" and there.values.shape == here.values.shape
    torch.testing.assert_close(there.values[targets.mask], here.values[targets.mask], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("answers", ANSWERS)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_served_top_k_cache_is_the_in_process_one(servers, teacher, tiny_models, tokenizer, answers, dtype):
    """In the cache's own dtype: the compact answer is sent in bfloat16 for a bfloat16 cache, rounded once as the
    in-process cache is."""
    targets = rollout_targets(tiny_models, tokenizer)
    config = TeacherCacheConfig(mode="topk", top_k=6, dtype=dtype)
    here = build_teacher_cache(teacher, targets, config)
    client = ServedTeacher(servers[answers].url, concurrency=2, rows_per_request=2)
    there = client.build_cache(targets, config)
    assert client.compact == (answers == "compact")
    assert there.mode == "topk" and there.indices.shape == here.indices.shape and there.values.dtype == \
        here.values.dtype
    assert torch.equal(there.indices[targets.mask], here.indices[targets.mask])
    torch.testing.assert_close(there.values[targets.mask], here.values[targets.mask], rtol=1e-4, atol=1e-4)


def steps(student, teacher, tokenizer, divergence, cache, count=6) -> list[float]:
    # plain SGD: an update proportional to the gradient (Adam's -lr * sign(grad) on a near-zero gradient would blow
    # float-level teacher differences up to lr-sized ones)
    engine = sgd_engine(copy.deepcopy(student).train(), 0, lr=0.5)
    rollout = HybridEngineRollout(engine, tokenizer)
    sampling = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=2, temperature=0)
    state = StepState()
    return [opsd_step(engine, teacher, rollout, request(tokenizer), sampling, divergence=divergence,
                      teacher_cache=cache, state=state).loss for _ in range(count)]


@pytest.mark.parametrize("answers", ANSWERS)
@pytest.mark.parametrize("divergence,cache", [
    (DivergenceConfig(loss="sampled_reverse_kl", estimator="k1"), TeacherCacheConfig(mode="sampled")),
    (DivergenceConfig(loss="sampled_reverse_kl", estimator="k3"), TeacherCacheConfig(mode="sampled")),
    (DivergenceConfig(loss="forward_kl", top_k_rest="tail"), TeacherCacheConfig(mode="topk", top_k=8)),
    (DivergenceConfig(loss="jsd", beta=0.5, top_k_rest="tail"), TeacherCacheConfig(mode="topk", top_k=8)),
    (DivergenceConfig(loss="reverse_kl"), TeacherCacheConfig(mode="topk", top_k=8)),
], ids=["sampled-k1", "sampled-k3", "forward-tail", "jsd-tail", "reverse-renormalized"])
def test_served_steps_equal_in_process_steps(servers, teacher, tiny_models, tokenizer, divergence, cache, answers):
    """Same weights, same cache mode: the loss at the first step and after five optimizer steps are equal, with
    the compact answer and with vLLM's JSON."""
    student = tiny_models["llama-tiny"]
    here = steps(student, teacher, tokenizer, divergence, cache)
    served = ServedTeacher(servers[answers].url, model="teacher", tokenizer=tokenizer)
    there = steps(student, served, tokenizer, divergence, cache)
    assert served.compact == (answers == "compact")
    assert abs(here[0]) > 1e-3 and here[0] != pytest.approx(here[5], rel=1e-3), "the student learns something"
    assert there[0] == pytest.approx(here[0], rel=1e-5, abs=1e-7)
    assert there[5] == pytest.approx(here[5], rel=1e-5, abs=1e-7)


class Gated(ServedTeacher):
    """A served teacher whose answers wait until the student's forward has started (or 60 s): with the request in
    flight during the forward, they come at once; a step that waited for them before the forward would wait the
    whole minute. ``order`` records which came first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forward_started, self.order, self.armed = threading.Event(), [], False

    def submit(self, *args, **kwargs):
        self.order.append("teacher asked")  # here, in the step's thread: before whatever the step does next
        return super().submit(*args, **kwargs)

    def build_cache(self, *args, **kwargs):
        if self.overlap:  # the forward starts while this waits
            assert self.forward_started.wait(60), "the student's forward never ran while the request was in flight"
        cache = super().build_cache(*args, **kwargs)
        self.order.append("teacher answered")
        return cache


class Arming:
    """A rollout that arms ``teacher``'s gate when it returns: the student's forwards from then on are the step's."""

    def __init__(self, rollout, teacher):
        self.rollout, self.teacher = rollout, teacher

    def generate(self, *args, **kwargs):
        batch = self.rollout.generate(*args, **kwargs)
        self.teacher.armed = True
        return batch

    def get_last_profile(self):
        return self.rollout.get_last_profile()


@pytest.mark.parametrize("overlap", [True, False])
def test_the_teacher_request_is_in_flight_during_the_student_forward(server, tiny_models, tokenizer, overlap):
    """The request goes out after the rollout and the student's forward runs before its answer is waited for (with
    ``overlap=False``, after it); the losses are the same either way, and the profile says how much latency the
    forward hid, its wait the only teacher time among the step's parts."""
    divergence, cache = DivergenceConfig(loss="jsd", top_k_rest="tail"), TeacherCacheConfig(mode="topk", top_k=8)
    sampling = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=2, temperature=0)
    losses = {}
    for gate in sorted({True, overlap}):
        teacher = Gated(server.url, model="teacher", tokenizer=tokenizer, overlap=gate)
        engine = sgd_engine(copy.deepcopy(tiny_models["llama-tiny"]).train(), 0, lr=0.5)

        def started(*_, teacher=teacher):
            if teacher.armed:
                teacher.order.append("student forward")
                teacher.forward_started.set()

        hook = engine.module.register_forward_pre_hook(started)
        try:
            profile = opsd_step(engine, teacher, Arming(HybridEngineRollout(engine, tokenizer), teacher),
                                request(tokenizer), sampling, divergence=divergence, teacher_cache=cache)
        finally:
            hook.remove()
        expected = (["teacher asked", "student forward", "teacher answered"] if gate else
                    ["teacher asked", "teacher answered", "student forward"])
        assert teacher.order == expected
        assert profile.teacher_latency_ms > 0 and profile.teacher_forward_ms == profile.cache_write_ms == 0.0
        assert 0.0 <= profile.teacher_hidden_share <= 1.0
        assert sum(getattr(profile, name) for name in STEP_STAGES) <= profile.total_ms * 1.01 + 0.1
        assert profile.to_dict()["teacher_hidden_share"] == profile.teacher_hidden_share
        losses[gate] = profile.loss
    assert losses[True] == losses[overlap]


class Untouchable:
    def generate(self, *args, **kwargs):
        raise AssertionError("the rollout ran")


def test_a_full_cache_with_a_served_teacher_is_refused_before_any_work(tiny_models):
    nowhere = ServedTeacher("http://127.0.0.1:9", retry_timeout_s=0)  # never contacted
    with pytest.raises(ValueError, match="not its whole vocabulary.*mode='topk'"):
        opsd_step(tiny_models["llama-tiny"], nowhere, Untouchable(), None, None,
                  divergence=DivergenceConfig(loss="forward_kl"), teacher_cache=TeacherCacheConfig(mode="full"))


def test_connect_checks_the_model_the_tokenizer_and_the_vocabulary(server, tokenizer):
    with pytest.raises(ValueError, match=r"serves \['teacher'\], not 'other'"):
        ServedTeacher(server.url, model="other").connect()

    def other_tokenizer(text, add_special_tokens=False):
        return {"input_ids": [t + 1 for t in tokenizer(text, add_special_tokens=False)["input_ids"]]}

    with pytest.raises(ValueError, match="tokenizer .* differs from the student's"):
        ServedTeacher(server.url, tokenizer=other_tokenizer).connect()
    with pytest.raises(ValueError, match=r"vocabulary \(259 tokens.*differs from the student's \(300\)"):
        ServedTeacher(server.url).connect(student_vocab_size=300)
    fine = ServedTeacher(server.url, tokenizer=tokenizer)
    fine.connect(259)
    assert fine.model == "teacher" and fine.vocab_size == 259 and fine.connected


def test_an_unanswering_server_is_retried_with_backoff_then_named(free_port):
    teacher = ServedTeacher(f"http://127.0.0.1:{free_port}", retry_timeout_s=2.0)
    teacher.wire.first_backoff_s = 0.05
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{free_port} did not answer GET /health"):
        teacher.connect()
    assert teacher.wire.retries >= 2


def test_a_server_that_dies_mid_run_is_retried_until_it_is_back(teacher, tokenizer, tiny_models):
    config = ServeConfig(model="qwen2-tiny", port=0)
    first = TeacherServer(config, model=teacher, tokenizer=tokenizer).start()
    port = int(first.url.rsplit(":", 1)[1])
    client = ServedTeacher(first.url, retry_timeout_s=60.0)
    targets = rollout_targets(tiny_models, tokenizer)
    cache = TeacherCacheConfig(mode="sampled")
    before = client.build_cache(targets, cache).values.clone()
    first.stop()
    servers = []

    def come_back():
        time.sleep(0.5)
        servers.append(TeacherServer(ServeConfig(model="qwen2-tiny", port=port), model=teacher,
                                     tokenizer=tokenizer).start())

    restart = threading.Thread(target=come_back)
    restart.start()
    try:
        after = client.build_cache(targets, cache).values
        assert client.wire.retries >= 1
        torch.testing.assert_close(after, before)
    finally:
        restart.join()
        for served in servers:
            served.stop()


@pytest.fixture
def free_port():
    from opsd_rollout.distributed import free_port as find

    return find()
