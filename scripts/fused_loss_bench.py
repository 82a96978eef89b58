"""The OPSD loss and step at a real vocabulary (issue 18), side by side:

  loss  the fused LM head + divergence (loss and backward, from the student's hidden states and head) against
        DeepSpeed 0.19.8's ``generalized_jsd_loss`` forward + backward over materialized logits of the same shape
        (and our unfused chunked divergence), interleaved in one process, medians; then each contender once in a
        fresh process for its peak memory;
  step  whole ``opsd_step`` on Qwen2-shaped random models (student d=64 / 2 layers, teacher d=256 / 4 layers,
        tied embeddings) at the chosen vocabulary, fused against unfused, interleaved, medians of every part; then
        each once in a fresh process for the step's peak memory;
  big   one step of many rows and long responses with a top-k teacher cache (the full cache is refused first, by
        its budget), fused, in a fresh process.

Every figure on CPU is process RSS (peak since the call started, and before it). Runs under
``flock /tmp/opsd-bench.lock`` on shared machines:

    flock /tmp/opsd-bench.lock python scripts/fused_loss_bench.py loss --rounds 3
    flock /tmp/opsd-bench.lock python scripts/fused_loss_bench.py step --rounds 3
    flock /tmp/opsd-bench.lock python scripts/fused_loss_bench.py big --batch-size 16 --response-length 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from opsd_rollout.bench.timing import interleaved_times  # noqa: E402
from opsd_rollout.bench.workload import workload_rollout  # noqa: E402
from opsd_rollout.profiling.memory import PeakMemory  # noqa: E402

GiB = 2**30


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def peak_of(fn: Callable[[], Any]) -> dict[str, int]:
    """Run ``fn`` once: the process's RSS before and its peak during the call (Linux VmHWM, reset first)."""
    before = rss_bytes()
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    fn()
    peak, source = memory.stop()
    return {"rss_before_bytes": before, "peak_rss_bytes": peak, "source": source}


# ----- loss: fused against DeepSpeed's generalized_jsd_loss over materialized logits -----

def loss_contenders(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    from deepspeed.runtime.rollout import generalized_jsd_loss

    from opsd_rollout.opsd import DivergenceConfig, chunked_divergence
    from opsd_rollout.opsd.fused import fused_divergence

    g = torch.Generator().manual_seed(0)
    rows, window, size, vocab = args.rows, args.response_length, args.hidden, args.vocab
    hidden = torch.randn(rows, window, size, generator=g)
    weight = torch.randn(vocab, size, generator=g) / size**0.5
    teacher = torch.randn(rows, window, vocab, generator=g) * 2  # the full cache, as the step holds it
    top = torch.topk(teacher, args.top_k, dim=-1) if args.top_k else None
    cache = teacher if top is None else (top.values, top.indices.int())
    mask = torch.ones(rows, window, dtype=torch.bool)
    config = DivergenceConfig(loss="jsd", beta=args.beta)

    def fused() -> None:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        total, count = fused_divergence(h, w, None, cache, mask, config)
        (total / count).backward()

    def materialized() -> torch.Tensor:  # what the student's forward would have made: logits [N, R, V]
        return (hidden @ weight.T).requires_grad_()

    def deepspeed() -> None:
        logits = materialized()
        generalized_jsd_loss(logits, teacher, mask, beta=args.beta, teacher_top_k=args.top_k or None).loss.backward()

    def unfused() -> None:
        logits = materialized()
        chunk = (lambda s, e: teacher[:, s:e]) if top is None else (lambda s, e: (cache[0][:, s:e], cache[1][:, s:e]))
        total, count = chunked_divergence(logits, chunk, mask, config)
        (total / count).backward()

    contenders = {"fused": fused, "deepspeed": deepspeed}
    if args.with_unfused:
        contenders["unfused"] = unfused
    return contenders


def run_loss(args: argparse.Namespace) -> dict[str, Any]:
    contenders = loss_contenders(args)
    if args.measure:
        return peak_of(contenders[args.measure])
    times = interleaved_times(contenders, args.rounds, warmup=1)
    medians = {name: statistics.median(values) for name, values in times.items()}
    memory = {name: fresh_process(args, name) for name in contenders}
    return {"times_ms": times, "median_ms": medians, "memory": memory,
            "ratio_deepspeed_over_fused": medians["deepspeed"] / medians["fused"]}


# ----- step: whole opsd_step, fused against unfused -----

def qwen2_shaped(hidden: int, layers: int, heads: int, vocab: int):
    from opsd_rollout.presets import ModelPreset

    kwargs = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), intermediate_size=4 * hidden, vocab_size=vocab,
                  max_position_embeddings=4096, tie_word_embeddings=True)
    return ModelPreset(name=f"qwen2-d{hidden}", arch="qwen2", description="", config_kwargs=kwargs).build()


