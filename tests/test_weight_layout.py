"""CPU weight layout (``cpu_transposed_weights``): from 16 decode rows on the CPU every float32 ``nn.Linear``
multiplies by an ``[in, out]`` copy of its weight, written again at every call; tokens stay those of transformers'
generate and of the model's own layout, every layer gets its own forward back, and the profile says what ran."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.nn.utils import prune

from conftest import TINY_PRESETS, prompts_with_padding_and_holes, reference_rollout, rollout_engine
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutOptions, SamplingConfig
from opsd_rollout.models import EOS_ID, PAD_ID
from opsd_rollout.rollout import weight_layout
from opsd_rollout.rollout.compiled import compiled_graphs
from opsd_rollout.rollout.strategies.static import StaticDecode

GREEDY_16_ROWS = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=6, temperature=0)  # 3 prompts x 6 = 18 rows


def linear_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.nbytes for m in model.modules() if type(m) is torch.nn.Linear)


def replaced_forwards(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def rollout_of(model, tokenizer, cpu_transposed_weights=True, **kwargs) -> HybridEngineRollout:
    """A profiled rollout with the copies opted in (unless ``cpu_transposed_weights=False``)."""
    return rollout_engine(model, tokenizer, enable_profiling=True, cpu_transposed_weights=cpu_transposed_weights,
                          **kwargs)


@pytest.fixture
def copy_calls(monkeypatch):
    """Counts the multiplications by a copy (patched before the rollout makes its forwards)."""
    calls = []

    def counted(module, weight_t, x):
        calls.append(module)
        return linear(module, weight_t, x)

    linear = weight_layout._linear
    monkeypatch.setattr(weight_layout, "_linear", counted)
    return calls


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_transposed_weights_give_generate_s_tokens(tiny_models, tokenizer, name):
    model = tiny_models[name]
    request = prompts_with_padding_and_holes(tokenizer)
    ref_ids, ref_mask = reference_rollout(model, request, n=6, max_new_tokens=8, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    rollout = rollout_of(model, tokenizer)
    batch = rollout.generate(request, GREEDY_16_ROWS)
    assert torch.equal(batch.input_ids, ref_ids) and torch.equal(batch.attention_mask, ref_mask)
    profile = rollout.get_last_profile()
    assert profile.weight_layout == "transposed"
    assert profile.weight_layout_bytes == linear_bytes(model) > 0  # GPT-2's Conv1D layers: only its LM head
    assert profile.weight_layout_ms > 0
    assert replaced_forwards(model) == []  # every layer has its own forward back
    plain = rollout_of(model, tokenizer, cpu_transposed_weights=False)
    assert torch.equal(plain.generate(request, GREEDY_16_ROWS).input_ids, batch.input_ids)
    assert plain.get_last_profile().weight_layout == "model"
    assert plain.get_last_profile().weight_layout_ms is None


def test_every_forward_of_the_loop_multiplies_by_the_copies(tiny_models, tokenizer, copy_calls):
    model = tiny_models["llama-tiny"]
    rollout = rollout_of(model, tokenizer)
    rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    forwards = rollout.get_last_profile().prefill_forwards + rollout.get_last_profile().decode_steps
    assert len(copy_calls) == len(layers) * forwards and set(copy_calls) == set(layers)


def test_from_sixteen_rows_on_a_float32_cpu_model(tiny_models):
    model, linears = tiny_models["llama-tiny"], weight_layout.TransposedLinears()
    cpu = torch.device("cpu")
    assert not linears.applies(model, torch.float32, cpu, weight_layout.MIN_ROWS - 1)
    assert linears.applies(model, torch.float32, cpu, weight_layout.MIN_ROWS)
    assert not linears.applies(model, torch.bfloat16, cpu, 64)  # e.g. a bf16 model's float32 LoRA adapters
    assert not linears.applies(model, torch.float32, torch.device("meta"), 64)


def test_layers_whose_weight_a_pre_hook_rebuilds_keep_their_forward(tiny_models):
    """Pruning (and the old weight norm) rebuild ``weight`` before each forward: a copy would miss it."""
    model = copy.deepcopy(tiny_models["llama-tiny"])
    pruned = model.model.layers[0].mlp.up_proj
    prune.l1_unstructured(pruned, "weight", amount=0.5)
    linears = weight_layout.TransposedLinears()
    linears.refresh(model)
    assert pruned not in linears._copies and model.lm_head in linears._copies


def test_seeded_samples_equal_in_both_layouts(tiny_models, tokenizer):
    model, request = tiny_models["llama-tiny"], prompts_with_padding_and_holes(tokenizer)
    sampling = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=6, temperature=1.0, top_k=20)
    batches = [rollout_of(model, tokenizer, seed=3, cpu_transposed_weights=flag).generate(request, sampling)
               for flag in (True, False)]
    assert torch.equal(batches[0].input_ids, batches[1].input_ids)


def test_fewer_than_sixteen_rows_keep_the_model_layout(tiny_models, tokenizer):
    rollout = rollout_of(tiny_models["llama-tiny"], tokenizer)
    rollout.generate(prompts_with_padding_and_holes(tokenizer), SamplingConfig(max_new_tokens=4, temperature=0,
                                                                                n_samples_per_prompt=5))
    profile = rollout.get_last_profile()
    assert (profile.weight_layout, profile.weight_layout_bytes, profile.weight_layout_ms) == ("model", 0, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_the_model_layout(tiny_models, tokenizer, dtype):
    model = copy.deepcopy(tiny_models["llama-tiny"]).to(dtype)  # oneMKL's float32 path only: bf16 gains nothing
    rollout = rollout_of(model, tokenizer)
    rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    assert rollout.get_last_profile().weight_layout == "model"


def test_copies_are_written_again_at_every_call(tiny_models, tokenizer):
    """Training changes the weights between rollouts, in ways a tensor's version counter does not see (``.data``):
    the next call decodes with the new weights, in the copies allocated by the first call."""
    model = copy.deepcopy(tiny_models["llama-tiny"])
    request = prompts_with_padding_and_holes(tokenizer)
    rollout = rollout_of(model, tokenizer)
    first = rollout.generate(request, GREEDY_16_ROWS)
    copies = {id(c) for c in rollout.strategy.linears._copies.values()}
    torch.manual_seed(0)
    for param in model.parameters():
        param.data.add_(torch.randn_like(param), alpha=0.5)
    second = rollout.generate(request, GREEDY_16_ROWS)
    ref_ids, _ = reference_rollout(model, request, n=6, max_new_tokens=8, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    assert torch.equal(second.input_ids, ref_ids) and not torch.equal(first.input_ids, second.input_ids)
    assert {id(c) for c in rollout.strategy.linears._copies.values()} == copies
    assert rollout.get_last_profile().workspace == "reused"


def test_forwards_restored_when_a_decode_step_raises(tiny_models, tokenizer):
    model = copy.deepcopy(tiny_models["llama-tiny"])
    calls = []

    def fail_on_third(*_args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")

    handle = model.register_forward_pre_hook(fail_on_third)
    rollout = rollout_of(model, tokenizer)
    with pytest.raises(RuntimeError, match="boom"):
        rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    handle.remove()
    assert replaced_forwards(model) == []


def test_release_frees_the_copies(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]
    kept = rollout_of(model, tokenizer)
    kept.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    assert kept.get_last_profile().weight_layout_bytes == linear_bytes(model)  # held for the next call
    rollout = rollout_of(model, tokenizer, cache_policy="release")
    rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    profile = rollout.get_last_profile()
    assert profile.weight_layout == "transposed" and profile.weight_layout_bytes == 0
    assert rollout.strategy.linears.nbytes == 0


def test_a_model_over_the_byte_limit_keeps_its_layout(tiny_models, tokenizer, monkeypatch):
    """Large models' decode steps are bound by reading their weights: the copies would only cost."""
    model = tiny_models["llama-tiny"]
    monkeypatch.setattr(weight_layout, "MAX_BYTES", linear_bytes(model) - 1)
    rollout = rollout_of(model, tokenizer)
    rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    assert rollout.get_last_profile().weight_layout == "model"
    monkeypatch.setattr(weight_layout, "MAX_BYTES", linear_bytes(model))
    rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    assert rollout.get_last_profile().weight_layout == "transposed"


