"""Checks that need a CUDA GPU, in one call (for a lent GPU machine): prints one table, exits non-zero on a
failure. On a machine without CUDA it says so and exits 0 without checking anything.

    python scripts/gpu_check.py [--model llama-small] [--dtype fp16]
    python scripts/gpu_check.py --cpu --model llama-tiny     # rehearsal: the checks a CPU can run, fp32

Sections:
- strategies: greedy tokens of static (eager, whole-cache, compiled with CUDA graphs) equal generate's; the
  speed of each, greedy and sampling;
- compiled decode with profiling on: forwards timed around the graph, no recompilation between calls;
- flex attention (its CPU kernels fail to compile in this torch build): static equals generate;
- forward timer on CUDA events: counts and split match the forwards that ran, no synchronization per forward;
- hybrid engine rollout (DeepSpeed hybrid engine, release_inference_cache on): greedy tokens equal the bare
  model's; inference_cache_ms, gc_ms, empty_cache_ms attributed; lora_fuse/unfuse when DeepSpeed sees LoRA;
- PEFT LoRA with merge_adapters: fuse/unfuse timed, greedy tokens equal unmerged;
- ZeRO-3 rollout: param_gather_ms, count and bytes attributed; gather-once against per-layer gathering.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback

import torch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _request(tokenizer, device):
    from opsd_rollout import RolloutRequest

    enc = tokenizer(["On-policy distillation on a GPU", "Hi"], padding=True, return_tensors="pt")
    return RolloutRequest(enc.input_ids.to(device), enc.attention_mask.to(device))


def check_forward_timer(model, tokenizer, device, _dtype):
    from opsd_rollout import HybridEngineRollout, SamplingConfig
    from opsd_rollout.profiling import profile_model_time

    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with profile_model_time(model, use_cuda_events=True) as timer:
            HybridEngineRollout(model, tokenizer).generate(_request(tokenizer, device),
                                                           SamplingConfig(max_new_tokens=16, temperature=0))
            split = timer.model_times(split=True)
    finally:
        handle.remove()
    n = len(split["prefill"]) + len(split["decode"])
    assert n == len(calls), f"timer saw {n} forwards, the model ran {len(calls)}"
    assert all(t > 0 for t in split["prefill"] + split["decode"])
    return f"{n} forwards, median decode {sorted(split['decode'])[len(split['decode']) // 2]:.2f} ms"


def check_hybrid_engine(model, tokenizer, device, dtype):
    import deepspeed

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
    from opsd_rollout.deepspeed_engine import deepspeed_config, init_distributed

    init_distributed()
    config = deepspeed_config(0, dtype=dtype)
    config["hybrid_engine"] = {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1,
                               "release_inference_cache": True, "pin_parameters": True,
                               "tp_gather_partition_size": 8}
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=config,
                                      model_parameters=list(model.parameters()))
    sampling = SamplingConfig(max_new_tokens=16, temperature=0)
    request = _request(tokenizer, device)
    expected = HybridEngineRollout(model, tokenizer).generate(request, sampling)
    rollout = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
    engine.eval()
    batch = rollout.generate(request, sampling)
    engine.train()
    p = rollout.get_last_profile()
    assert rollout.target.hybrid_engine, "the engine is not a DeepSpeedHybridEngine"
    assert (p.inference_cache_ms or 0) > 0, f"inference_cache_ms={p.inference_cache_ms}"
    assert (p.gc_ms or 0) > 0 and (p.empty_cache_ms or 0) > 0, f"gc_ms={p.gc_ms} empty_cache_ms={p.empty_cache_ms}"
    same = torch.equal(batch.input_ids, expected.input_ids)
    lora = len(getattr(engine, "all_lora_params", []))
    if lora:
        assert (p.lora_fuse_ms or 0) > 0 and (p.lora_unfuse_ms or 0) > 0
    return (f"cache {p.inference_cache_ms:.2f} ms, gc {p.gc_ms:.2f} ms, empty_cache {p.empty_cache_ms:.2f} ms, "
            f"greedy tokens equal bare model: {same}, DeepSpeed LoRA params: {lora}")


def check_peft_merge(model, tokenizer, device, _dtype):
    import peft

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig

    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                                      init_lora_weights=False)).eval()
    sampling = SamplingConfig(max_new_tokens=16, temperature=0)
    request = _request(tokenizer, device)
    unmerged = HybridEngineRollout(lora, tokenizer).generate(request, sampling)
    rollout = HybridEngineRollout(lora, tokenizer, HybridEngineRolloutConfig(enable_profiling=True,
                                                                             merge_adapters=True))
    merged = rollout.generate(request, sampling)
    p = rollout.get_last_profile()
    assert p.lora_fuse_ms > 0 and p.lora_unfuse_ms > 0
    agree = (merged.input_ids == unmerged.input_ids).float().mean().item()
    return f"fuse {p.lora_fuse_ms:.2f} ms, unfuse {p.lora_unfuse_ms:.2f} ms, token agreement {agree:.3f}"


def check_zero3(model, tokenizer, device, _dtype):
    """Attribution of the ZeRO-3 gather, and gather-once against per-layer gathering on one engine."""
    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
    from opsd_rollout.deepspeed_engine import build_engine

    engine = build_engine(copy.deepcopy(model), 3)
    sampling = SamplingConfig(max_new_tokens=16, temperature=0)
    times = {}
    for gather in ("once", "per_layer"):
        rollout = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=True,
                                                                                   zero3_gather=gather))
        for _ in range(2):
            rollout.generate(_request(tokenizer, device), sampling)
        times[gather] = rollout.get_last_profile()
    p = times["once"]
    assert p.param_gather_ms > 0 and p.param_gather_count > 0 and p.param_gather_bytes > 0
    return (f"gather {p.param_gather_ms:.1f} ms of {p.generation_ms:.1f} ms generation, {p.param_gather_count} "
            f"all-gathers, {p.param_gather_bytes / 2**20:.1f} MiB; per-layer {times['per_layer'].total_ms:.1f} ms vs "
            f"once {p.total_ms:.1f} ms ({times['per_layer'].total_ms / p.total_ms:.2f}x)")


def check_strategies(model, tokenizer, device, _dtype):
    """Greedy equivalence and speed of every strategy (compiled CUDA-graph decode included) on one shape."""
    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
    from opsd_rollout.bench.prompts import synthetic_prompts

    request = synthetic_prompts(4, 128, vocab_size=model.config.vocab_size, seed=0)
    request = type(request)(request.prompt_ids.to(device), request.prompt_attention_mask.to(device))
    variants = {"generate": dict(strategy="generate"), "static": dict(strategy="static"),
                "static, whole cache": dict(strategy="static", static_shapes=True)}
    if device.type == "cuda":
        variants["static+compile"] = dict(strategy="static", compile_decode=True)
    results = {}
    for decoding, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        sampling = SamplingConfig(max_new_tokens=64, n_samples_per_prompt=4, temperature=temperature, top_k=50)
        for name, kwargs in variants.items():
            rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(ignore_eos=True, seed=0, **kwargs))
            for _ in range(2):  # warm up (compilation, graph capture)
                batch = rollout.generate(request, sampling)
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(5):
                batch = rollout.generate(request, sampling)
            _synchronize(device)
            results[name, decoding] = ((time.perf_counter() - start) / 5 * 1e3, batch.input_ids)
    reference = results["generate", "greedy"][1]
    for name in variants:
        agree = (results[name, "greedy"][1] == reference).float().mean().item()
        assert agree > 0.99, f"{name} greedy tokens agree with generate on only {agree:.3f} of positions"
    speedups = [f"{name} {decoding} {results['generate', decoding][0] / results[name, decoding][0]:.2f}x"
                for name in variants if name.startswith("static") for decoding in ("greedy", "sampling")]
    return ("; ".join(f"{name}/{decoding} {ms:.1f} ms" for (name, decoding), (ms, _) in results.items())
            + "; vs generate: " + ", ".join(speedups))


def check_compiled_profiled(model, tokenizer, device, _dtype):
    """A profiled compiled decode: forwards timed around the graph, no recompilation between calls."""
    from torch._dynamo.utils import counters

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig

    rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(compile_decode=True,
                                                                              enable_profiling=True))
    sampling = SamplingConfig(max_new_tokens=16, temperature=0, n_samples_per_prompt=2)
    rollout.generate(_request(tokenizer, device), sampling)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(3):
        rollout.generate(_request(tokenizer, device), sampling)
    p = rollout.get_last_profile()
    assert counters["stats"]["unique_graphs"] == graphs, "the compiled step recompiled between calls"
    assert p.decode_steps > 0 and p.decode_ms > 0, p
    return (f"TPOT {p.tpot_ms:.2f} ms, decode {p.decode_ms:.1f} ms over {p.decode_steps} steps, {graphs} graphs "
            "(profiled: the graph breaks at the forward timer's hooks, so this TPOT is not the unprofiled one)")


def check_flex_attention(model, tokenizer, device, _dtype):
    """Flex attention (its kernel compiled once: the static strategy keeps the whole-cache shapes for it)."""
    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig

    flex = copy.deepcopy(model)
    flex.set_attn_implementation("flex_attention")
    sampling = SamplingConfig(max_new_tokens=16, temperature=0)
    request = _request(tokenizer, device)
    expected = HybridEngineRollout(flex, tokenizer, HybridEngineRolloutConfig(strategy="generate")).generate(
        request, sampling)
    batch = HybridEngineRollout(flex, tokenizer).generate(request, sampling)
    agree = (batch.input_ids == expected.input_ids).float().mean().item()
    assert agree > 0.99, f"static and generate agree on only {agree:.3f} of positions"
    return f"greedy tokens agree with generate on {agree:.3f} of positions"


CHECKS = [("strategies: equivalence and speed", check_strategies),  # (name, check, needs CUDA)
          ("compiled decode, profiled", check_compiled_profiled, True),
          ("flex attention", check_flex_attention, True),
          ("forward timer (CUDA events)", check_forward_timer, True),
          ("hybrid engine rollout", check_hybrid_engine, True),
          ("PEFT merge_adapters", check_peft_merge),
          ("ZeRO-3 gather: attribution, once vs per layer", check_zero3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--cpu", action="store_true",
                        help="rehearse on the CPU (fp32): run the checks that need no CUDA, skip the others")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing checked (--cpu rehearses what a CPU can run)")
        return 0
    from opsd_rollout.models import load_model, parse_dtype

    device, dtype = (torch.device("cpu"), "fp32") if args.cpu else (torch.device("cuda"), args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    rows, failed = [], 0
    for name, check, *cuda_only in CHECKS:
        start = time.perf_counter()
        if cuda_only and device.type != "cuda":
            rows.append((name, "SKIP", "-", "needs CUDA"))
            continue
        try:
            detail, status = check(model, tokenizer, device, parse_dtype(dtype)), "PASS"
        except Exception as error:  # noqa: BLE001 - every check reports, the script goes on
            detail, status = f"{type(error).__name__}: {error}", "FAIL"
            traceback.print_exc()
            failed += 1
        rows.append((name, status, f"{time.perf_counter() - start:.1f}s", detail))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU rehearsal"
    print(f"\n{where}, {args.model} {dtype}")
    print("| check | status | time | detail |\n|---|---|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
