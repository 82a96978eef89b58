"""``python scripts/bench_kernels.py``: the kernels matrix's flags (one per axis, then its settings) on the package's
benchmark command line (``opsd_rollout.cli.bench``: config files, dry run, resume, ``--nproc``), so a kernels run
writes the same result document as ``bench`` and ``step``, which ``opsd-rollout compare`` reads."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

from kernel_bench.scenario import KernelsScenario
from opsd_rollout import cli
from opsd_rollout.cli.bench import BenchCommand, add_bench_flags, run_matrix
from opsd_rollout.cli.common import common_flags

SCRIPT = Path(__file__).resolve().parents[1] / "bench_kernels.py"


def add_kernel_settings(runs: argparse._ArgumentGroup, defaults: Any) -> None:
    runs.add_argument("--model", help="the model of the attention, weight_layout, compile and profiling kernels: "
                      f"preset name or local checkpoint directory (default {defaults.model})")
    runs.add_argument("--temperature", type=float, help=f"the sampling kernel's temperature (default "
                      f"{defaults.temperature})")
    runs.add_argument("--repeats", type=int, metavar="N", help="calls of each side per timed sample in the sampling "
                      f"and weight_layout kernels, for calls too short to time alone (default {defaults.repeats})")
    runs.add_argument("--hidden-size", dest="hidden_size", type=int, metavar="H", help="the fused_loss student's "
                      f"hidden size: its LM head is [vocab, H] (default {defaults.hidden_size})")
    runs.add_argument("--beta", type=float, help=f"the fused_loss generalized JSD's beta (default {defaults.beta})")


COMMAND = BenchCommand(
    "kernels", KernelsScenario, "benchmark kernels: ours against a baseline, side by side", "Benchmark the pieces "
    "that are neither a rollout nor a step, each ours against a baseline (the code it replaced, or upstream's), both "
    "in every iteration, their order alternating. Default: every kernel but compile at 16 rows, vocabulary 32,000, "
    "prompt 128, response 32, 4 samples per prompt, on llama-small.", add_kernel_settings,
    workload_flags=False,  # its sampling knobs are axes; it makes no prompts
    launch=(str(SCRIPT),))


def build_parser() -> argparse.ArgumentParser:
    parser = cli.FullFlags(prog="python scripts/bench_kernels.py", parents=[common_flags()],
                           description=COMMAND.description)
    add_bench_flags(parser, COMMAND)
    parser.set_defaults(func=partial(run_matrix, command=COMMAND), command=COMMAND.name)
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, build_parser())
