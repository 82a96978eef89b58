"""Attribution of hidden rollout phases: ZeRO-3 gathers, PEFT merge/unmerge, gc/empty_cache, the hybrid
engine's methods (on an object with the same names), and the probes always removed; nothing probed beyond the
objects the rollout is handed, nothing charged for another thread."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch

from conftest import left_padded
from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
from opsd_rollout.deepspeed_engine import build_engine
from opsd_rollout.profiling import Clock, PhaseProbes, timed_eval
from opsd_rollout.profiling.profile import ATTRIBUTED_FIELDS
from opsd_rollout.rollout.phases import LAUNCH, add_rollout_probes, zero3_coordinator
from opsd_rollout.rollout.target import resolve_target

PROFILED = HybridEngineRolloutConfig(enable_profiling=True)
MANGLED = "_PartitionedParameterCoordinator__all_gather_params_"
assert LAUNCH == MANGLED  # the rollout counts where DeepSpeed launches; this test counts there on its own too


def assert_shares_add_up(p):
    accounted = p.prefill_ms + p.decode_ms + p.attributed_ms + p.generation_overhead_ms
    assert accounted == pytest.approx(p.generation_ms, rel=1e-6, abs=1e-6)
    shares = p.stage_shares()
    assert all(v >= 0 for v in shares.values())
    assert sum(shares.values()) <= 1.0 + 1e-9
    for name in ATTRIBUTED_FIELDS:
        assert (getattr(p, name) or 0.0) <= p.generation_ms


@pytest.fixture(scope="module")
def zero3(tiny_models):
    return build_engine(copy.deepcopy(tiny_models["llama-tiny"]), 3)


@pytest.mark.parametrize("gather", ["per_layer", "once"])
def test_zero3_rollout_reports_its_parameter_gathers(zero3, tokenizer, gather):
    """Counted independently at DeepSpeed's own launch points: the coordinator's all-gather (per-layer
    fetches) and ``all_gather`` (what GatheredParameters uses for the one gather of ``once``)."""
    coordinator = zero3_coordinator(zero3)
    first = next(zero3.module.parameters())
    gathers, gathered = [], []
    original, original_all_gather = getattr(coordinator, MANGLED), first.all_gather

    def count(params):
        pending = [p for p in params if p.ds_status.name == "NOT_AVAILABLE"]
        if pending:
            gathers.append(1)
            gathered.append(sum(p.ds_numel * p.element_size() for p in pending))

    def coordinator_launch(params, forward, quantize=False):
        count(params)
        return original(params, forward, quantize)

    def all_gather(param_list=None, **kwargs):
        count(param_list or [first])
        return original_all_gather(param_list=param_list, **kwargs)

    setattr(coordinator, MANGLED, coordinator_launch)
    first.all_gather = all_gather
    # DeepSpeed's per-parameter methods while the rollout runs: the rollout replaces none of them
    methods = [(p.all_gather, p.all_gather_coalesced) for p in zero3.module.parameters()]
    touched = []
    handle = zero3.module.register_forward_pre_hook(lambda *_: touched.append(
        [(p.all_gather, p.all_gather_coalesced) for p in zero3.module.parameters()] != methods))
    try:
        rollout = HybridEngineRollout(zero3, tokenizer, HybridEngineRolloutConfig(enable_profiling=True,
                                                                                  zero3_gather=gather))
        rollout.generate(left_padded([[5, 6, 7], [9]], 0), SamplingConfig(max_new_tokens=5, temperature=0))
        assert getattr(coordinator, MANGLED) is coordinator_launch  # ours put back over the test's counter
    finally:
        handle.remove()
        delattr(coordinator, MANGLED)
        first.all_gather = original_all_gather
    assert touched and not any(touched)
    p = rollout.get_last_profile()
    assert p.param_gather_ms > 0
    assert p.param_gather_count == len(gathers) > 0
    assert p.param_gather_bytes == sum(gathered)
    if gather == "once":  # the one gather of the whole model is in the count (the 2-rank test compares modes)
        assert p.param_gather_bytes >= sum(q.ds_numel * q.element_size() for q in zero3.module.parameters())
    assert_shares_add_up(p)
    # probes are gone: nothing of ours is left on the coordinator
    assert not {"fetch_sub_module", MANGLED} & set(vars(coordinator))
    assert all(q.ds_status.name == "NOT_AVAILABLE" for q in zero3.module.parameters()), "partitioned again after"


def test_probes_are_removed_even_when_the_rollout_raises(zero3, tokenizer):
    coordinator = zero3_coordinator(zero3)
    callbacks = list(gc.callbacks)

    def boom(*_):
        raise RuntimeError("planted failure")

    handle = zero3.module.model.layers[0].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="planted"):
            HybridEngineRollout(zero3, tokenizer, PROFILED).generate(left_padded([[5, 6]], 0),
                                                                     SamplingConfig(max_new_tokens=3))
    finally:
        handle.remove()
    assert gc.callbacks == callbacks
    assert not {"fetch_sub_module", MANGLED} & set(vars(coordinator))


def test_gc_inside_a_forward_is_attributed_once(tiny_models, tokenizer):
    model = tiny_models["llama-tiny"]

    def collect(*_):
        gc.collect()  # returns None: a pre-hook's return value would replace the inputs

    handle = model.register_forward_pre_hook(collect)
    try:
        rollout = HybridEngineRollout(model, tokenizer, PROFILED)
        rollout.generate(left_padded([[5, 6, 7]], 0), SamplingConfig(max_new_tokens=4, temperature=0))
    finally:
        handle.remove()
    p = rollout.get_last_profile()
    assert p.gc_ms > 0 and p.empty_cache_ms is None and p.param_gather_ms is None
    assert_shares_add_up(p)
    spans = [s for s in rollout.get_last_timeline() if s.name == "gc"]
    assert len(spans) == 4  # one per forward


def test_peft_merge_is_timed_and_gives_the_unmerged_tokens(tiny_models, tokenizer):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(copy.deepcopy(tiny_models["llama-tiny"]),
                                peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"],
                                                init_lora_weights=False)).eval()
    request = left_padded([[5, 6, 7, 8], [9, 10]], 0)
    sampling = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=2, temperature=0)
    unmerged = HybridEngineRollout(model, tokenizer, PROFILED).generate(request, sampling)
    merging = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(enable_profiling=True,
                                                                              merge_adapters=True))
    merged = merging.generate(request, sampling)
    assert torch.equal(merged.input_ids, unmerged.input_ids)
    p = merging.get_last_profile()
    assert p.lora_fuse_ms > 0 and p.lora_unfuse_ms > 0
    assert_shares_add_up(p)
    assert not any(getattr(m, "merged", False) for m in model.modules())  # unmerged again afterwards
    with pytest.raises(ValueError, match="merge_adapters=True needs a PEFT model"):
        HybridEngineRollout(tiny_models["llama-tiny"], tokenizer, HybridEngineRolloutConfig(merge_adapters=True))


class HybridLike(torch.nn.Module):
    """Has the DeepSpeed hybrid engine's method names and their habit of collecting garbage inside."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.workspace = type("Workspace", (), {"release_workspace": lambda _self: self.calls.append("release")})()

    def retake_inference_cache(self):
        gc.collect()
        self.calls.append("retake")

    def fuse_lora_weight(self):
        self.calls.append("fuse")

    def unfuse_lora_weight(self):
        gc.collect()
        self.calls.append("unfuse")


