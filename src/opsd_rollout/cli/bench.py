"""The benchmark subcommands (``bench``, ``step``): one flag per matrix axis, then the scenario's settings, mapped
onto the scenario's dataclasses; a run on one rank or relaunched on several, a dry run, a resumed run. A benchmark
command is a ``BenchCommand``: the developers' kernel benchmarks (``scripts/bench_kernels.py``) are one too, built from
the same pieces outside the package. Light: no torch at import; the runner loads when a run starts."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

from opsd_rollout import checks
from opsd_rollout.bench.configfile import read_config_file, split_config
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.report import load_document
from opsd_rollout.bench.scenarios import RolloutScenario, Scenario, StepScenario
from opsd_rollout.bench.scenarios.rollout import PROMPT_KINDS
from opsd_rollout.bench.scenarios.step import OVER_BUDGET
from opsd_rollout.cli.common import LOCAL_RANK_FLAGS, console
from opsd_rollout.metrics import parse_size


@dataclass(frozen=True)
class BenchCommand:
    """A benchmark command: the scenario it runs and the flags of the settings only it has."""

    name: str
    scenario: type[Scenario]
    help: str
    description: str
    settings_flags: Callable[[argparse._ArgumentGroup, Any], None]
    """Adds the flags of the scenario's own settings (the group, the settings' defaults)."""
    workload_flags: bool = True
    """Whether it takes the prompts', sampling's and contenders' flags (a scenario that makes no prompts does not)."""
    launch: tuple[str, ...] = ("-m", "opsd_rollout")
    """What ``--nproc`` runs on each rank, before the command's own arguments."""


def add_model_flag(runs: argparse._ArgumentGroup, defaults: Any) -> None:
    runs.add_argument("--model", help="preset name (see `opsd-rollout models`) or a local checkpoint directory "
                      f"(default {defaults.model})")


def add_step_flags(runs: argparse._ArgumentGroup, defaults: Any) -> None:
    runs.add_argument("--student", dest="model", help=f"student: preset name or local checkpoint (default "
                      f"{defaults.model})")
    runs.add_argument("--teacher", help=f"teacher of the same vocabulary (default {defaults.teacher})")
    runs.add_argument("--lr", type=float, help=f"student AdamW learning rate (default {defaults.lr:g})")
    runs.add_argument("--fused-loss", dest="fused_loss", type=_on_off, metavar="on|off", help="on (default): "
                      "the student's LM head computed inside the loss, a chunk of tokens at a time, its logits "
                      "never whole; off: the model's logits [N, R, V], then the chunked divergence")
    runs.add_argument("--teacher-zero-stage", dest="teacher_zero_stage", type=int, choices=(0, 3),
                      help="0 (default): the teacher whole on every rank; 3: a DeepSpeed ZeRO-3 inference "
                      "engine, its parameters partitioned across the ranks")
    runs.add_argument("--estimator", choices=("k1", "k3"), help="sampled_reverse_kl's per-token estimate: k1 "
                      "(default), or k3 (verl's low-variance estimator)")
    runs.add_argument("--teacher-cache-budget", dest="teacher_cache_budget_bytes", type=_bytes, metavar="SIZE",
                      help="host memory the teacher cache may take, e.g. 8GiB (default: half of the memory "
                      "available when it is built); checked before the teacher runs")
    runs.add_argument("--teacher-cache-over-budget", dest="teacher_cache_over_budget", choices=OVER_BUDGET,
                      help="a teacher cache over its budget: error (default: refuse, naming the fixes) or topk "
                      "(cache the top-k logits instead)")
    runs.add_argument("--split-cores", dest="split_cores", action="store_true", default=None, help="with "
                      "--teacher-serving json or compact: the teacher's server on the last core (one thread), this "
                      "run on the others, one thread a core: the teacher off the student's cores, as on a machine of "
                      "its own (default: both on every core)")