def test_copies_that_do_not_fit_are_skipped_with_a_warning(tiny_models, tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(weight_layout, "available_bytes", lambda device: 1024)
    rollout = rollout_of(tiny_models["llama-tiny"], tokenizer)
    with caplog.at_level(logging.WARNING, logger=weight_layout.__name__):
        rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    assert rollout.get_last_profile().weight_layout == "model"
    assert "more than half the available RAM" in caplog.text


@pytest.mark.parametrize("cache_policy", ["retain", "release"])
def test_compiled_step_over_the_transposed_layout(tiny_models, tokenizer, cache_policy):
    """Released copies come back in the same tensors, with the same forwards: nothing recompiles."""
    model, request = tiny_models["qwen2-tiny"], prompts_with_padding_and_holes(tokenizer)
    eager = rollout_of(model, tokenizer).generate(request, GREEDY_16_ROWS)
    rollout = rollout_of(model, tokenizer, cache_policy=cache_policy)
    rollout.strategy = StaticDecode(compile_decode=True, options=RolloutOptions(cpu_transposed_weights=True),
                                    compile_options={"backend": "aot_eager"})
    assert torch.equal(rollout.generate(request, GREEDY_16_ROWS).input_ids, eager.input_ids)
    assert rollout.get_last_profile().weight_layout == "transposed" and replaced_forwards(model) == []
    # the next calls (copies written again, forwards replaced again) reuse every graph: none compiled anywhere,
    # not only in the first calls the profile counts (a guard failing inside the loop would recompile there)
    before = compiled_graphs()
    for _ in range(2):
        assert torch.equal(rollout.generate(request, GREEDY_16_ROWS).input_ids, eager.input_ids)
        assert rollout.get_last_profile().compiled_graphs == 0
    assert compiled_graphs() == before


def test_peft_lora_layers_use_the_copies_merged_or_not(tiny_models, tokenizer):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(tiny_models["llama-tiny"]), config).eval()
    request = prompts_with_padding_and_holes(tokenizer)
    plain = rollout_of(model, tokenizer, cpu_transposed_weights=False).generate(request, GREEDY_16_ROWS)
    for merge in (False, True):
        rollout = rollout_of(model, tokenizer, merge_adapters=merge)
        batch = rollout.generate(request, GREEDY_16_ROWS)
        assert rollout.get_last_profile().weight_layout == "transposed"
        assert torch.equal(batch.input_ids, plain.input_ids)
    assert replaced_forwards(model) == []
    half = peft.get_peft_model(copy.deepcopy(tiny_models["llama-tiny"]).to(torch.bfloat16), config).eval()
    assert any(m.weight.dtype == torch.float32 for m in half.modules() if type(m) is torch.nn.Linear)  # adapters
    rollout = rollout_of(half, tokenizer)
    rollout.generate(request, GREEDY_16_ROWS)
    assert rollout.get_last_profile().weight_layout == "model"


