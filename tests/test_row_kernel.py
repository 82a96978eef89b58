"""``options.cpu_row_kernel``: one-row products by our CPU kernel (``rollout/row_kernel.py``). The fast tests stand
the kernel in with ``F.linear`` (building it takes a C++ compiler half a minute) and prove the wiring: which calls
reach it, that the layers get their own forwards back, what a machine that cannot build it does. The slow tests build
the real kernel and hold it to ``F.linear``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import left_padded, make_tokenizer
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutOptions, SamplingConfig
from opsd_rollout.models import EOS_ID, PAD_ID
from opsd_rollout.rollout import row_kernel


@pytest.fixture
def stand_in(monkeypatch):
    """The kernel replaced by ``F.linear`` of the one row; returns the list of the weights' shapes it was called on."""
    calls = []

    def reference(x, weight):
        calls.append(tuple(weight.shape))
        return F.linear(x.reshape(1, -1).float(), weight.float())[0].to(x.dtype)

    monkeypatch.setattr(row_kernel, "_built", {"module": SimpleNamespace(row_linear=reference)})
    return calls


def rollout(model, **options):
    return HybridEngineRollout(model, make_tokenizer(PAD_ID, EOS_ID), HybridEngineRolloutConfig(
        strategy="static", enable_profiling=True, seed=3, options=RolloutOptions(**options)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_reaches_the_kernel_and_anything_else_does_not(stand_in, dtype):
    layer = torch.nn.Linear(12, 5).to(dtype)
    linears = row_kernel.RowKernelLinears()
    with torch.no_grad(), linears.decoding(layer):
        assert layer(torch.randn(1, 1, 12, dtype=dtype)).shape == (1, 1, 5)
        assert stand_in == [(5, 12)]
        layer(torch.randn(2, 1, 12, dtype=dtype))  # two rows (a decode step at batch 2): F.linear
        layer(torch.randn(1, 3, 12, dtype=dtype))  # a prefill of three tokens: F.linear
        assert len(stand_in) == 1
    assert "forward" not in layer.__dict__  # the layer's own forward back
    with linears.decoding(layer):  # what autograd records goes to F.linear: the kernel has no backward
        x = torch.randn(1, 1, 12, dtype=dtype, requires_grad=True)
        layer(x).sum().backward()
    assert x.grad is not None and len(stand_in) == 1


def test_the_kernel_adds_the_bias_and_keeps_the_leading_dimensions(stand_in):
    layer = torch.nn.Linear(7, 3)
    x = torch.randn(1, 1, 7)
    with torch.no_grad(), row_kernel.RowKernelLinears().decoding(layer):
        got = layer(x)
    assert got.shape == (1, 1, 3)
    assert torch.allclose(got, F.linear(x, layer.weight, layer.bias), atol=1e-6)


def test_a_rollout_at_batch_one_sends_its_decode_steps_to_the_kernel(stand_in, tiny_models):
    """Batch 1: every decode step's linear layers (and the LM head) reach the kernel, and of the prefill only the LM
    head (over the prompt's last position: one row), not its layers (a row per prompt token); the tokens
    are the model's own layers' (the stand-in is ``F.linear``); the profile says ``row_kernel``; the model's layers
    have their forwards back. Two rows: prefill and decode through ``F.linear`` alone."""
    model = tiny_models["llama-tiny"]
    request = left_padded([[5, 6, 7, 8]], PAD_ID)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0)
    on, off = rollout(model, cpu_row_kernel=True), rollout(model)
    with_kernel = on.generate(request, sampling)
    assert on.get_last_profile().weight_layout == "row_kernel"
    linears = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    steps = with_kernel.input_ids.shape[1] - 4 - 1  # the first token comes from the prefill
    head = tuple(model.lm_head.weight.shape)
    assert stand_in[0] == head and len(stand_in) == 1 + linears * steps
    assert torch.equal(with_kernel.input_ids, off.generate(request, sampling).input_ids)
    assert off.get_last_profile().weight_layout == "model"
    assert all("forward" not in m.__dict__ for m in model.modules())
    stand_in.clear()
    on.generate(left_padded([[5, 6], [7, 8]], PAD_ID), sampling)
    assert stand_in == []


def test_a_machine_that_cannot_build_the_kernel_decodes_as_before(monkeypatch, tiny_models, caplog):
    monkeypatch.setattr(row_kernel, "_built", {"error": "RuntimeError: no C++ compiler"})
    model = tiny_models["llama-tiny"]
    request = left_padded([[5, 6, 7, 8]], PAD_ID)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0)
    engine = rollout(model, cpu_row_kernel=True)
    with caplog.at_level(logging.WARNING):
        batch = engine.generate(request, sampling)
        engine.generate(request, sampling)
    warnings = [r.getMessage() for r in caplog.records if "cpu_row_kernel" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]
    assert engine.get_last_profile().weight_layout == "model"
    assert torch.equal(batch.input_ids, rollout(model).generate(request, sampling).input_ids)