COMMANDS: tuple[BenchCommand, ...] = (
    BenchCommand("bench", RolloutScenario, "benchmark rollouts over a matrix of shapes", "Benchmark rollouts over a "
                 "matrix of shapes. With no flags: a smoke matrix (batch 1,4 x samples 1,4 x prompt 128 x response "
                 "32, greedy, llama-small).", add_model_flag),
    BenchCommand("step", StepScenario, "benchmark whole OPSD steps (rollout, teacher, student update)", "Benchmark "
                 "whole on-policy distillation steps on DeepSpeed: rollout, teacher forward into a host logit cache, "
                 "student forward, divergence, backward, optimizer step. Default: student llama-tiny, teacher "
                 "llama-small, B 2 x n 2 x prompt 32 x response 32, jsd(0.5), ZeRO 0 and 3.", add_step_flags),
)
"""The benchmark subcommands of ``opsd-rollout``."""


def add_bench_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    for command in COMMANDS:
        parser = sub.add_parser(command.name, parents=[common], help=command.help, description=command.description)
        add_bench_flags(parser, command)
        parser.set_defaults(func=partial(run_matrix, command=command))


def _warmup(text: str) -> int | str:
    """argparse type of --warmup: ``auto`` or a count."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number, got {text!r}") from None


_on_off = checks.argument(checks.on_off, str)
"""argparse type of on/off flags."""


def _bytes(text: str) -> int:
    """argparse type of sizes: bytes, or a number with KiB, MiB, GiB or TiB (``8GiB``, ``1.5GiB``)."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte such as 8GiB, 512MiB or 1000000 "
                                         f"(bytes), got {text!r}") from None


def add_bench_flags(bench: argparse.ArgumentParser, command: BenchCommand) -> None:
    scenario = command.scenario
    axes = bench.add_argument_group("matrix axes (comma lists; override --config)")
    for axis in scenario.axes:
        default = ",".join(map(axis.text, scenario.defaults[axis.name]))
        said = "(default)" in axis.help  # the help names its default already
        axes.add_argument(axis.flag, dest=axis.name, metavar="LIST",
                          help=axis.help if said else f"{axis.help} (default {default})")
    defaults = scenario.settings_type()
    runs = bench.add_argument_group("settings (override --config)")
    runs.add_argument("--config", metavar="FILE", help="TOML, JSON or YAML file with axes and settings")
    command.settings_flags(runs, defaults)
    _add_measuring_flags(runs, defaults)
    if command.workload_flags:
        _add_workload_flags(runs, defaults)
    _add_output_flags(bench, scenario)


def _add_measuring_flags(runs: argparse._ArgumentGroup, defaults: Any) -> None:
    runs.add_argument("--warmup", type=_warmup, metavar="auto|N", help="unmeasured calls per config before "
                      "measuring: auto (default) warms up until two consecutive calls agree within "
                      f"{defaults.steady_tolerance:.0%}%, N makes exactly N")
    runs.add_argument("--warmup-max-iterations", type=int, metavar="N", help="most warm-up calls per config with "
                      f"--warmup auto (default {defaults.warmup_max_iterations})")
    runs.add_argument("--warmup-max-seconds", type=float, metavar="S", help="most seconds of warm-up per config "
                      f"with --warmup auto (default {defaults.warmup_max_seconds:g})")
    runs.add_argument("--iterations", type=int, help=f"measured iterations per config, in each process (default "
                      f"{defaults.iterations})")
    runs.add_argument("--processes", type=int, metavar="K", help="measure every config in K fresh processes, one "
                      "after the other, each warming up and measuring --iterations, so the spread between processes "
                      "is measured and compare can judge by it (4 or more a side; default "
                      f"{defaults.processes}: this process alone)")
    runs.add_argument("--seed", type=int, help=f"seed for prompts and sampling (default {defaults.seed})")


