"""Every bad input gets a ValueError/TypeError naming the argument, before any model work."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import chain_table, left_padded, make_tokenizer, transition_model
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.rollout.deepspeed_fields import DeepSpeedFields


class Bare:
    """A request-like object that skips DeepSpeed's own __post_init__ checks."""

    def __init__(self, ids, mask):
        self.prompt_ids, self.prompt_attention_mask = ids, mask


@pytest.fixture()
def rollout(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    yield HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(enable_profiling=True)), calls
    handle.remove()


def ok_request():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    return RolloutRequest(ids, (ids != 0).long())


CASES = [
    ("prompt_ids must be 2-D", Bare(torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1])), {}),
    ("prompt_attention_mask must have the shape", Bare(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4)), {}),
    ("empty batch", Bare(torch.ones(0, 3, dtype=torch.long), torch.ones(0, 3, dtype=torch.long)), {}),
    ("no columns", Bare(torch.ones(2, 0, dtype=torch.long), torch.ones(2, 0, dtype=torch.long)), {}),
    ("integer token ids", Bare(torch.ones(2, 3), torch.ones(2, 3)), {}),
    ("outside the model's vocabulary", Bare(torch.tensor([[5, 300]]), torch.ones(1, 2, dtype=torch.long)), {}),
    ("outside the model's vocabulary", Bare(torch.tensor([[-1, 5]]), torch.ones(1, 2, dtype=torch.long)), {}),
    ("only 0 and 1", Bare(torch.tensor([[5, 6]]), torch.tensor([[1, 2]])), {}),
    ("no real token", Bare(torch.tensor([[5, 6]]), torch.tensor([[0, 0]])), {}),
    ("rows [1, 2] end in padding (right-padded prompts)",
     Bare(torch.tensor([[5, 6, 7], [5, 6, 0], [5, 0, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])), {}),
    ("n_samples_per_prompt must be an int >= 1", None, dict(n_samples_per_prompt=0)),
    ("max_new_tokens must be an int >= 1", None, dict(max_new_tokens=0)),
    ("max_new_tokens must be an int >= 1", None, dict(max_new_tokens=-3)),
    ("exceeds the model's 1024 positions", None, dict(max_new_tokens=1022)),
    ("temperature must be a finite number", None, dict(temperature=math.nan)),
    ("top_p must be in (0, 1]", None, dict(top_p=0.0)),
    ("top_p must be in (0, 1]", None, dict(top_p=1.5)),
    ("top_k must be an int", None, dict(top_k=2.5)),
    ("continuous_batch_size must be an int >= 1 or None", None, dict(continuous_batch_size=0)),
    ("continuous_batch_size must be an int >= 1 or None", None, dict(continuous_batch_size=2.5)),
]


@pytest.mark.parametrize("message,request_,sampling_kwargs", CASES, ids=[c[0] + str(i) for i, c in enumerate(CASES)])
def test_bad_input_raises_before_model_work(rollout, message, request_, sampling_kwargs):
    engine, calls = rollout
    sampling = SamplingConfig(**{"max_new_tokens": 4, **sampling_kwargs})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        engine.generate(request_ or ok_request(), sampling)
    assert calls == [], "no forward may run on bad input"
    assert engine.get_last_profile() is None


