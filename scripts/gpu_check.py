"""Every check that needs a CUDA GPU, in one call on a lent GPU machine: each row (PASS/FAIL/SKIP, time,
detail) is printed the moment its check ends, so a run cut off by a timeout still says what ran; the exit
status is non-zero on a failure. Each check asserts what it proves (a graph replayed, no host sync, equal
tokens); timings are reported beside, never asserted.

    python scripts/gpu_check.py [--model llama-small] [--dtype bf16]
    python scripts/gpu_check.py --cpu --model llama-tiny     # rehearsal: the checks a CPU can run, fp32

On the GPU machine, with the wheels of ``make gpu-bundle`` (see the README, "Checking on a GPU"). Equality
checks run in fp32 (near-ties in bf16 flip argmaxes for numeric reasons); speed in ``--dtype``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.bench.timing import interleaved_medians
from opsd_rollout.models import load_model, parse_dtype


class Context:
    """What every check gets: the model in the speed dtype, an fp32 copy for equality, the tokenizer, device."""

    def __init__(self, name: str, dtype: str, device: torch.device):
        self.device, self.name, self.dtype_name = device, name, dtype
        self.model, self.tokenizer = load_model(name, dtype=dtype, device=device)
        self.fp32 = self.model if dtype == "fp32" else load_model(name, dtype="fp32", device=device)[0]
        self.dtype = parse_dtype(dtype)

    def request(self, batch: int = 2, length: int = 24, seed: int = 0, padded: bool = True) -> RolloutRequest:
        request = synthetic_prompts(batch, length, vocab_size=self.model.config.vocab_size, seed=seed,
                                    pad_fraction=0.25 if padded else 0.0)
        return RolloutRequest(request.prompt_ids.to(self.device), request.prompt_attention_mask.to(self.device))

    def rollout(self, model: torch.nn.Module | None = None, **config: Any) -> HybridEngineRollout:
        return HybridEngineRollout(model if model is not None else self.fp32, self.tokenizer,
                                   HybridEngineRolloutConfig(**config))


def greedy(max_new_tokens: int = 16, n: int = 1) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n, temperature=0.0)


def sampled(max_new_tokens: int = 16, n: int = 2) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, n_samples_per_prompt=n, temperature=1.0, top_k=50,
                          top_p=0.95)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return 0.0
    return (a == b).float().mean().item()


@contextlib.contextmanager
def counting(owner: Any, name: str) -> Iterator[list[int]]:
    """Count calls of ``owner.name`` (a class or module attribute) for the block."""
    original, calls = getattr(owner, name), []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


# ---- checks that a CPU can rehearse ----------------------------------------------------------------------

def check_strategies(ctx: Context) -> str:
    """Greedy tokens of every static variant equal generate's (fp32); same seed, same samples; speed."""
    request = ctx.request(batch=4, length=64)
    variants = {"static": dict(strategy="static"), "static, whole cache": dict(strategy="static", static_shapes=True)}
    if ctx.device.type == "cuda":
        variants["static, compiled"] = dict(strategy="static", compile_decode=True)
    expected = ctx.rollout(strategy="generate").generate(request, greedy(32, 2)).input_ids
    for name, config in variants.items():
        got = ctx.rollout(**config).generate(request, greedy(32, 2)).input_ids
        assert agreement(got, expected) > 0.99, f"{name}: greedy tokens agree with generate on " \
                                                f"{agreement(got, expected):.3f} of positions (fp32)"
    eager = [ctx.rollout(strategy="static", seed=7).generate(request, sampled(32)).input_ids for _ in range(2)]
    assert torch.equal(eager[0], eager[1]), "the same seed gave different samples"
    detail = ["greedy fp32 tokens equal generate's"]
    if ctx.device.type == "cuda":
        compiled = ctx.rollout(strategy="static", compile_decode=True, seed=7).generate(request, sampled(32)).input_ids
        detail.append(f"compiled vs eager same-seed samples agree on {agreement(compiled, eager[0]):.3f}")
        assert agreement(compiled, eager[0]) > 0.95, detail[-1]
    fixed = dict(ignore_eos=True, seed=0)
    contenders = {name: (lambda r=ctx.rollout(ctx.model, **config, **fixed): r.generate(request, sampled(64, 4)))
                  for name, config in {"generate": dict(strategy="generate"), **variants}.items()}
    medians = interleaved_medians(contenders, rounds=3, warmup=2, device=ctx.device)
    detail.append("sampled B4 n4 P64 R64 ms: " + ", ".join(f"{k} {v:.1f} ({medians['generate'] / v:.2f}x)"
                                                        for k, v in medians.items()))
    return "; ".join(detail)