def step_setup(args: argparse.Namespace) -> Callable[[bool, str], Any]:
    from opsd_rollout import SamplingConfig
    from opsd_rollout.bench.prompts import synthetic_prompts
    from opsd_rollout.deepspeed_engine import build_engine
    from opsd_rollout.models import byte_tokenizer
    from opsd_rollout.opsd import DivergenceConfig, TeacherCacheConfig, opsd_step

    tokenizer = byte_tokenizer()
    student = qwen2_shaped(args.student_hidden, args.student_layers, 4, args.vocab).train()
    teacher = qwen2_shaped(args.teacher_hidden, args.teacher_layers, 4, args.vocab).requires_grad_(False)
    engine = build_engine(student, 0, lr=1e-5)
    rollout = workload_rollout(engine, tokenizer, "fixed", enable_profiling=True)
    request = synthetic_prompts(args.batch_size, args.prompt_length, vocab_size=args.vocab, seed=0)
    sampling = SamplingConfig(max_new_tokens=args.response_length, n_samples_per_prompt=args.samples_per_prompt,
                              temperature=1.0, top_k=50)

    def step(fused: bool, cache: str) -> Any:
        top_k = int(cache[3:]) if cache.startswith("top") else 64
        return opsd_step(engine, teacher, rollout, request, sampling,
                         divergence=DivergenceConfig(loss="jsd", beta=0.5, fused=fused),
                         teacher_cache=TeacherCacheConfig(mode="full" if cache == "full" else "topk", top_k=top_k))

    return step


PARTS = ("total_ms", "rollout_ms", "teacher_forward_ms", "cache_write_ms", "student_forward_ms", "loss_ms",
         "backward_ms", "optimizer_ms", "rollout_share", "peak_memory_bytes", "peak_loss_bytes",
         "peak_backward_bytes", "teacher_cache_bytes", "teacher_cache_budget_bytes", "loss")


def summary(profiles: list[Any]) -> dict[str, float]:
    data = [p.to_dict() for p in profiles]
    return {key: statistics.median(d[key] for d in data) for key in PARTS if key in data[0]}


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    step = step_setup(args)
    if args.measure:  # a fresh process: one warm-up step, then one step whose profile holds its peak memory
        fused = args.measure == "fused"
        step(fused, args.teacher_cache)
        started = time.perf_counter()
        profile = step(fused, args.teacher_cache)
        return {**summary([profile]), "wall_s": time.perf_counter() - started}
    profiles: dict[str, list[Any]] = {"fused": [], "unfused": []}

    def contender(fused: bool) -> Callable[[], None]:
        return lambda: profiles["fused" if fused else "unfused"].append(step(fused, args.teacher_cache))

    times = interleaved_times({"fused": contender(True), "unfused": contender(False)}, args.rounds, warmup=1)
    medians = {name: summary(found[1:]) for name, found in profiles.items()}  # the warm-up round left out
    memory = {name: fresh_process(args, name) for name in profiles}
    return {"times_ms": times, "medians": medians, "memory": memory,
            "ratio_loss_backward_unfused_over_fused": (
                (medians["unfused"]["loss_ms"] + medians["unfused"]["backward_ms"])
                / (medians["fused"]["loss_ms"] + medians["fused"]["backward_ms"]))}


def run_big(args: argparse.Namespace) -> dict[str, Any]:
    if not args.measure:
        return fresh_process(args, "fused")
    from opsd_rollout.opsd import TeacherCacheConfig
    from opsd_rollout.opsd.teacher import plan_mode

    out: dict[str, Any] = {}
    full = TeacherCacheConfig()
    try:  # what the step's full cache meets before its teacher runs: the budget
        plan_mode(full, args.batch_size * args.samples_per_prompt, args.response_length, args.vocab, torch.float32,
                  full.budget())
    except ValueError as error:
        out["full_cache_refused"] = str(error)
    step = step_setup(args)
    started = time.perf_counter()
    profile = step(True, args.teacher_cache)
    out.update(summary([profile]), wall_s=time.perf_counter() - started, response_tokens=profile.response_tokens,
               rollout=profile.rollout.to_dict() if profile.rollout is not None else None)
    return out


# ----- plumbing -----

def fresh_process(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """This command again with ``--measure NAME`` in a new process (clean RSS), its JSON result."""
    from opsd_rollout.distributed import environment_without_ranks  # this process's group must not leak into it

    command = [sys.executable, __file__, *args.argv, "--measure", name, "--output", "-"]
    result = subprocess.run(command, capture_output=True, text=True, env=environment_without_ranks())
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def without_output(argv: list[str]) -> list[str]:
    """``argv`` without ``--output FILE`` / ``--output=FILE`` (a fresh process prints its result instead)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--output":
            skip = True
        elif not item.startswith("--output="):
            out.append(item)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("kind", choices=("loss", "step", "big"))
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=8, help="loss: rows (B x n)")
    parser.add_argument("--hidden", type=int, default=64, help="loss: the student's hidden size")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--student-hidden", type=int, default=64)
    parser.add_argument("--student-layers", type=int, default=2)
    parser.add_argument("--teacher-hidden", type=int, default=256)
    parser.add_argument("--teacher-layers", type=int, default=4)
    parser.add_argument("--teacher-cache", default="full", help="step/big: full or top<k> (big: default top64)")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--top-k", type=int, default=0, help="loss: a top-k teacher cache (0: full)")
    parser.add_argument("--with-unfused", action="store_true", help="loss: also our unfused chunked divergence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--output", default="-", help="JSON file (default: stdout)")
    args = parser.parse_args()
    args.argv = without_output(sys.argv[1:])
    if args.kind == "big" and args.teacher_cache == "full" and "--teacher-cache" not in sys.argv:
        args.teacher_cache = "top64"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = {"loss": run_loss, "step": run_step, "big": run_big}[args.kind](args)
    if not args.measure:
        result = {"command": "python scripts/fused_loss_bench.py " + " ".join(sys.argv[1:]),
                  "threads": args.threads, "torch": torch.__version__, **result}
    text = json.dumps(result, indent=None if args.measure else 1, default=str)
    if args.output == "-":
        print(text)
    else:
        with open(args.output, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
