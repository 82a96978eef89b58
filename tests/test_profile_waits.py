"""What profiling waits for: on CUDA a profile's marks are events on the stream, so recording one waits for nothing
and reading them waits once (``Clock.settle``). Here the clocks use host stand-ins of CUDA events that count the
waits, and the device synchronization of ``profiling.clock`` raises, so a timed probe that waited would fail."""

from __future__ import annotations

import copy
import time

import pytest

from conftest import left_padded
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.deepspeed_engine import build_engine
from opsd_rollout.profiling import clock

SAMPLING = SamplingConfig(max_new_tokens=6, n_samples_per_prompt=2, temperature=0)


class Waits(list):
    """The events waited on; an event counts as reached once a wait on it or on a later one happened."""

    reached_at = float("-inf")


@pytest.fixture
def waits(monkeypatch):
    import torch

    waited = Waits()

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at: float | None = None

        def record(self, stream=None) -> None:
            self.at = time.perf_counter()

        def query(self) -> bool:
            return self.at <= waited.reached_at

        def synchronize(self) -> None:
            waited.append(self)
            waited.reached_at = max(waited.reached_at, self.at)

        def elapsed_time(self, end: "Event") -> float:
            assert end.query(), "an event read before the device reached it"
            return (end.at - self.at) * 1e3

    def no_synchronize(device):
        raise AssertionError(f"the device was synchronized ({device})")

    init = clock.Clock.__init__

    def with_events(instance, *args, **kwargs):
        init(instance, *args, **kwargs)
        instance.uses_events = True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(clock, "synchronize", no_synchronize)
    monkeypatch.setattr(clock.Clock, "__init__", with_events)
    return waited


@pytest.mark.parametrize("zero_stage", [None, 3])
def test_a_profiled_rollout_waits_once_when_its_profile_is_read(tiny_models, tokenizer, waits, zero_stage):
    model = copy.deepcopy(tiny_models["llama-tiny"])
    engine = model if zero_stage is None else build_engine(model, zero_stage)
    rollout = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=True,
                                                                               zero3_gather="per_layer"))
    rollout.generate(left_padded([[5, 6, 7], [9]], 0), SAMPLING)
    assert waits == []
    profile = rollout.get_last_profile()
    assert len(waits) == 1 and profile.timer == "cuda_events"
    assert profile.decode_ms > 0 and profile.generated_tokens == 4 * 6
    if zero_stage == 3:  # the per-layer fetches timed, their all-gathers counted: without a wait
        assert profile.param_gather_ms > 0 and profile.param_gather_count > 0
    assert rollout.get_last_profile() is profile and rollout.get_last_timeline() and len(waits) == 1


def test_an_opsd_step_waits_once_per_record_at_its_end(tiny_models, tokenizer, waits):
    """The step's parts, its eval/train switches and its rollout's profile: one wait each, when the step's profile
    is assembled; the rollout itself waits for nothing."""
    from opsd_rollout.opsd import opsd_step

    engine = build_engine(copy.deepcopy(tiny_models["llama-tiny"]), 0, lr=1e-3)
    teacher = tiny_models["qwen2-tiny"]
    enc = tokenizer(["The student writes", "hi"], padding=True, return_tensors="pt")
    request = RolloutRequest(enc.input_ids, enc.attention_mask)
    for profiled, expected in ((True, 3), (False, 2)):
        inner = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=profiled))

        class Watched:
            during: list[int] = []

            def generate(self, *args, **kwargs):
                before = len(waits)
                batch = inner.generate(*args, **kwargs)
                self.during.append(len(waits) - before)
                return batch

            def get_last_profile(self):
                return inner.get_last_profile()

        waits.clear()
        step = opsd_step(engine, teacher, Watched(), request, SAMPLING)
        assert Watched.during == [0] and len(waits) == expected, (profiled, len(waits))
        assert (step.rollout is not None) == profiled and step.total_ms >= step.rollout_ms > 0