def check_profile_metadata(ctx: Context) -> str:
    """A profile says which timer and which memory counter it used, and they are the device's."""
    rollout = ctx.rollout(ctx.model, enable_profiling=True)
    rollout.generate(ctx.request(), greedy())
    p = rollout.get_last_profile()
    if ctx.device.type == "cuda":
        assert (p.timer, p.peak_memory_source) == ("cuda_events", "cuda_max_allocated"), (p.timer, p.peak_memory_source)
    else:
        assert p.timer == "synchronized_clock" and p.peak_memory_source.startswith("process_rss"), p
    assert p.peak_memory_bytes > 0 and p.decode_steps == 15 and p.decode_ms > 0
    return f"timer {p.timer}, memory {p.peak_memory_source} {p.peak_memory_bytes / 2**20:.0f} MiB"


def check_opsd_step(ctx: Context) -> str:
    """A whole OPSD step on the device: teacher cache pinned on the host, loss finite, parameters move."""
    from opsd_rollout.deepspeed_engine import build_engine
    from opsd_rollout.opsd import DivergenceConfig, TeacherCacheConfig, opsd_step
    from opsd_rollout.opsd.teacher import buffers_for

    student, _ = load_model("qwen2-tiny", device=ctx.device)  # not the teacher: something to learn
    engine = build_engine(student.train(), 0, lr=1e-3)
    rollout = ctx.rollout(engine, enable_profiling=True)
    before = [p.detach().clone() for p in engine.module.parameters()]
    profiles = [opsd_step(engine, ctx.fp32, rollout, ctx.request(), sampled(16),
                          divergence=DivergenceConfig(loss="jsd", beta=0.5),
                          teacher_cache=TeacherCacheConfig(mode=mode, top_k=64)) for mode in ("full", "topk", "topk")]
    assert all(0 < p.loss < float("inf") for p in profiles), [p.loss for p in profiles]
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters())), "no parameter moved"
    if ctx.device.type == "cuda":
        assert all(t.is_pinned() for t in buffers_for(ctx.fp32)._buffers.values()), "teacher cache not pinned"
    p = profiles[-1]
    return (f"step {p.total_ms:.1f} ms (rollout {p.rollout_ms:.1f}, teacher {p.teacher_forward_ms:.1f}, cache write "
            f"{p.cache_write_ms:.1f}, backward {p.backward_ms:.1f}), loss {p.loss:.3f}")


