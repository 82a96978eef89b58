"""The static strategy on every transformers release we accept: the KV cache goes to the model under the keyword
its forward takes (``cache`` from 5.23 on, ``past_key_values`` before), a forward that ignores its cache is
caught instead of decoding wrong tokens, and the compiled step's shapes and addresses stay bounded."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import re
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import LlamaForCausalLM

from conftest import prompts_with_padding_and_holes, reference_rollout, rollout_engine
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
from opsd_rollout.modeling import cache_keyword
from opsd_rollout.models import EOS_ID, PAD_ID
from opsd_rollout.rollout.compiled import CompiledStep, bucket
from opsd_rollout.rollout.strategies.static import StaticDecode

INSTALLED_KEYWORD = cache_keyword(LlamaForCausalLM.__new__(LlamaForCausalLM))


class PastKeyValuesLlama(LlamaForCausalLM):
    """A Llama whose forward takes the cache as ``past_key_values``, as releases before 5.23 do."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        past_key_values = past_key_values if past_key_values is not None else kwargs.pop("cache", None)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, logits_to_keep=logits_to_keep,
                               **{INSTALLED_KEYWORD: past_key_values}, **kwargs)


def test_no_script_shadows_a_package_a_dependency_looks_for():
    """A script's folder is first on ``sys.path`` while it runs (and ``scripts/`` is on the tests' ``pythonpath``), so
    a module there named like a package transformers probes for replaces that package: transformers 5.25 imports
    ``kernels`` at import, and a ``scripts/kernels.py`` broke every import of a model. The probed names are read from
    the installed release; every folder of ``scripts/`` and ``benchmarks/`` holding a script is checked."""
    root = Path(__file__).resolve().parents[1]
    folders = {path.parent for top in ("scripts", "benchmarks") for path in (root / top).rglob("*.py")
               if not (path.parent / "__init__.py").is_file()}  # a package's modules are not on the path
    ours = {path.stem for folder in folders for path in folder.glob("*.py")} | {
        path.name for folder in folders for path in folder.iterdir() if (path / "__init__.py").is_file()}
    source = Path(importlib.util.find_spec("transformers.utils.import_utils").origin).read_text()
    probed = set(re.findall(r'_is_package_available\(\s*"([\w.]+)"', source))
    assert {"torch", "accelerate"} <= probed, "transformers no longer probes packages by _is_package_available"
    installed = set(importlib.metadata.packages_distributions())
    assert not ours & (probed | installed), f"scripts/ shadows {sorted(ours & (probed | installed))}"


def test_the_installed_release_names_its_cache_keyword():
    expected = "cache" if Version(transformers.__version__) >= Version("5.23") else "past_key_values"
    assert INSTALLED_KEYWORD == expected


def test_the_cache_goes_under_the_keyword_the_models_forward_takes(tiny_models, tokenizer):
    reference = tiny_models["llama-tiny"]
    model = PastKeyValuesLlama(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy="static"))
    assert rollout.target.cache_keyword == "past_key_values" and rollout.strategy.name == "static"
    request = prompts_with_padding_and_holes(tokenizer)
    for n in (1, 3):  # unshared and shared prefill
        batch = rollout.generate(request, SamplingConfig(max_new_tokens=8, n_samples_per_prompt=n, temperature=0))
        expected, _ = reference_rollout(reference, request, n=n, max_new_tokens=8, pad_token_id=PAD_ID,
                                        eos_ids=[EOS_ID])
        assert torch.equal(batch.input_ids, expected)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("whole_cache", [False, True])
def test_a_forward_that_ignores_its_cache_fails_loudly(tiny_models, tokenizer, n, whole_cache):
    """What transformers < 5.23 did with ``cache=``: swallowed by ``**kwargs``, the model ran uncached."""
    rollout = rollout_engine(tiny_models["llama-tiny"], tokenizer, strategy="static", whole_cache=whole_cache)
    spec = dataclasses.replace(rollout.target.spec, cache_keyword="a_name_the_model_ignores")
    rollout.target = dataclasses.replace(rollout.target, spec=spec)
    with pytest.raises(RuntimeError, match="did not use the cache"):
        rollout.generate(prompts_with_padding_and_holes(tokenizer),
                         SamplingConfig(max_new_tokens=4, n_samples_per_prompt=n, temperature=0))


