"""``compile_decode`` on the CPU for real (inductor's C++ kernels, not a tracing backend): greedy tokens equal
transformers' generate, seeded samples equal the eager loop's, repeated calls and compaction buckets never
compile again, and a compile's time stays out of the decode figures. The compiles take tens of seconds each:
slow tests, except the profile's accounting, checked with a tracing backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_PRESETS, prompts_with_padding_and_holes, reference_rollout, rollout_engine
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.models import EOS_ID, PAD_ID
from opsd_rollout.rollout.compiled import (CompiledStep, NeedsCompile, WarmShapes, compiled_graphs,
                                          records_cuda_graphs)
from opsd_rollout.rollout.strategies.static import StaticDecode


def unpadded(tokenizer) -> RolloutRequest:
    enc = tokenizer(["The student", "writes a bc", "on policy!!"], return_tensors="pt")
    return RolloutRequest(enc.input_ids, enc.attention_mask)


def greedy(max_new_tokens=10, n=2):
    return SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n, temperature=0)


def sampled(max_new_tokens=10, n=2):
    return SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n, temperature=1.0, top_k=20, top_p=0.9)


def test_a_compile_is_its_own_figure_and_its_forward_no_decode_step(tiny_models, tokenizer):
    """The first call for a shape runs the compiled step once apart (timed as ``compile_ms``, counted in
    ``compiled_graphs``); ``decode_steps``/``decode_ms`` hold the real steps only, in that call and the next."""
    torch._dynamo.reset()
    rollout = rollout_engine(tiny_models["llama-tiny"], tokenizer, enable_profiling=True, ignore_eos=True)
    rollout.rollout.strategy = StaticDecode(compile_decode=True, compact_rows=False,
                                            compile_options={"backend": "aot_eager"})
    request = prompts_with_padding_and_holes(tokenizer)
    first = rollout.generate(request, greedy(8, 1))
    profile = rollout.get_last_profile()
    assert profile.compile_ms > 0 and profile.compiled_graphs >= 1
    assert profile.decode_steps == 7 and profile.prefill_forwards == 1
    again = rollout.generate(request, greedy(8, 1))
    repeat = rollout.get_last_profile()
    assert repeat.compile_ms is None and repeat.compiled_graphs == 0 and repeat.decode_steps == 7
    assert torch.equal(first.input_ids, again.input_ids)
    expected, _ = reference_rollout(tiny_models["llama-tiny"], request, n=1, max_new_tokens=8, pad_token_id=PAD_ID,
                                    eos_ids=[])
    assert torch.equal(first.input_ids, expected)


def test_a_smaller_workspace_is_a_new_shape_not_a_recompile_inside_the_loop(tiny_models, tokenizer, caplog):
    """The same active rows over a workspace of fewer slots (continuous batching after a plain call) is a shape of
    its own: compiled as a first call, not by a failing guard inside a decode step (which the loop warns of)."""
    import logging

    torch._dynamo.reset()
    rollout = rollout_engine(tiny_models["llama-tiny"], tokenizer, enable_profiling=True, seed=3,
                             response_lengths="geometric:mean=4")
    rollout.rollout.strategy = StaticDecode(compile_decode=True, seed=3, compile_options={"backend": "aot_eager"})
    request = prompts_with_padding_and_holes(tokenizer)
    with caplog.at_level(logging.WARNING, logger="opsd_rollout.rollout.compiled"):
        for slots in (None, 4):
            rollout.generate(request, SamplingConfig(**{**vars(sampled(16, 2)), "continuous_batch_size": slots}))
    assert not [r for r in caplog.records if "inside the decode loop" in r.getMessage()]


def test_on_cuda_graphs_every_shape_is_warmed_again_after_a_new_graph(tiny_models, tokenizer, monkeypatch):
    """dynamo tries its newest graph first, so a graph compiled for one shape can take over shapes warmed before it
    (on an H200 a graph with a symbolic batch took the full batch over, and recorded its CUDA graph for it in a decode
    step). On CUDA graphs every shape is warmed again when next met after a new graph, whichever compiled step of the
    process compiled it; with no graphs to record, a shape is warmed once."""
    request = prompts_with_padding_and_holes(tokenizer)
    prepare, warm = CompiledStep.prepare, CompiledStep.warm
    warmed = {}
    for records in (False, True):
        torch._dynamo.reset()
        batches = []

        def prepared(step, device, records=records):
            prepare(step, device)
            step.records_graphs = records  # as prepare sets it on CUDA for reduce-overhead

        def counted(step, model, token, *args, **kwargs):
            batches.append(token.shape[0])
            return warm(step, model, token, *args, **kwargs)

        monkeypatch.setattr(CompiledStep, "prepare", prepared)
        monkeypatch.setattr(CompiledStep, "warm", counted)
        rollout = rollout_engine(tiny_models["llama-tiny"], tokenizer, seed=3, response_lengths="geometric:mean=4")
        rollout.rollout.strategy = StaticDecode(compile_decode=True, seed=3, compile_options={"backend": "eager"})
        for _ in range(2):
            rollout.generate(request, sampled(16, 2))
        warmed[records] = batches
    full = warmed[False][0]
    assert warmed[False].count(full) == 1 and len(warmed[False]) == len(set(warmed[False]))
    assert warmed[True].count(full) == 2 and set(warmed[True]) == set(warmed[False])


def test_warmed_shapes_are_forgotten_on_cuda_graphs_when_anything_compiled_since():
    """The shapes hold while dynamo compiles nothing: a graph compiled by another step of the process counts too
    (dynamo keeps one cache per function)."""
    cuda, cpu = SimpleNamespace(records_graphs=True), SimpleNamespace(records_graphs=False)
    for step, kept in ((cuda, False), (cpu, True)):
        torch._dynamo.reset()
        warmed = WarmShapes()
        warmed.add((4, 64))
        warmed.current(step)
        assert (4, 64) in warmed
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # elsewhere in the process
        warmed.current(step)
        assert ((4, 64) in warmed) is kept


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_inductor_compiled_step_equals_generate_and_the_eager_loop(tiny_models, tokenizer, name):
    torch._dynamo.reset()
    model = tiny_models[name]
    compiled = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(compile_decode=True, seed=11))
    eager = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(seed=11))
    for prompts in (prompts_with_padding_and_holes, unpadded):
        request = prompts(tokenizer)
        got = compiled.generate(request, greedy())
        expected, mask = reference_rollout(model, request, n=2, max_new_tokens=10, pad_token_id=PAD_ID,
                                           eos_ids=[EOS_ID])
        assert torch.equal(got.input_ids, expected) and torch.equal(got.attention_mask, mask), prompts.__name__
        assert torch.equal(compiled.generate(request, sampled()).input_ids, eager.generate(request, sampled()).input_ids)
    compiled.cfg = HybridEngineRolloutConfig(compile_decode=True, seed=11, enable_profiling=True)
    compiled.generate(prompts_with_padding_and_holes(tokenizer), greedy())  # profiled: hooks break the graph
    assert compiled.get_last_profile().decode_steps > 0
    assert compiled.strategy.compiled.graphs >= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_one_row_multiplies_in_inductors_own_kernels_with_generates_tokens(tiny_models, tokenizer, name):
    """At one row the step's matrix products are inductor's multiply-and-sum (``CPU_MATVEC``), not BLAS calls, and
    the greedy tokens are still generate's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_models[name]
    compiled = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(compile_decode=True))
    request = RolloutRequest(*(t[1:2] for t in tokenizer(["The student", "writes a bc"], return_tensors="pt",
                                                          padding=True).values()))
    got = compiled.generate(request, greedy(12, 1))
    expected, _ = reference_rollout(model, request, n=1, max_new_tokens=12, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    assert torch.equal(got.input_ids, expected)
    assert counters["inductor"]["decompose_mm"] + counters["inductor"]["decompose_addmm"] > 0


@pytest.mark.slow
def test_repeated_calls_and_compaction_buckets_compile_a_bounded_number_of_graphs(tiny_models, tokenizer):
    """Long-tailed rows shrink the batch through several size buckets: the first call compiles (a static graph,
    then one with a symbolic batch), and no later call or bucket compiles again, profiled or not."""
    torch._dynamo.reset()
    model = tiny_models["qwen2-tiny"]
    rollout = rollout_engine(model, tokenizer, compile_decode=True, enable_profiling=True, seed=3,
                             response_lengths="geometric:mean=4")
    request = prompts_with_padding_and_holes(tokenizer)
    rollout.generate(request, sampled(24, 4))
    first = rollout.get_last_profile()
    assert first.compactions >= 2 and 1 <= first.compiled_graphs <= 4, first
    before = compiled_graphs()
    for profiled in (True, False, True):
        rollout.rollout.cfg = HybridEngineRolloutConfig(compile_decode=True, enable_profiling=profiled, seed=3)
        rollout.generate(request, sampled(24, 4))
        if profiled:
            assert rollout.get_last_profile().compiled_graphs == 0  # a new bucket size reuses the symbolic graph
    assert compiled_graphs() == before


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_inductor_compiled_step_over_the_shared_prefix_layout(tiny_models, tokenizer, name):
    """Each prompt stored once under the compiled step: greedy tokens equal generate's (padded prompts, rows
    leaving the batch, continuous batching reusing prefix slots), seeded samples the eager shared layout's."""
    torch._dynamo.reset()
    model = tiny_models[name]
    shared = dict(shared_prefix_min_prompt=1, seed=5)
    compiled = rollout_engine(model, tokenizer, compile_decode=True, **shared)
    eager = rollout_engine(model, tokenizer, **shared)
    request = prompts_with_padding_and_holes(tokenizer)
    expected, _ = reference_rollout(model, request, n=3, max_new_tokens=10, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
    for sampling in (greedy(10, 3), SamplingConfig(max_new_tokens=10, n_samples_per_prompt=3, temperature=0,
                                                   continuous_batch_size=4)):
        assert torch.equal(compiled.generate(request, sampling).input_ids, expected)
        assert compiled.strategy.last_stats.kv_layout == "shared_prefix"
    assert torch.equal(compiled.generate(request, sampled(10, 3)).input_ids,
                       eager.generate(request, sampled(10, 3)).input_ids)



def test_the_warm_up_call_writes_only_the_caches_last_column(tiny_models, tokenizer, monkeypatch):
    """A warm-up is a forward of its own before the step: its keys/values go to the cache's last column (which
    only finished rows write), so every column a row reads is as it was, and nothing is undone after it."""
    torch._dynamo.reset()
    rollout = rollout_engine(tiny_models["llama-tiny"], tokenizer, ignore_eos=True)
    rollout.rollout.strategy = StaticDecode(compile_decode=True, compact_rows=False,
                                            compile_options={"backend": "aot_eager"})
    warm, seen = CompiledStep.warm, []

    def spy(step, model, token, position, column, width, mask, cache, *args, **kwargs):
        before = [(layer.keys[:, :, :-1].clone(), layer.values[:, :, :-1].clone()) for layer in cache.layers]
        graphs = warm(step, model, token, position, column, width, mask, cache, *args, **kwargs)
        kept = all(torch.equal(k, layer.keys[:, :, :-1]) and torch.equal(v, layer.values[:, :, :-1])
                   for (k, v), layer in zip(before, cache.layers))
        seen.append((column.tolist(), cache.length, width, kept))
        return graphs

    monkeypatch.setattr(CompiledStep, "warm", spy)
    request = prompts_with_padding_and_holes(tokenizer)
    batch = rollout.generate(request, greedy(8, 1))
    assert seen and all(column == [length - 1] * len(column) and width is None and kept
                        for column, length, width, kept in seen), seen
    expected, _ = reference_rollout(tiny_models["llama-tiny"], request, n=1, max_new_tokens=8, pad_token_id=PAD_ID,
                                    eos_ids=[])
    assert torch.equal(batch.input_ids, expected)


def test_the_loop_never_compiles_a_step_torch_has_not_warmed():
    """In the loop the step runs under torch's ``fail_on_recompile`` stance: a shape torch would compile (new, or
    after ``torch._dynamo.reset()``, as in a fresh process) is refused with ``NeedsCompile`` until a warm-up call
    compiles it apart; each warm-up counts its graphs with dynamo's counter."""
    def step(x):
        return x * 2

    compiled = CompiledStep(step, {"backend": "eager", "dynamic": False})
    compiled.prepare(torch.device("cpu"))
    with pytest.raises(NeedsCompile):
        compiled(torch.ones(2))
    assert compiled.warm(torch.ones(2)) == 1
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(NeedsCompile):
        compiled(torch.ones(3))  # a new shape
    assert compiled.warm(torch.ones(3)) == 1 and compiled.warm(torch.ones(3)) == 0
    torch._dynamo.reset()
    with pytest.raises(NeedsCompile):
        compiled(torch.ones(2))
    assert compiled.warm(torch.ones(2)) == 1 and compiled.graphs == 3


def test_a_warm_up_on_cuda_graphs_calls_the_step_twice_so_the_recording_is_not_a_decode_step():
    """Inductor's graph trees run a new graph eagerly on its first call and record it on the second: a warm-up on
    CUDA graphs makes both calls, so the first decode step of a shape replays. Elsewhere one call."""
    calls = []

    def step(x):
        calls.append(1)  # dynamo runs the Python once per compile; the eager backend each call
        return x + 1

    assert records_cuda_graphs({"mode": "reduce-overhead"}) and records_cuda_graphs({"mode": "max-autotune"})
    assert not records_cuda_graphs({"mode": "max-autotune-no-cudagraphs"}) and not records_cuda_graphs({})
    assert not records_cuda_graphs({"backend": "eager", "mode": "reduce-overhead"})
    assert records_cuda_graphs({"options": {"triton.cudagraphs": True}})
    once = CompiledStep(torch.compiler.disable(step), {"backend": "eager", "dynamic": False})
    once.prepare(torch.device("cpu"))
    assert not once.records_graphs
    before = len(calls)
    once.warm(torch.ones(2))
    assert len(calls) - before == 1
    twice = CompiledStep(torch.compiler.disable(step), {"backend": "eager", "dynamic": False})
    twice.prepare(torch.device("cpu"))
    twice.records_graphs = True  # as prepare(cuda) sets it for reduce-overhead
    before = len(calls)
    twice.warm(torch.ones(3))
    assert len(calls) - before == 2


def test_a_stance_of_the_callers_own_is_kept():
    """Under a stance the caller set (``force_eager``: dynamo off) the step runs as torch decides, never refused."""
    def step(x):
        return x * 3

    compiled = CompiledStep(step, {"backend": "eager"})
    compiled.prepare(torch.device("cpu"))
    with torch.compiler.set_stance("force_eager"):
        assert [float(compiled(torch.ones(1))) for _ in range(3)] == [3.0, 3.0, 3.0]
        assert compiled.warm(torch.ones(1)) == 0