@pytest.mark.parametrize("strategy", ["static", "generate"])
def test_masked_positions_inside_a_prompt_are_invisible(tiny_models, tokenizer, strategy):
    """A prompt with masked positions between its tokens generates what the same tokens left-padded do:
    positions count real tokens only and attention skips the masked ones (supported exactly)."""
    model = tiny_models["llama-tiny"]
    rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy=strategy))
    holed = RolloutRequest(torch.tensor([[20, 0, 21, 0, 22], [30, 31, 32, 33, 34]]),
                           torch.tensor([[1, 0, 1, 0, 1], [1, 1, 1, 1, 1]]))
    left = RolloutRequest(torch.tensor([[0, 0, 20, 21, 22], [30, 31, 32, 33, 34]]),
                          torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    sampling = SamplingConfig(max_new_tokens=10, n_samples_per_prompt=2, temperature=0)
    assert torch.equal(rollout.generate(holed, sampling).input_ids[:, 5:], rollout.generate(left, sampling).input_ids[:, 5:])


def test_tokenizer_without_pad_or_eos_is_refused(tiny_models):
    engine = HybridEngineRollout(tiny_models["llama-tiny"], make_tokenizer(None, None))
    with pytest.raises(ValueError, match="neither pad_token_id nor eos_token_id"):
        engine.generate(ok_request(), SamplingConfig(max_new_tokens=2))


def test_pad_falls_back_to_eos():
    """Without a pad id, rows that stop early are padded with the EOS id."""
    model = transition_model(chain_table(16, {8: 2}))  # after 8 comes EOS; 10 runs on
    engine = HybridEngineRollout(model, make_tokenizer(None, 2))
    batch = engine.generate(left_padded([[7, 8], [9, 10]], 0), SamplingConfig(max_new_tokens=3, temperature=0))
    assert batch.input_ids[:, 2:].tolist() == [[2, 2, 2], [11, 12, 13]]
    assert batch.attention_mask[:, 2:].tolist() == [[1, 0, 0], [1, 1, 1]]


def test_non_tensor_prompts_and_wrong_sampling_type_are_type_errors(rollout):
    engine, _ = rollout
    with pytest.raises(TypeError, match="prompt_ids must be a torch.Tensor"):
        engine.generate(Bare([[1, 2]], torch.ones(1, 2)), SamplingConfig(max_new_tokens=2))
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        engine.generate(ok_request(), {"max_new_tokens": 2})


def test_a_list_a_missing_mask_and_a_float_mask_are_refused_by_name(rollout):
    """DeepSpeed's RolloutRequest needs tensors at construction; ``generate`` checks whatever request it is given
    (any object with the two fields) and names the field; a float mask is refused with its fix, not accepted."""
    from types import SimpleNamespace

    engine, _ = rollout
    sampling = SamplingConfig(max_new_tokens=2)
    with pytest.raises(TypeError, match="request.prompt_ids must be a torch.Tensor .*got list"):
        engine.generate(SimpleNamespace(prompt_ids=[[5, 6]], prompt_attention_mask=[[1, 1]]), sampling)
    with pytest.raises(TypeError, match="request.prompt_attention_mask must be a torch.Tensor .*got NoneType"):
        engine.generate(SimpleNamespace(prompt_ids=torch.tensor([[5, 6]]), prompt_attention_mask=None), sampling)
    with pytest.raises(ValueError, match="integers or bools .*float32: pass mask.long"):
        engine.generate(RolloutRequest(torch.tensor([[5, 6]]), torch.ones(1, 2)), sampling)
    bools = engine.generate(RolloutRequest(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.bool)), sampling)
    assert bools.attention_mask.dtype == torch.bool and bools.attention_mask[0, :2].all()


def test_engine_must_be_a_model():
    with pytest.raises(TypeError, match="DeepSpeed engine or a transformers causal LM"):
        HybridEngineRollout(object(), make_tokenizer(0, 2))


def test_unknown_strategy_is_refused_and_deepspeeds_options_map():
    with pytest.raises(ValueError, match="strategy must be one of"):
        HybridEngineRolloutConfig(strategy="vllm")
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig as DSConfig

    aligned = HybridEngineRolloutConfig.from_any(DSConfig(align_decode_fronts=True))
    assert aligned.align_decode_fronts is True  # read back as given, and nothing of ours changes:
    assert dataclasses.replace(aligned, deepspeed=DeepSpeedFields()) == HybridEngineRolloutConfig()
    with pytest.raises(ValueError, match="kv_budget_bytes must be an int >= 1"):
        HybridEngineRolloutConfig(kv_budget_bytes=0)
    assert HybridEngineRolloutConfig.from_any(DSConfig(enable_profiling=True)).enable_profiling is True
    graphs = HybridEngineRolloutConfig.from_any(DSConfig(use_graph_capture=True))
    assert graphs.compile_decode and graphs.strategy == "static"


def test_compiled_decode_is_accepted_on_cpu_and_compiles_lazily(tiny_models, tokenizer):
    """On the CPU the step compiles with inductor (no CUDA graphs), on its first call, not when built."""
    rollout = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer,
                                  HybridEngineRolloutConfig(strategy="static", compile_decode=True))
    assert rollout.strategy.compiled is not None and rollout.use_graph_capture
    with pytest.raises(RuntimeError, match="prepare"):  # nothing compiled before a call says on which device
        rollout.strategy.compiled(None)


def test_a_failed_call_clears_the_previous_profile(rollout):
    engine, _ = rollout
    engine.generate(ok_request(), SamplingConfig(max_new_tokens=2))
    assert engine.get_last_profile() is not None
    with pytest.raises(ValueError):
        engine.generate(ok_request(), SamplingConfig(max_new_tokens=0))
    assert engine.get_last_profile() is None