@pytest.mark.parametrize("gather,layout", [("once", "transposed"), ("per_layer", "model")])
def test_zero3_gathered_once_uses_the_copies(tiny_models, tokenizer, gather, layout):
    """Gathered once, every weight is whole during the rollout (the copies are dropped after it); gathered per
    layer, none is at its start."""
    from opsd_rollout.deepspeed_engine import build_engine

    model, request = tiny_models["llama-tiny"], prompts_with_padding_and_holes(tokenizer)
    expected = rollout_of(model, tokenizer, cpu_transposed_weights=False).generate(request, GREEDY_16_ROWS)
    engine = build_engine(copy.deepcopy(model), 3)
    rollout = rollout_of(engine, tokenizer, zero3_gather=gather)
    assert torch.equal(rollout.generate(request, GREEDY_16_ROWS).input_ids, expected.input_ids)
    assert rollout.get_last_profile().weight_layout == layout
    assert replaced_forwards(engine.module) == []
    assert rollout.strategy.linears.nbytes == 0  # not kept between calls: ZeRO-3 keeps no whole weight
    assert rollout.get_last_profile().weight_layout_bytes == 0


def test_the_copies_are_opt_in_and_take_a_bool_only(tiny_models, tokenizer):
    assert RolloutOptions().cpu_transposed_weights is False
    rollout = HybridEngineRollout(tiny_models["qwen2-tiny"], tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
    rollout.generate(prompts_with_padding_and_holes(tokenizer), GREEDY_16_ROWS)
    assert rollout.get_last_profile().weight_layout == "model"
    with pytest.raises(TypeError, match="options.cpu_transposed_weights"):
        RolloutOptions(cpu_transposed_weights="yes")