def _add_workload_flags(runs: argparse._ArgumentGroup, defaults: Any) -> None:
    # the setting is `prompts` (result files' name); `--prompts` is train's prompt file
    runs.add_argument("--prompt-kind", dest="prompts", choices=PROMPT_KINDS, help="synthetic: exact-length prompts "
                      "(default); variable: left-padded prompts of varying length")
    runs.add_argument("--pad-fraction", type=float, help=f"mean padding fraction with --prompt-kind variable "
                      f"(default {defaults.pad_fraction})")
    runs.add_argument("--temperature", type=float, help=f"sampling temperature (default {defaults.temperature})")
    runs.add_argument("--top-k", type=int, help=f"sampling top-k, <= 0 disables (default {defaults.top_k})")
    runs.add_argument("--top-p", type=float, help=f"sampling top-p (default {defaults.top_p})")
    runs.add_argument("--interleave", action="store_true", default=None, help="run the contenders of each config "
                      "(alike but for --strategies and their own knobs) round by round in one process, one iteration "
                      "of each per round, the order reversed every other round, so they see the same machine")
    runs.add_argument("--baseline", metavar="NAME", help="the contender each config's ratio is against (default: the "
                      "first of --strategies)")


def _add_output_flags(bench: argparse.ArgumentParser, scenario: type[Scenario]) -> None:
    out = bench.add_argument_group("output")
    out.add_argument("--output", metavar="FILE", default=f"bench-results/{scenario.kind}.json",
                     help="result JSON, rewritten atomically after every config (default %(default)s)")
    out.add_argument("--plot", metavar="DIR", help="write stages.png, throughput.png and latency.png here")
    out.add_argument("--trace", metavar="FILE", help="Chrome/Perfetto trace of one measured iteration per config")
    out.add_argument("--resume-results", metavar="FILE", help="finish an interrupted run from its result FILE: runs "
                     "only the configs FILE lacks (or that failed), with FILE's own matrix and settings, and writes "
                     "back to FILE")
    out.add_argument("--worker-job", metavar="FILE", help=argparse.SUPPRESS)  # a worker of --processes
    out.add_argument("--dry-run", action="store_true", help="print the expanded matrix, its run order, the warm-up "
                     "and iterations, and an estimated duration; run nothing")
    out.add_argument("--estimate-from", metavar="FILE", help="with --dry-run: a previous result of these configs, "
                     "whose times estimate this run's duration (default: the --resume-results file, else the "
                     "--output file when it exists)")
    ranks = bench.add_argument_group("several ranks (or launch under torchrun / deepspeed yourself)")
    ranks.add_argument("--nproc", type=int, metavar="N", help="run on N local ranks: relaunches this command "
                       "under torchrun; each rank rolls out its own prompts, rank 0 gathers and writes")
    ranks.add_argument("--collective-timeout", type=float, default=600.0, metavar="S",
                       help="seconds any collective may wait for the other ranks before failing (default "
                       "%(default)s)")


def _bench_inputs(args: argparse.Namespace, scenario: type[Scenario]) -> tuple[Matrix, Any]:
    """The matrix and settings of a run: the scenario's defaults, then the config file, then the flags."""
    file_axes, file_settings = (split_config(read_config_file(args.config), scenario, f"--config {args.config}")
                                if args.config else ({}, {}))
    flag_axes = {axis.name: axis.split(getattr(args, axis.name)) for axis in scenario.axes
                 if getattr(args, axis.name) is not None}
    matrix = Matrix.parse(scenario, {**file_axes, **flag_axes})
    flag_settings = {f.name: getattr(args, f.name) for f in fields(scenario.settings_type)
                     if getattr(args, f.name, None) is not None}
    return matrix, scenario.settings_type(**{**file_settings, **flag_settings})


def matrix_of(command: BenchCommand, argv: Sequence[str]) -> tuple[Matrix, Any]:
    """What ``command argv`` would measure (its axes, settings and ``--config``): the matrix and the settings, checked
    as a run checks them; for a caller that runs them itself (``scripts/perf.py``, through ``run_together``). A bad
    flag or file raises ``ValueError`` naming it."""
    parser = argparse.ArgumentParser(prog=command.name, exit_on_error=False)
    add_bench_flags(parser, command)
    try:
        args = parser.parse_args(list(argv))
    except (argparse.ArgumentError, SystemExit) as error:
        raise ValueError(f"{command.name} {' '.join(argv)}: {error}") from None
    matrix, settings = _bench_inputs(args, command.scenario)
    from opsd_rollout.models import max_positions

    command.scenario(settings).check(matrix, max_positions)
    return matrix, settings