def test_hybrid_engine_method_names_are_probed_and_restored(tiny_models):
    engine = HybridLike()
    target = resolve_target(tiny_models["llama-tiny"])
    target = type(target)(**{**vars(target), "engine": engine, "hybrid_engine": True})
    probes = PhaseProbes(Clock("cpu"))
    add_rollout_probes(probes, target, merge_adapters=False)
    own_before = set(vars(engine)) | set(vars(engine.workspace))
    with probes:
        engine.fuse_lora_weight()
        engine.retake_inference_cache()
        engine.workspace.release_workspace()
        engine.unfuse_lora_weight()
        gc.collect()  # outside any probed method: its own phase
    totals = probes.totals()
    assert engine.calls == ["fuse", "retake", "release", "unfuse"]
    assert totals["lora_fuse"].calls == 1 and totals["lora_unfuse"].calls == 1
    assert totals["inference_cache"].calls == 2
    assert totals["gc"].calls == 1, "gc inside retake/unfuse is charged to them, not twice"
    assert set(vars(engine)) | set(vars(engine.workspace)) == own_before


def test_train_eval_transitions_are_timed(tiny_models):
    engine = build_engine(copy.deepcopy(tiny_models["llama-tiny"]), 0)
    engine.train()
    with timed_eval(engine) as times:
        assert not engine.module.training
    assert engine.module.training
    assert times.eval_ms > 0 and times.train_ms > 0
    assert set(times.to_dict()) == {"eval_ms", "train_ms", "gc_ms"}


