"""profile_model_time / model_times on any module."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import left_padded
from opsd_rollout import HybridEngineRollout, SamplingConfig
from opsd_rollout.profiling import HiddenForwardsError, profile_model_time
from opsd_rollout.profiling import forward as forward_timing


def hook_counts(module):
    return len(module._forward_pre_hooks), len(module._forward_hooks)


def count_forwards(module):
    calls = []
    return calls, module.register_forward_pre_hook(lambda *_: calls.append(1))


def test_counts_exactly_the_forwards_that_ran_and_splits_them(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]
    calls, handle = count_forwards(model)
    try:
        with profile_model_time(model) as timer:
            HybridEngineRollout(model, tokenizer).generate(left_padded([[5, 6, 7], [8]], 0),
                                                           SamplingConfig(max_new_tokens=6, temperature=0))
            times = timer.model_times(split=True)
    finally:
        handle.remove()
    assert len(times["prefill"]) == 1 and len(times["prefill"]) + len(times["decode"]) == len(calls)
    assert all(t > 0 for t in times["prefill"] + times["decode"])


def test_clears_on_read_and_an_empty_read_is_an_empty_list(tiny_models):
    """As DeepSpeed's InferenceEngine.model_times(): read and clear; reading again, or polling through
    intervals with no forward, returns nothing rather than raising."""
    model = tiny_models["gpt2-tiny"]
    timer = profile_model_time(model, use_cuda_events=False)
    try:
        assert timer.model_times() == [] and timer.model_times(split=True) == {"prefill": [], "decode": []}
        polled = []
        with torch.no_grad():
            for interval in range(4):
                for _ in range(interval % 2 * 2):  # intervals 1 and 3 run two forwards, 0 and 2 none
                    model(torch.tensor([[5, 6, 7]]))
                polled.append(len(timer.model_times()))
        assert polled == [0, 2, 0, 2]
        assert timer.model_times() == []
    finally:
        timer.remove()


class Capturing:
    """Makes the forward timer see a CUDA-graph capture in progress (what torch.cuda.graph does on a GPU)."""

    def __init__(self, monkeypatch):
        self.on = False
        monkeypatch.setattr(forward_timing, "stream_capturing", lambda: self.on)

    def run(self, fn):
        self.on = True
        try:
            return fn()
        finally:
            self.on = False


def test_a_forward_captured_into_a_cuda_graph_makes_an_empty_read_an_error(tiny_models, monkeypatch):
    """Replays of a captured forward run no hooks: once the timed module was captured, an empty read cannot
    mean "no forward ran", and says so (a RuntimeError, and a ValueError as DeepSpeed raises)."""
    model = tiny_models["gpt2-tiny"]
    capture = Capturing(monkeypatch)
    timer = profile_model_time(model, use_cuda_events=False)
    try:
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))  # a warm-up forward, before capture: timed
            capture.run(lambda: model(torch.tensor([[5, 6, 7]])))  # captured: not timed
        assert len(timer.model_times()) == 1
        for error_type in (HiddenForwardsError, RuntimeError, ValueError):
            with pytest.raises(error_type, match="1 of its forwards ran inside a CUDA-graph capture"):
                timer.model_times()
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))  # an eager forward is still seen
        assert len(timer.model_times(split=True)["prefill"]) == 1
    finally:
        timer.remove()


class Replayer(torch.nn.Module):
    """A wrapper that, like DeepSpeed's inference engine with CUDA graphs, captures its model on the first call
    and replays it afterwards (the model's own forward never runs again)."""

    def __init__(self, module, capture):
        super().__init__()
        self.module, self.capture, self.output = module, capture, None

    def forward(self, input_ids):
        if self.output is None:
            self.output = self.capture.run(lambda: self.module(input_ids))
        return self.output


def test_a_capture_inside_a_timed_wrapper_is_seen_through_the_wrapper(tiny_models, monkeypatch):
    """Timing the wrapper that replays the graph sees every call, so an empty read there is just empty."""
    capture = Capturing(monkeypatch)
    wrapper = Replayer(tiny_models["gpt2-tiny"], capture)
    with profile_model_time(wrapper, use_cuda_events=False) as timer, torch.no_grad():
        for _ in range(3):
            wrapper(torch.tensor([[5, 6, 7]]))
        assert len(timer.model_times()) == 3, "the capture and two replays, each a call of the wrapper"
        assert timer.model_times() == []
    with profile_model_time(wrapper.module, use_cuda_events=False) as timer, torch.no_grad():
        wrapper.output = None  # capture again, now with only the inner model timed
        wrapper(torch.tensor([[5, 6, 7]]))
        wrapper(torch.tensor([[5, 6, 7]]))
        with pytest.raises(HiddenForwardsError, match="time the module whose call replays the graph"):
            timer.model_times()


def test_chunked_prefill_is_prefill(tiny_models):
    from transformers import DynamicCache

    model = tiny_models["qwen2-tiny"]
    with profile_model_time(model) as timer, torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.arange(3, 9).view(1, 6), past_key_values=cache, use_cache=True)
        model(torch.arange(9, 15).view(1, 6), past_key_values=cache, use_cache=True)
        model(torch.tensor([[20]]), past_key_values=cache, use_cache=True)
        split = timer.model_times(split=True)
    assert (len(split["prefill"]), len(split["decode"])) == (2, 1)


def test_remove_restores_the_module_and_double_enable_is_an_error(tiny_models):
    model = tiny_models["llama-tiny"]
    before = hook_counts(model)
    timer = profile_model_time(model)
    with pytest.raises(RuntimeError, match="already enabled"):
        profile_model_time(model)
    timer.remove()
    assert hook_counts(model) == before
    with pytest.raises(RuntimeError, match="removed"):
        timer.model_times()
    profile_model_time(model).remove()  # enabling again after remove is fine


def test_peft_wrapper_times_the_forwards_generate_runs_once_each(tiny_models):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(copy.deepcopy(tiny_models["llama-tiny"]),
                                peft.LoraConfig(r=2, target_modules=["q_proj"])).eval()
    inner = model.get_base_model()
    calls, handle = count_forwards(inner)
    try:
        with profile_model_time(model) as timer, torch.no_grad():
            model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                           pad_token_id=0)  # enters the inner model directly
            from_generate = timer.model_times(split=True)
            model(input_ids=torch.tensor([[5, 6]]))  # enters the wrapper: counted once, not twice
            from_call = timer.model_times()
            with pytest.raises(RuntimeError, match="already enabled"):
                profile_model_time(inner)  # the wrapped model is already timed through its wrapper
    finally:
        handle.remove()
    assert len(from_generate["prefill"]) == 1 and len(from_generate["decode"]) == 3
    assert len(from_call) == 1 and len(calls) == 5
    assert not inner._forward_hooks and not model._forward_hooks


def test_deepspeed_engine_forward_and_module_generate(tiny_models):
    from opsd_rollout.deepspeed_engine import build_engine

    engine = build_engine(copy.deepcopy(tiny_models["llama-tiny"]), 0)
    before = hook_counts(engine), hook_counts(engine.module)  # DeepSpeed has hooks of its own
    with profile_model_time(engine) as timer, torch.no_grad():
        engine(input_ids=torch.tensor([[5, 6, 7]]))
        assert len(timer.model_times()) == 1
        engine.module.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert len(timer.model_times()) == 3
    assert (hook_counts(engine), hook_counts(engine.module)) == before