def test_the_option_is_a_boolean():
    with pytest.raises((TypeError, ValueError), match="cpu_row_kernel"):
        RolloutOptions(cpu_row_kernel="yes")


# ---- the real kernel: built with the machine's compiler (half a minute the first time) -----------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (5, 17), (300, 896), (33, 4864)])
def test_the_kernel_equals_f_linear(dtype, tolerance, out_features, in_features):
    assert row_kernel.unavailable_reason() is None
    generator = torch.Generator().manual_seed(out_features * in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(3, in_features, generator=generator).to(dtype)[1]  # a row of a larger tensor
    got = torch.ops.opsd_rollout.row_linear(x, weight)
    expected = F.linear(x.float(), weight.float())
    assert got.dtype == dtype and got.shape == (out_features,)
    assert torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance * in_features ** 0.5)


@pytest.mark.slow
def test_the_kernel_refuses_what_it_cannot_multiply():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.opsd_rollout.row_linear(torch.randn(4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="x has 3 elements, the weight 4 inputs"):
        torch.ops.opsd_rollout.row_linear(torch.randn(3), torch.randn(2, 4))


NEAR_TIE = {"fp32": 1e-3, "bf16": 0.03}
"""How far below the model's best logit a greedy token may be and still be the model's choice up to rounding: the
kernel sums in another order than oneMKL, which moves a bfloat16 logit of a few units by an ulp or two (0.008-0.016)
and turns a near-tie (``llama-small``'s fourth token here: 239 and 123 one ulp apart). The model's second choice
lies 0.01 (fp32) and 0.02-0.2 (bf16) below its first on this prompt."""


def greedy_gaps(model, batch, start: int) -> torch.Tensor:
    """For each response token of ``batch`` (row 0, up to its EOS): how far its logit lies below the best one, the
    model scoring the whole sequence with its own layers (0 where it is the model's greedy choice)."""
    ids = batch.input_ids[:, :int(batch.attention_mask[0].sum())]
    with torch.no_grad():
        logits = model(ids).logits[0, start - 1:-1].float()
    return logits.max(-1).values - logits.gather(-1, ids[0, start:, None])[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_rollout_with_the_real_kernel_decodes_the_models_tokens(dtype):
    """Greedy at batch 1 on ``llama-small``: every token the kernel's rollout picks is the model's own layers' greedy
    choice on its prefix, up to rounding (its sums differ from oneMKL's by rounding only, so a near-tie may turn and
    nothing else may), compiled as well as eager."""
    from opsd_rollout.models import load_model

    model, tokenizer = load_model("llama-small", dtype=dtype)
    request = left_padded([list(range(5, 30))], PAD_ID)
    start = request.prompt_ids.shape[1]
    sampling = SamplingConfig(max_new_tokens=12, temperature=0)
    assert greedy_gaps(model, rollout(model).generate(request, sampling), start).max() <= NEAR_TIE[dtype]
    engine = rollout(model, cpu_row_kernel=True)
    compiled = HybridEngineRollout(model, make_tokenizer(PAD_ID, EOS_ID), HybridEngineRolloutConfig(
        strategy="static", enable_profiling=True, compile_decode=True, options=RolloutOptions(cpu_row_kernel=True)))
    for kernel in (engine, compiled):
        gaps = greedy_gaps(model, kernel.generate(request, sampling), start)
        assert len(gaps) and gaps.max() <= NEAR_TIE[dtype], gaps
    assert engine.get_last_profile().weight_layout == "row_kernel"