def test_a_switch_that_collects_garbage_is_charged_its_collection(tiny_models):
    engine = build_engine(copy.deepcopy(tiny_models["llama-tiny"]), 0)
    engine.train()
    with timed_eval(engine) as plain:
        pass
    assert plain.gc_ms == 0.0
    switch = engine.eval
    engine.eval = lambda: (gc.collect(), switch())  # what the hybrid engine's eval() does
    try:
        with timed_eval(engine) as collecting:
            pass
    finally:
        del engine.eval
    assert 0 < collecting.gc_ms <= collecting.eval_ms


def test_probes_go_on_objects_never_on_a_module_or_a_class():
    probes = PhaseProbes(Clock("cpu"))
    for owner, name in ((gc, "collect"), (torch.cuda, "empty_cache"), (HybridLike, "fuse_lora_weight")):
        with pytest.raises(TypeError, match="whole process"):
            probes.add(owner, name, "phase")


def test_another_thread_is_neither_charged_nor_disturbed(tiny_models, tokenizer):
    """A served teacher's sender thread runs beside the rollout: its garbage collections and its calls of a probed
    method are not the rollout's (automatic collections off, so that only the other thread collects)."""
    engine = HybridLike()
    target = resolve_target(tiny_models["llama-tiny"])
    target = type(target)(**{**vars(target), "engine": engine, "hybrid_engine": True})
    probes = PhaseProbes(Clock("cpu"))
    add_rollout_probes(probes, target, merge_adapters=False)
    done = []

    def sender():
        gc.collect()
        engine.fuse_lora_weight()
        done.append(engine.fuse_lora_weight.__qualname__)

    enabled = gc.isenabled()
    gc.disable()
    try:
        with probes:
            other = threading.Thread(target=sender)
            other.start()
            other.join()
            engine.unfuse_lora_weight()  # collects inside: charged to lora_unfuse
    finally:
        if enabled:
            gc.enable()
    totals = probes.totals()
    assert done and engine.calls == ["fuse", "unfuse"]
    assert totals["lora_fuse"].calls == 0 and totals["lora_unfuse"].calls == 1
    assert totals["gc"].calls == 0


def test_a_rollout_in_one_thread_is_not_charged_another_threads_collections(tiny_models, tokenizer):
    stop, collected = threading.Event(), []

    # Full collections 50 ms apart. Back to back, each holding the GIL for as long as the whole suite's heap takes,
    # they left the rollout's thread a 5 ms slice between them: in one fast-tier run this test took 15 minutes.
    def collecting():
        while not stop.is_set():
            collected.append(gc.collect())
            stop.wait(0.05)

    enabled = gc.isenabled()
    gc.disable()
    other = threading.Thread(target=collecting)
    other.start()
    try:
        rollout = HybridEngineRollout(tiny_models["llama-tiny"], tokenizer, PROFILED)
        for _ in range(100):  # until a collection ends while a rollout runs
            before = len(collected)
            rollout.generate(left_padded([[5, 6, 7]], 0), SamplingConfig(max_new_tokens=6, temperature=0))
            if len(collected) > before:
                break
    finally:
        stop.set()
        other.join()
        if enabled:
            gc.enable()
    assert len(collected) > before and rollout.get_last_profile().gc_ms is None
