"""One-off reproducer of the step-time*.json files beside it (RESULTS.md, issues 35 and 51): ``train``'s steps, whose
overlap reaches across micro-batches; the step bench's ``opsd-rollout step --teacher-serving in-process,json,compact
--teacher-overlaps on,off --split-cores`` is the measurement to rerun (one step at a time, the bench's statistics).

A training step with a served teacher against the same teacher in process, runs alternating in one process:
``train`` on the built-in corpus (student ``llama-tiny``, teacher ``--teacher``, a top-k cache with the tail
bucket on both sides, so all sides train the same loss), the served sides against our server on loopback (a thread
of this process, or with ``--server process`` its own ``opsd-rollout serve-teacher`` process), answering vLLM's JSON
(a server started with ``--no-compact-answers``) or the compact answer (``--answers``), its requests waited for
(``--no-teacher-overlap``) or in flight behind the student's work (``--overlaps``). Reports, over every round, the
median step time of each side, its teacher latency and wait, and the share of the latency hidden.

    python benchmarks/serve/served_step_time.py --rounds 2 --steps 8 --accumulation 2 --server process \\
        [--split-cores] [--answers json,compact] [--overlaps waited,overlapped] --output benchmarks/serve/step-time.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from opsd_rollout.distributed import free_port
from opsd_rollout.files import write_text_atomic
from opsd_rollout.train import TrainConfig, train

ANSWERS = ("json", "compact")
OVERLAPS = ("waited", "overlapped")


def thread_server(model: str, compact: bool):
    """Our server as a thread of this process: its forwards and answers share this process's interpreter."""
    from opsd_rollout.models import load_model
    from opsd_rollout.serve import ServeConfig, TeacherServer

    teacher, tokenizer = load_model(model)
    server = TeacherServer(ServeConfig(model=model, port=0, compact_answers=compact), model=teacher,
                           tokenizer=tokenizer).start()
    return server.url, server.stop


def process_server(model: str, compact: bool, cores: set[int] | None = None):
    """``opsd-rollout serve-teacher`` in its own process, as a user runs it: on the same cores as the run, or on
    ``cores`` alone with as many threads (a teacher on its own machine, in miniature)."""
    port = free_port()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(len(cores))} if cores else {}))
    server = subprocess.Popen([sys.executable, "-m", "opsd_rollout", "serve-teacher", "--model", model, "--port",
                               str(port), *([] if compact else ["--no-compact-answers"])],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    for line in server.stdout:
        if "serving teacher" in line:
            break
    else:
        raise RuntimeError(f"serve-teacher exited with status {server.wait()}")

    def stop():
        server.terminate()
        server.wait(timeout=30)

    return f"http://127.0.0.1:{port}", stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default="llama-mini")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--server", choices=("thread", "process"), default="thread")
    parser.add_argument("--split-cores", action="store_true", help="the server process on the last core, the run "
                        "on the others, one thread a core each: the teacher's compute off the student's cores, as "
                        "on its own machine (with --server process)")
    parser.add_argument("--answers", default=",".join(ANSWERS), help="the served sides' answers: json (vLLM's, "
                        "from a server started with --no-compact-answers), compact (ours)")
    parser.add_argument("--overlaps", default=",".join(OVERLAPS), help="the served sides' requests: waited "
                        "(--no-teacher-overlap), overlapped (in flight behind the student's work)")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    answers, overlaps = args.answers.split(","), args.overlaps.split(",")
    if not set(answers) <= set(ANSWERS) or not set(overlaps) <= set(OVERLAPS):
        parser.error(f"--answers takes {','.join(ANSWERS)} and --overlaps {','.join(OVERLAPS)}")
    cores = None
    if args.split_cores:
        if args.server != "process":
            parser.error("--split-cores needs --server process")
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            parser.error("--split-cores needs two cores")
        os.sched_setaffinity(0, set(cores[:-1]))
        torch.set_num_threads(len(cores) - 1)
    servers = {}  # the servers wait idle while the other side's run steps
    for answer in answers:
        compact = answer == "compact"
        servers[answer] = (process_server(args.teacher, compact, {cores[-1]}) if cores else
                           process_server(args.teacher, compact) if args.server == "process" else
                           thread_server(args.teacher, compact))
    common = dict(student="llama-tiny", teacher=args.teacher, steps=args.steps, eval_every=10**6, eval_prompts=1,
                  teacher_cache="topk", teacher_top_k=64, top_k_rest="tail", progress=False,
                  gradient_accumulation_steps=args.accumulation)
    served = {"in-process": {}}
    served.update({f"served {answer}, {overlap}": {"teacher_url": servers[answer][0],
                                                   "teacher_overlap": overlap == "overlapped"}
                   for answer in answers for overlap in overlaps})
    sides = tuple(served)
    times: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    load = [os.getloadavg()[0]]
    try:
        for round_ in range(args.rounds):
            for side in (sides if round_ % 2 == 0 else sides[::-1]):
                with tempfile.TemporaryDirectory() as out:
                    result = train(TrainConfig.from_flat({**common, **served[side], "output_dir": out}))
                seen = times[side]
                for record in (r for r in result.records if r["step"] > 1):  # the first step warms up
                    figures = {"step_ms": record["time/step_ms"],
                               "teacher_ms": record["time/teacher_forward_ms"] + record["time/cache_write_ms"]
                               + record["time/teacher_wait_ms"],
                               "teacher_latency_ms": record.get("time/teacher_latency_ms", 0.0),
                               "teacher_wait_ms": record["time/teacher_wait_ms"],
                               "hidden_share": record.get("time/teacher_hidden_share") or 0.0}
                    for name, value in figures.items():
                        seen.setdefault(name, []).append(value)
                load.append(os.getloadavg()[0])
    finally:
        for _, stop in servers.values():
            stop()
    summary = {side: {name: statistics.median(values) for name, values in seen.items()}
               for side, seen in times.items()}
    for side, f in summary.items():
        print(f"{side}: step {f['step_ms']:.0f} ms, teacher on the step's path {f['teacher_ms']:.0f} ms, latency "
              f"{f['teacher_latency_ms']:.0f} ms, hidden {f['hidden_share']:.0%} (medians)")
    base = summary["in-process"]["step_ms"]
    ratios = {side: summary[side]["step_ms"] / base for side in sides[1:]}
    print("over in-process step time: " + ", ".join(f"{side} {ratio:.2f}" for side, ratio in ratios.items()))
    if args.output:
        write_text_atomic(Path(args.output), json.dumps({
            "command": " ".join(["python", "benchmarks/serve/served_step_time.py", *(argv or sys.argv[1:])]),
            "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, Python {platform.python_version()}",
            "load_average_1min": {"min": min(load), "max": max(load)}, "config": vars(args),
            "medians": summary, "over_in_process": ratios, "raw": times,
            "when": time.strftime("%Y-%m-%d %H:%M")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