def check_peft_merge(ctx: Context) -> str:
    """PEFT adapters merged for the rollout: fuse/unfuse timed, greedy tokens equal unmerged (fp32)."""
    import peft

    lora = peft.get_peft_model(copy.deepcopy(ctx.fp32), peft.LoraConfig(
        r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    request = ctx.request()
    unmerged = ctx.rollout(lora).generate(request, greedy())
    rollout = ctx.rollout(lora, enable_profiling=True, merge_adapters=True)
    merged = rollout.generate(request, greedy())
    p = rollout.get_last_profile()
    assert p.lora_fuse_ms > 0 and p.lora_unfuse_ms > 0
    assert agreement(merged.input_ids, unmerged.input_ids) > 0.99, agreement(merged.input_ids, unmerged.input_ids)
    return f"fuse {p.lora_fuse_ms:.2f} ms, unfuse {p.lora_unfuse_ms:.2f} ms, tokens equal unmerged (fp32)"


def check_zero3(ctx: Context) -> str:
    """ZeRO-3: the gather attributed (time, count, bytes); gather-once against per-layer, timed unprofiled."""
    from opsd_rollout.deepspeed_engine import build_engine

    engine = build_engine(copy.deepcopy(ctx.model), 3)
    request = ctx.request()
    profiled = ctx.rollout(engine, enable_profiling=True)
    profiled.generate(request, greedy())
    p = profiled.get_last_profile()
    assert p.param_gather_ms > 0 and p.param_gather_count > 0 and p.param_gather_bytes > 0, p
    contenders = {gather: (lambda r=ctx.rollout(engine, zero3_gather=gather, ignore_eos=True):
                           r.generate(request, greedy(32)))
                  for gather in ("once", "per_layer")}
    medians = interleaved_medians(contenders, rounds=3, device=ctx.device)
    return (f"gather {p.param_gather_ms:.1f} ms, {p.param_gather_count} all-gathers, "
            f"{p.param_gather_bytes / 2**20:.1f} MiB; unprofiled B2 R32: once {medians['once']:.1f} ms, per layer "
            f"{medians['per_layer']:.1f} ms ({medians['per_layer'] / medians['once']:.2f}x)")


# ---- CUDA only ---------------------------------------------------------------------------------------------

def check_long_tail(ctx: Context) -> str:
    """Row compaction and continuous batching on a long-tailed sampled workload: the same tokens for every
    ``continuous_batch_size`` and without compaction (scheduling-independent random numbers), utilisation exact;
    on CUDA the compiled step too, its CUDA graphs one per batch bucket, none recorded again on a second call."""
    request = ctx.request(batch=6, length=24)
    lengths = dict(response_lengths="geometric:mean=6", seed=3)
    runs = {}
    for name, config, slots in (("plain", dict(compact_rows=False), None), ("compacted", {}, None),
                                ("continuous 4", {}, 4), ("continuous 1", {}, 1)):
        rollout = ctx.rollout(ctx.fp32, enable_profiling=True, **lengths, **config)
        batch = rollout.generate(request, SamplingConfig(**{**vars(sampled(48, 2)), "continuous_batch_size": slots}))
        profile = rollout.get_last_profile()
        real = int(batch.attention_mask[:, int(batch.response_start_idx[0]):].sum())
        assert profile.live_row_utilisation == real / profile.row_steps, (name, profile.live_row_utilisation)
        runs[name] = (batch.input_ids, profile)
    for name, (ids, _) in runs.items():
        assert torch.equal(ids, runs["plain"][0]), f"{name}: other tokens than without compaction"
    detail = [f"same tokens for {len(runs)} schedules; utilisation " + ", ".join(
        f"{name} {profile.live_row_utilisation:.2f}" for name, (_, profile) in runs.items()),
        f"{runs['compacted'][1].compactions} compactions"]
    if ctx.device.type == "cuda":
        from torch._inductor import cudagraph_trees

        compiled = ctx.rollout(ctx.fp32, compile_decode=True, **lengths)
        with counting(cudagraph_trees.CUDAGraphNode, "_record") as recordings:
            for slots in (None, 4):
                got = compiled.generate(request, SamplingConfig(**{**vars(sampled(48, 2)), "continuous_batch_size": slots}))
                assert agreement(got.input_ids, runs["plain"][0]) > 0.95, "compiled long-tail tokens differ"
            first = len(recordings)
            for slots in (None, 4):
                compiled.generate(request, SamplingConfig(**{**vars(sampled(48, 2)), "continuous_batch_size": slots}))
        assert len(recordings) == first, f"re-recorded {len(recordings) - first} graphs on the second calls"
        detail.append(f"compiled: {first} CUDA-graph recordings ({compiled.strategy.compiled.graphs} shapes), "
                      "none on the second calls")
    fast = ctx.rollout(ctx.model, response_lengths="lognormal:median=12,sigma=1.0", seed=0)
    plain = ctx.rollout(ctx.model, response_lengths="lognormal:median=12,sigma=1.0", seed=0, compact_rows=False)
    batch, n, cap = (16, 4, 128) if ctx.device.type == "cuda" else (4, 2, 64)  # the CPU rehearsal: smaller
    wide = ctx.request(batch=batch, length=64)
    medians = interleaved_medians({"compacted": lambda: fast.generate(wide, sampled(cap, n)),
                                   "plain": lambda: plain.generate(wide, sampled(cap, n))}, rounds=3, device=ctx.device)
    detail.append(f"lognormal B{batch} n{n} P64 R<={cap}: compacted {medians['compacted']:.0f} ms vs "
                  f"{medians['plain']:.0f} ms ({medians['plain'] / medians['compacted']:.2f}x)")
    return "; ".join(detail)


def check_compiled_speed(ctx: Context) -> str:
    """``scripts/compile_cost.py``'s per-token comparison on the GPU: eager vs compiled (CUDA graphs) at B = 1, 4,
    16, 32, equal tokens asserted, the speed-up and each side's share of the measured copy bandwidth reported."""
    import argparse
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("compile_cost", Path(__file__).with_name("compile_cost.py"))
    compile_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_cost)
    args = argparse.Namespace(model=ctx.name, batch_sizes=[1, 4, 16, 32], prompt_length=64, rounds=5)
    rows = compile_cost.per_token(args, device=str(ctx.device), dtype=ctx.dtype_name)
    assert all(row["equal_tokens"] for row in rows) or ctx.dtype_name != "fp32", "compiled tokens differ"
    return "; ".join(f"B{row['batch_size']}: {row['eager_ms_per_token']:.2f} -> {row['compiled_ms_per_token']:.2f} "
                     f"ms/token ({row['speedup']:.2f}x), bandwidth {row['eager_bandwidth_utilisation']:.0%} -> "
                     f"{row['compiled_bandwidth_utilisation']:.0%}, tokens {'equal' if row['equal_tokens'] else 'differ'}"
                     for row in rows)


def check_cuda_graphs(ctx: Context) -> str:
    """The compiled step replays CUDA graphs: none skipped, and no new recording once every bucket was seen,
    across prompt lengths within a bucket, training steps between rollouts and profiled calls."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    model = copy.deepcopy(ctx.model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    rollout = ctx.rollout(model, compile_decode=True, ignore_eos=True)
    lengths = (20, 33, 41)  # + 16 new tokens: cache lengths 36..57, one bucket (64)
    counters["inductor"].clear()
    with counting(cudagraph_trees.CUDAGraphNode, "_record") as recordings:
        for length in lengths:  # every shape once: the recordings happen here
            rollout.generate(ctx.request(length=length), greedy())
        first = len(recordings)
        for round_ in range(2):
            for length in lengths:
                model.eval()
                rollout.generate(ctx.request(length=length, seed=round_), sampled())
                model.train()  # a training step between rollouts updates parameters in place
                model(input_ids=ctx.request().prompt_ids).logits.float().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    skips = counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"{skips} CUDA-graph skips"
    assert len(recordings) == first, f"re-recorded: {first} recordings, then {len(recordings) - first} more"
    release = ctx.rollout(ctx.model, compile_decode=True, ignore_eos=True, cache_policy="release")
    with counting(cudagraph_trees.CUDAGraphNode, "_record") as release_recordings:
        for _ in range(3):
            release.generate(ctx.request(), greedy())
    return (f"{first} recordings for {len(lengths)} prompt lengths, none after 6 more calls with training steps; "
            f"0 skips; cache_policy=release: {len(release_recordings)} recordings in 3 calls "
            f"({rollout.strategy.compiled.graphs} compiled shapes in this process)")


def check_no_host_sync(ctx: Context) -> str:
    """The decode loop never waits on the device (``set_sync_debug_mode('error')`` raises on a sync), eager and
    compiled, greedy and sampled, when no early exit is asked for."""
    from opsd_rollout.rollout.strategies.static import StaticDecode

    original = StaticDecode._decode

    def strict(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    ran = []
    StaticDecode._decode = strict
    try:
        for compiled in (False, True):
            rollout = ctx.rollout(ctx.model, compile_decode=compiled, ignore_eos=True, seed=0)
            for sampling in (greedy(), sampled()):
                rollout.generate(ctx.request(), sampling)
                ran.append(f"{'compiled' if compiled else 'eager'}/{'greedy' if sampling.temperature <= 0 else 'sampled'}")
    finally:
        StaticDecode._decode = original
    return "no synchronization in " + ", ".join(ran)


def check_forward_timer(ctx: Context) -> str:
    """profile_model_time on CUDA events: one time per forward that ran, prefill/decode split."""
    from opsd_rollout.profiling import profile_model_time

    calls = []
    handle = ctx.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with profile_model_time(ctx.model, use_cuda_events=True) as timer:
            ctx.rollout(ctx.model).generate(ctx.request(), greedy())
            split = timer.model_times(split=True)
    finally:
        handle.remove()
    n = len(split["prefill"]) + len(split["decode"])
    assert n == len(calls) and len(split["prefill"]) == 1, (n, len(calls), len(split["prefill"]))
    assert all(t > 0 for t in split["prefill"] + split["decode"])
    return f"{n} forwards timed, median decode {sorted(split['decode'])[len(split['decode']) // 2]:.2f} ms"


def check_shared_prefix(ctx: Context) -> str:
    """Shared-prefix attention on the device: greedy tokens equal the copied layout's and generate's (fp32), also
    compacted, under continuous batching and compiled (CUDA graphs); same-seed samples agree in the speed dtype;
    decode speed (eager and compiled) and KV bytes side by side."""
    request, shared = ctx.request(length=160), dict(shared_prefix_min_prompt=1, enable_profiling=True)
    expected = ctx.rollout(strategy="generate").generate(request, greedy(16, 4)).input_ids
    variants = ((None, False), (3, False), (None, True), (3, True))
    if ctx.device.type != "cuda":  # the CPU rehearsal compiles once (inductor takes tens of seconds a graph)
        variants = variants[:2] + variants[3:]
    for slots, compiled in variants:
        rollout = ctx.rollout(compile_decode=compiled, **shared)
        got = rollout.generate(request, SamplingConfig(**{**vars(greedy(16, 4)), "continuous_batch_size": slots}))
        assert rollout.get_last_profile().kv_layout == "shared_prefix"
        assert agreement(got.input_ids, expected) > 0.99, \
            f"slots {slots}, compiled {compiled}: {agreement(got.input_ids, expected):.3f}"
    samples = [ctx.rollout(ctx.model, seed=3, shared_prefix=on).generate(request, sampled(16, 4)).input_ids
               for on in (False, True)]
    detail = [f"fp32 greedy equal; {ctx.dtype} same-seed samples agree on {agreement(*samples):.3f}"]
    assert agreement(*samples) > 0.9, detail[-1]
    long = ctx.request(length=1024 if ctx.device.type == "cuda" else 256, padded=False)
    rollouts = {name: ctx.rollout(ctx.model, ignore_eos=True, shared_prefix=on, compile_decode=compiled,
                                  enable_profiling=True)
                for name, on, compiled in (("copied", False, False), ("shared", True, False),
                                           ("shared compiled", True, True))}
    medians = interleaved_medians({name: (lambda r=r: r.generate(long, greedy(32, 8))) for name, r in rollouts.items()},
                                  rounds=3, warmup=1, device=ctx.device)
    kv = {name: r.get_last_profile().kv_workspace_bytes / 2**20 for name, r in rollouts.items()}
    detail.append(f"B2 n8 P{long.prompt_ids.shape[1]} R32 ms: copied {medians['copied']:.1f}, shared "
                  f"{medians['shared']:.1f} ({medians['copied'] / medians['shared']:.2f}x), shared compiled "
                  f"{medians['shared compiled']:.1f}; KV MiB {kv['copied']:.1f} vs {kv['shared']:.1f}")
    return "; ".join(detail)


def check_flex_attention(ctx: Context) -> str:
    """Flex attention: the static strategy keeps whole-cache shapes so its kernel compiles once."""
    flex = copy.deepcopy(ctx.fp32)
    flex.set_attn_implementation("flex_attention")
    request = ctx.request()
    expected = ctx.rollout(flex, strategy="generate").generate(request, greedy())
    got = ctx.rollout(flex).generate(request, greedy())
    assert agreement(got.input_ids, expected.input_ids) > 0.99, agreement(got.input_ids, expected.input_ids)
    return "greedy tokens equal generate's (fp32)"


def check_hybrid_engine(ctx: Context) -> str:
    """DeepSpeed's hybrid engine with transformers 5: refused before generating, with the reason; DeepSpeed's
    own rollout on the same engine shows the reason is real. Builds DeepSpeed's inference kernels (minutes)."""
    import deepspeed
    from deepspeed.runtime.rollout import HybridEngineRollout as DeepSpeedRollout

    from opsd_rollout.deepspeed_engine import deepspeed_config, init_distributed

    init_distributed()
    config = deepspeed_config(0, dtype=ctx.dtype)
    config["hybrid_engine"] = {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1,
                               "release_inference_cache": True, "pin_parameters": True, "tp_gather_partition_size": 8}
    model = copy.deepcopy(ctx.model)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    try:
        ctx.rollout(engine)
    except ValueError as error:
        refusal = str(error)
    else:
        raise AssertionError("the hybrid engine was accepted")
    engine.eval()
    try:
        DeepSpeedRollout(engine, ctx.tokenizer).generate(ctx.request(), greedy())
        upstream = "DeepSpeed's own rollout ran: the refusal may be too strict"
    except Exception as error:  # noqa: BLE001 - the failure is the finding
        upstream = f"DeepSpeed's own rollout fails too: {type(error).__name__}: {str(error)[:120]}"
    finally:
        engine.train()
    return f"refused ({refusal[:80]}...); {upstream}"


CHECKS: list[tuple[str, Callable[[Context], str], bool]] = [  # (name, check, needs CUDA)
    ("strategies: equal tokens, seeds, speed", check_strategies, False),
    ("profile metadata", check_profile_metadata, False),
    ("long tail: compaction, continuous batching", check_long_tail, False),
    ("compiled step replays CUDA graphs", check_cuda_graphs, True),
    ("no host sync in the decode loop", check_no_host_sync, True),
    ("forward timer (CUDA events)", check_forward_timer, True),
    ("compiled step: speed and bandwidth per batch", check_compiled_speed, True),
    ("OPSD step and teacher cache", check_opsd_step, False),
    ("PEFT merge_adapters", check_peft_merge, False),
    ("ZeRO-3 gather: attribution, once vs per layer", check_zero3, False),
    ("shared-prefix attention: tokens, samples, speed", check_shared_prefix, False),
    ("flex attention", check_flex_attention, True),
    ("hybrid engine refused with its reason", check_hybrid_engine, True),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--cpu", action="store_true",
                        help="rehearse on the CPU (fp32): run the checks that need no CUDA, skip the others")
    parser.add_argument("--only", metavar="TEXT", help="run only the checks whose name contains TEXT")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing checked (--cpu rehearses what a CPU can run)")
        return 0
    device, dtype = (torch.device("cpu"), "fp32") if args.cpu else (torch.device("cuda"), args.dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU rehearsal"
    print(f"{where}, {args.model} {dtype}, torch {torch.__version__}\n| check | status | time | detail |\n"
          "|---|---|---:|---|", flush=True)
    ctx = Context(args.model, dtype, device)
    failed = 0
    for name, check, cuda_only in CHECKS:
        if args.only and args.only not in name:
            continue
        start = time.perf_counter()
        if cuda_only and device.type != "cuda":
            status, detail = "SKIP", "needs CUDA"
        else:
            try:
                status, detail = "PASS", check(ctx)
            except Exception as error:  # noqa: BLE001 - every check reports; the script goes on
                status, detail = "FAIL", f"{type(error).__name__}: {error}"
                traceback.print_exc(file=sys.stderr)
                failed += 1
        print(f"| {name} | {status} | {time.perf_counter() - start:.1f}s | {detail} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
