"""profile_model_time / model_times on any module."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import left_padded
from opsd_rollout import HybridEngineRollout, SamplingConfig
from opsd_rollout.profiling import profile_model_time


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


def test_clears_on_read_and_says_why_when_empty(tiny_models):
    model = tiny_models["gpt2-tiny"]
    timer = profile_model_time(model, use_cuda_events=False)
    try:
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))
            model(torch.tensor([[5, 6, 7]]))
        assert len(timer.model_times()) == 2
        with pytest.raises(RuntimeError, match="no forward pass of GPT2LMHeadModel.*CUDA-graph"):
            timer.model_times()
    finally:
        timer.remove()


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