def test_buckets_are_powers_of_two_with_a_floor():
    assert [bucket(v, 64) for v in (1, 63, 64, 65, 128, 129, 1000)] == [64, 64, 64, 128, 128, 256, 1024]
    assert [bucket(v) for v in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def test_prompt_lengths_within_a_bucket_share_one_compiled_graph(tiny_models, tokenizer):
    """``dynamic=False`` compiles per shape: cache lengths are bucketed, so prompts of several lengths (and
    repeated calls) reuse one graph instead of compiling one per length until torch's limit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_models["llama-tiny"]
    rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(strategy="static"))
    rollout.strategy = StaticDecode(compile_decode=True, compact_rows=False,  # one batch size: see test_compaction
                                    compile_options={"backend": "aot_eager", "dynamic": False})
    before = rollout.strategy.compiled.graphs
    for length in (5, 9, 13, 9):
        ids = torch.randint(3, 259, (2, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        request = type(prompts_with_padding_and_holes(tokenizer))(ids, mask)
        batch = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=0))
        expected, _ = reference_rollout(model, request, n=1, max_new_tokens=6, pad_token_id=PAD_ID, eos_ids=[EOS_ID])
        assert torch.equal(batch.input_ids, expected)
    assert counters["stats"]["unique_graphs"] == 1
    assert rollout.strategy.compiled.graphs - before <= 1


def test_reaching_the_recompile_limit_is_a_warning(caplog):
    torch._dynamo.reset()
    # torch's own patch: pytest's monkeypatch deletes the attribute on undo, which hides the setting for every
    # later compile in the process ("torch._dynamo.config.recompile_limit does not exist")
    with torch._dynamo.config.patch(recompile_limit=2):
        check_recompile_warning(caplog)


def check_recompile_warning(caplog):
    def step(x):
        return x + 1

    compiled = CompiledStep(step, {"backend": "eager", "dynamic": False})
    compiled.prepare(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="opsd_rollout.rollout.compiled"):
        assert compiled.warm(torch.zeros(1)) == 1 and compiled.warm(torch.zeros(2)) == 1
        assert not caplog.records
        assert compiled.warm(torch.zeros(3)) == 0  # past the limit: run eagerly, warned
    assert compiled.exhausted and compiled.graphs == 2
    assert any("recompile limit of 2" in r.getMessage() for r in caplog.records)
    assert torch.equal(compiled(torch.zeros(3)), torch.ones(3))  # the loop's calls of that shape run eagerly


def test_a_compiled_layouts_tensors_keep_their_addresses_across_calls(tiny_models, tokenizer):
    """CUDA-graph trees re-record when a static input moves: the cache and the key/value views of one shape are
    the same objects on every call, also after a call of another shape (the write columns are an argument of
    the step, not a static input)."""
    rollout = rollout_engine(tiny_models["llama-tiny"], tokenizer, strategy="static", whole_cache=True)
    request = prompts_with_padding_and_holes(tokenizer)
    small = type(request)(request.prompt_ids[:1], request.prompt_attention_mask[:1])

    def addresses():
        cache = rollout.strategy.workspace.cache(rollout.target.forward_module.config, 3,
                                                 request.prompt_ids.shape[1] + 5, torch.float32,
                                                 torch.device("cpu"), whole=True)
        return [(id(cache), layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]

    rollout.generate(request, SamplingConfig(max_new_tokens=5, temperature=0))
    first = addresses()
    rollout.generate(small, SamplingConfig(max_new_tokens=3, temperature=0))
    rollout.generate(request, SamplingConfig(max_new_tokens=5, temperature=0))
    assert addresses() == first
    assert len({address[0] for address in first}) == 1  # one cache holding every layer


def _hybrid_like(*flags: bool):
    """An engine as DeepSpeed's hybrid engine leaves it: one inference container per swapped decoder layer."""
    from types import SimpleNamespace

    return SimpleNamespace(_inference_containers=[
        SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(return_tuple=flag, return_single_tuple=False)))
        for flag in flags])


def test_the_hybrid_engines_tuple_layers_are_refused_before_generating(tiny_models, tokenizer, monkeypatch):
    """DeepSpeed's inference layers return tuples; transformers 5 passes tensors from layer to layer."""
    from opsd_rollout.rollout import engine as engine_module
    from opsd_rollout.rollout.target import hybrid_engine_problem, resolve_target

    assert hybrid_engine_problem(_hybrid_like()) is None  # no layer swapped: nothing breaks
    assert hybrid_engine_problem(_hybrid_like(False, False)) is None
    problem = hybrid_engine_problem(_hybrid_like(True, True))
    assert "2 decoder layers" in problem and "hybrid_engine.enabled off" in problem
    hybrid = _hybrid_like(True)
    target = dataclasses.replace(resolve_target(tiny_models["llama-tiny"]), engine=hybrid, hybrid_engine=True)
    monkeypatch.setattr(engine_module, "resolve_target", lambda _engine: target)
    with pytest.raises(ValueError, match="returns? tuples"):
        HybridEngineRollout(hybrid, tokenizer)


def test_a_guard_that_fails_on_a_warmed_shape_is_refused_in_the_loop():
    """Not only new shapes: anything that makes torch compile again (here a guarded constant; in a rollout, other
    forward hooks or a dtype) is refused inside the loop, so the loop warms it apart instead of compiling in a
    decode step."""
    from opsd_rollout.rollout.compiled import NeedsCompile

    scale = {"value": 2}

    def step(x):
        return x * scale["value"]

    compiled = CompiledStep(step, {"backend": "eager", "dynamic": False})
    compiled.prepare(torch.device("cpu"))
    compiled.warm(torch.ones(2))
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    scale["value"] = 5
    with pytest.raises(NeedsCompile):
        compiled(torch.ones(2))
    assert compiled.warm(torch.ones(2)) == 1 and torch.equal(compiled(torch.ones(2)), torch.full((2,), 5.0))