def _relaunch(launch: Sequence[str], argv: Sequence[str], nproc: int) -> int:
    """Run this same command (``launch``, then ``argv``) on ``nproc`` local ranks under torchrun (free port, gloo on
    CPU)."""
    from opsd_rollout.distributed import environment_without_ranks, free_port  # heavy: see the module docstring

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), *launch, *argv]
    # a one-process group of this process (if any) must not leak into the ranks' environment; the ranks share
    # the machine's cores (torchrun would give each one thread)
    env = environment_without_ranks()
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(command, env=env).returncode


def _relaunch_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc`` (the ranks must not relaunch) and ``--local_rank`` (each gets its own)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in ("--nproc", *LOCAL_RANK_FLAGS):
            skip = True
        elif not item.startswith(tuple(f"{flag}=" for flag in ("--nproc", *LOCAL_RANK_FLAGS))):
            out.append(item)
    return out


def _estimate_source(args: argparse.Namespace, existing: dict[str, Any] | None,
                     scenario: type[Scenario]) -> tuple[dict[str, Any] | None, str | None]:
    """The previous result a dry run estimates from, and its path: ``--estimate-from``, else the
    ``--resume-results`` file, else the last run's result at ``--output`` (where ``make bench`` writes) when it
    holds this kind of benchmark; an unreadable file there is no estimate, not an error."""
    if args.estimate_from:
        return load_document(args.estimate_from), args.estimate_from
    if existing is not None:
        return existing, args.resume_results
    if not args.output or not os.path.isfile(args.output):
        return None, None
    try:
        document = load_document(args.output)
    except ValueError:
        return None, None
    return (document, args.output) if document.get("kind") == scenario.kind else (None, None)


def run_matrix(args: argparse.Namespace, command: BenchCommand) -> int:
    checks.integer("--nproc", args.nproc, optional=True)
    scenario, out = command.scenario, console()
    if args.worker_job:  # one of the fresh processes of a --processes run: the job file says what to measure
        from opsd_rollout.bench.processes import run_worker

        return run_worker(args.worker_job, scenario)
    existing = None
    if args.resume_results:
        existing = load_document(args.resume_results)
        if existing["kind"] != scenario.kind:
            raise ValueError(f"--resume-results {args.resume_results!r} holds a {existing['kind']} benchmark; resume "
                             f"it with the command that wrote it: {existing['environment']['command']}")
        matrix = Matrix.parse(scenario, existing["matrix"])
        settings = scenario.settings_type(**existing["settings"])
        args.output = args.resume_results
    else:
        matrix, settings = _bench_inputs(args, scenario)
    from opsd_rollout.bench.processes import worker_command
    from opsd_rollout.bench.session import print_dry_run, run_bench_session
    from opsd_rollout.models import max_positions

    scenario(settings).check(matrix, max_positions)
    if args.dry_run:  # on this process alone, whatever --nproc says: it runs nothing
        previous, source = _estimate_source(args, existing, scenario)
        print_dry_run(matrix, settings, previous, out, source)
        return 0
    ranks = args.nproc if args.nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if settings.processes > 1 and ranks > 1:
        raise ValueError(f"--processes {settings.processes} on {ranks} ranks: several processes a config run on one "
                         "rank; drop --processes (each rank's iterations are one process's) or run on one rank")
    if args.nproc is not None and args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _relaunch(command.launch, _relaunch_argv(args.argv), args.nproc)  # not already under a launcher
    from opsd_rollout.bench.runner import RankFailure  # heavy: see the module docstring

    try:
        return run_bench_session(matrix, settings, output=args.output, plot_dir=args.plot, trace=args.trace,
                                 existing=existing, console=out, collective_timeout_s=args.collective_timeout,
                                 worker=worker_command(command.launch, args.argv))
    except RankFailure as error:  # one rank failed: say which and why; the launcher stops the others
        print(f"opsd-rollout: error: {error}", file=sys.stderr)
        return 1
