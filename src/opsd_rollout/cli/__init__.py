"""Command line: ``opsd-rollout <subcommand>``; flags map onto the library's dataclasses, nothing else parses.

Building the parser reads only light modules (the scenarios' axes and settings, the presets), so ``--help``,
``models``, a dry run and a bad flag answer at once; torch, transformers and DeepSpeed are imported by the
command that runs work (``tests/test_cli_fast.py`` checks which modules each light command loads).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from opsd_rollout import __version__, checks
from opsd_rollout.cores import share_cores_politely
from opsd_rollout.bench.configfile import current_names, read_config_file, split_config
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.report import load_document
from opsd_rollout.files import write_text_atomic
from opsd_rollout.bench.tables import PhraseText
from opsd_rollout.bench.scenarios import KernelsScenario, RolloutScenario, Scenario, StepScenario
from opsd_rollout.cli.bench import add_bench_flags
from opsd_rollout.cli.eval import add_eval_parser
from opsd_rollout.cli.serve import add_serve_teacher_parser
from opsd_rollout.cli.train import add_train_parser
from opsd_rollout.presets import DEFAULT_MODEL, PRESETS


def _console() -> Console:
    """The width it is given: ``COLUMNS``, else the terminal's, else 80 (a file, a CI log); every table folds
    to fit it."""
    return Console()


MODELS_TITLE = "Built-in model presets (random weights, byte tokenizer; nothing downloads)"


def models_table() -> Table:
    """One row per preset; the descriptions wrap, so the table fits the width it is printed at. Sizes come from
    the config numbers (``ModelPreset.num_parameters``): listing builds no model."""
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("arch", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("vocab", justify="right", no_wrap=True)
    table.add_column("description", overflow="fold", ratio=1)
    for preset in PRESETS.values():
        default = " (default)" if preset.name == DEFAULT_MODEL else ""
        count = preset.num_parameters()
        size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
        table.add_row(preset.name + default, preset.arch, size, f"{preset.vocab_size:,}", preset.description)
    return table


def _cmd_models(_args: argparse.Namespace) -> int:
    console = _console()
    console.print(PhraseText(MODELS_TITLE, style="table.title"))
    console.print(models_table())
    return 0


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


def _cmd_bench(args: argparse.Namespace) -> int:
    return _run_matrix(args, RolloutScenario)


def _cmd_step(args: argparse.Namespace) -> int:
    return _run_matrix(args, StepScenario)


def _cmd_kernels(args: argparse.Namespace) -> int:
    return _run_matrix(args, KernelsScenario)


SUBCOMMANDS = {"rollout": "bench", "step": "step", "kernels": "kernels"}
"""The subcommand of each benchmark kind."""


def _relaunch(argv: Sequence[str], nproc: int) -> int:
    """Run this same command on ``nproc`` local ranks under torchrun (free port, gloo on CPU)."""
    from opsd_rollout.distributed import environment_without_ranks, free_port  # heavy: see the module docstring

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "-m", "opsd_rollout", *argv]
    # a one-process group of this process (if any) must not leak into the ranks' environment; the ranks share
    # the machine's cores (torchrun would give each one thread)
    env = environment_without_ranks()
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(command, env=env).returncode


LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
"""What the DeepSpeed launcher (and torch's older launcher) pass every rank: accepted, as DeepSpeed programs do."""


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


def _apply_local_rank(local_rank: int | None) -> None:
    """``--local_rank=N`` from a launcher: the rank's device index. The environment's ``LOCAL_RANK`` (which
    torchrun and DeepSpeed's launcher also set) is what the run reads; the flag fills it in when absent."""
    if local_rank is None:
        return
    if local_rank < 0:
        raise ValueError(f"--local_rank must be >= 0; got {local_rank}")
    current = os.environ.get("LOCAL_RANK")
    if current is not None and current != str(local_rank):
        raise ValueError(f"--local_rank={local_rank} disagrees with LOCAL_RANK={current} in the environment")
    os.environ["LOCAL_RANK"] = str(local_rank)


DEEPSPEED_LOGGER = "DeepSpeed"
"""The logger DeepSpeed logs through (``deepspeed.utils.logging``); it prints to stdout itself."""


class CpuFallbackFilter(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." (``real_accelerator.py``, logged on
    every first ``get_accelerator()`` of a machine without one): on a CPU machine it says nothing the user can
    act on. Installed without ``-v``; DeepSpeed's other messages pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU")


def show_accelerator_fallback(verbose: bool) -> None:
    """With ``-v`` DeepSpeed's CPU-fallback warning shows; without, ``CpuFallbackFilter`` drops it. A filter on
    DeepSpeed's logger, installed before DeepSpeed is imported (no torch import here): DeepSpeed resets the
    logger's level when it creates it, but keeps its filters."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    installed = [f for f in logger.filters if isinstance(f, CpuFallbackFilter)]
    if verbose:
        for found in installed:
            logger.removeFilter(found)
    elif not installed:
        logger.addFilter(CpuFallbackFilter())


def load_result(path: str) -> dict[str, Any]:
    """A result file, read (``load_document``), its matrix by today's axis names (``configfile.RENAMED``)."""
    document = load_document(path)
    return {**document, "matrix": current_names(document.get("matrix") or {}, document.get("kind"))}


def _estimate_source(args: argparse.Namespace, existing: dict[str, Any] | None,
                     scenario: type[Scenario]) -> tuple[dict[str, Any] | None, str | None]:
    """The previous result a dry run estimates from, and its path: ``--estimate-from``, else the
    ``--resume-results`` file, else the last run's result at ``--output`` (where ``make bench`` writes) when it
    holds this kind of benchmark; an unreadable file there is no estimate, not an error."""
    if args.estimate_from:
        return load_result(args.estimate_from), args.estimate_from
    if existing is not None:
        return existing, args.resume_results
    if not args.output or not os.path.isfile(args.output):
        return None, None
    try:
        document = load_result(args.output)
    except ValueError:
        return None, None
    return (document, args.output) if document.get("kind") == scenario.kind else (None, None)


def _run_matrix(args: argparse.Namespace, scenario: type[Scenario]) -> int:
    checks.integer("--nproc", args.nproc, optional=True)
    console = _console()
    existing = None
    if args.resume_results:
        existing = load_result(args.resume_results)
        if existing["kind"] != scenario.kind:
            raise ValueError(f"--resume-results {args.resume_results!r} holds a {existing['kind']} benchmark; "
                             f"resume it with `opsd-rollout {SUBCOMMANDS.get(existing['kind'], 'bench')}`")
        matrix = Matrix.parse(scenario, existing["matrix"])
        settings = scenario.settings_type(**existing["settings"])
        args.output = args.resume_results
    else:
        matrix, settings = _bench_inputs(args, scenario)
    from opsd_rollout.bench.session import print_dry_run, run_bench_session
    from opsd_rollout.models import max_positions

    scenario(settings).check(matrix, max_positions)
    if args.dry_run:  # on this process alone, whatever --nproc says: it runs nothing
        previous, source = _estimate_source(args, existing, scenario)
        print_dry_run(matrix, settings, previous, console, source)
        return 0
    if args.nproc is not None and args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _relaunch(_relaunch_argv(args.argv), args.nproc)  # not already under a launcher
    from opsd_rollout.bench.runner import RankFailure  # heavy: see the module docstring

    try:
        return run_bench_session(matrix, settings, output=args.output, plot_dir=args.plot, trace=args.trace,
                                 existing=existing, console=console, collective_timeout_s=args.collective_timeout)
    except RankFailure as error:  # one rank failed: say which and why; the launcher stops the others
        print(f"opsd-rollout: error: {error}", file=sys.stderr)
        return 1


def _cmd_compare(args: argparse.Namespace) -> int:
    from opsd_rollout.bench.compare import compare_documents
    from opsd_rollout.bench.compare_report import comparison_markdown, comparison_notes, comparison_table, footnote

    if args.threshold < 0:
        raise ValueError(f"--threshold must be >= 0 (percent); got {args.threshold}")
    ignore = tuple(a.strip() for a in args.ignore_axes.split(",") if a.strip()) if args.ignore_axes else ()
    comparison = compare_documents(load_result(args.before), load_result(args.after),
                                   threshold_pct=args.threshold, ignore=ignore, allow_disturbed=args.allow_disturbed)
    console = _console()
    if comparison.changes:
        console.print(comparison_table(comparison, console.width))
    console.print(footnote(args.threshold), markup=False, highlight=False)
    for note in comparison_notes(comparison):  # notes quote values and reasons: no markup
        console.print(f"note: {note}", markup=False, highlight=False)
    if args.markdown:
        write_text_atomic(args.markdown, comparison_markdown(comparison, args.threshold))
    status = comparison.exit_status(args.allow_partial)
    console.print(_compare_summary(comparison, status, args.threshold))
    return status


def _compare_summary(comparison: Any, status: int, threshold: float) -> str:
    """The last line of ``compare``: what its exit status means."""
    from opsd_rollout.bench.compare import EXIT_DISTURBED, EXIT_NOTHING_COMPARED, EXIT_PARTIAL, EXIT_REGRESSION

    disturbed = len(comparison.disturbed)
    if status == EXIT_NOTHING_COMPARED:
        return ("[bold red]nothing compared: no config is measured in both files[/] (match across an axis with "
                "--ignore-axes)")
    if status == EXIT_REGRESSION:
        return f"[bold red]{len(comparison.regressions)} regression(s) beyond {threshold:g}%[/]"
    if status == EXIT_DISTURBED:
        judged = comparison.matched - disturbed
        return (f"[bold yellow]disturbed: {disturbed} of {comparison.matched} compared config(s) were disturbed and "
                "are not judged[/] (rerun on a quiet machine, or --allow-disturbed judges them)"
                + (f"; no regression beyond {threshold:g}% in the {judged} judged" if judged else ""))
    judged = f" ({disturbed} disturbed, judged anyway)" if disturbed else ""
    if status == EXIT_PARTIAL:
        return (f"[bold red]partial: {len(comparison.only_before)} config(s) only in BEFORE, "
                f"{len(comparison.only_after)} only in AFTER[/] (--allow-partial accepts that); "
                f"no regression beyond {threshold:g}% in the {comparison.matched} compared{judged}")
    return f"{comparison.matched} config(s) compared: no regression beyond {threshold:g}%{judged}"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="also show what DeepSpeed and the package log (accelerator detection, op builds)")
    # the DeepSpeed launcher passes --local_rank=N before the subcommand; accepted there and after it, hidden.
    # SUPPRESS: a subcommand's default must not overwrite a value given before the subcommand.
    common.add_argument(*LOCAL_RANK_FLAGS, dest="local_rank", type=int, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)
    parser = argparse.ArgumentParser(prog="opsd-rollout", parents=[common], description=(
        "Profiled, fast rollouts for on-policy (self-)distillation on DeepSpeed."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    models = sub.add_parser("models", parents=[common], help="list the built-in model presets")
    models.set_defaults(func=_cmd_models)
    bench = sub.add_parser("bench", parents=[common], help="benchmark rollouts over a matrix of shapes",
                           description="Benchmark rollouts over a matrix of shapes. With no flags: a smoke "
                           "matrix (batch 1,4 x samples 1,4 x prompt 128 x response 32, greedy, llama-small).")
    add_bench_flags(bench, RolloutScenario)
    bench.set_defaults(func=_cmd_bench)
    step = sub.add_parser("step", parents=[common],
                          help="benchmark whole OPSD steps (rollout, teacher, student update)",
                          description="Benchmark whole on-policy distillation steps on DeepSpeed: rollout, teacher "
                          "forward into a host logit cache, student forward, divergence, backward, optimizer step. "
                          "Default: student llama-tiny, teacher llama-small, B 2 x n 2 x prompt 32 x response 32, "
                          "jsd(0.5), ZeRO 0 and 3.")
    add_bench_flags(step, StepScenario)
    step.set_defaults(func=_cmd_step)
    kernels = sub.add_parser("kernels", parents=[common], help="benchmark kernels: ours against a baseline, side by "
                             "side (sampling, post-processing, attention layouts, fused loss, weight layout, ...)",
                             description="Benchmark the pieces that are neither a rollout nor a step, each ours "
                             "against a baseline (the code it replaced, or upstream's), both in every iteration, their "
                             "order alternating. Default: every kernel but compile at 16 rows, vocabulary 32,000, "
                             "prompt 128, response 32, 4 samples per prompt, on llama-small.")
    add_bench_flags(kernels, KernelsScenario)
    kernels.set_defaults(func=_cmd_kernels)
    compare = sub.add_parser(
        "compare", parents=[common], help="compare two result files; exit 1 on a regression",
        description="Compare two result files config by config: each metric's Hodges-Lehmann ratio (after / "
        "before) with its 95% distribution-free confidence interval over the raw iterations. The files must "
        "have measured the same work (model, settings other than warm-up and iterations, ranks); configs match "
        "on every axis. A config disturbed on either side (the run's interference record) is not judged. Exit "
        "status, the first that applies: 2 bad input (also: files of different work, naming what differs); 3 "
        "nothing compared (no config in both files); 1 a regression (the whole interval worse than "
        "--threshold); 5 a compared config was disturbed and not judged (unless --allow-disturbed); 4 one file "
        "has configs the other lacks (unless --allow-partial); 0 compared, no regression.")
    compare.add_argument("before", metavar="BEFORE.json")
    compare.add_argument("after", metavar="AFTER.json")
    compare.add_argument("--threshold", type=float, default=5.0,
                         help="percent: a regression's whole confidence interval is worse than this, and it moves "
                         "at least 1 ms (times) or 1 MiB (memory) (default %(default)s)")
    compare.add_argument("--markdown", metavar="FILE", help="also write the comparison as a Markdown table")
    compare.add_argument("--ignore-axes", metavar="LIST", help="config axes to leave out when matching BEFORE and "
                         "AFTER, e.g. strategy (to compare generate against static), or settings allowed to "
                         "differ, e.g. model")
    compare.add_argument("--allow-disturbed", action="store_true", help="judge configs that were disturbed while "
                         "they ran too (exit 5 otherwise)")
    compare.add_argument("--allow-partial", action="store_true", help="exit 0 (not 4) when one file has configs "
                         "the other lacks")
    compare.set_defaults(func=_cmd_compare)
    add_train_parser(sub, common)
    add_eval_parser(sub, common)
    add_serve_teacher_parser(sub, common)
    return parser


def shares_cores(command: str, modules: Any) -> bool:
    """Whether to pick OpenMP's wait for shared cores (``cores.py``) now: for ``train`` (a benchmark measures the
    machine as it is), and only before torch is imported, as OpenMP reads the setting once."""
    return command == "train" and "torch" not in modules


def main(argv: Sequence[str] | None = None) -> int:
    # torch deprecations raised from inside DeepSpeed are not the user's to act on
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv, args.verbose = argv, getattr(args, "verbose", False)
    if int(os.environ.get("RANK", "0")) == 0:  # an old spelling, said once (not by every rank of --nproc)
        for note in getattr(args, "renamed", []):
            print(note, file=sys.stderr)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    show_accelerator_fallback(args.verbose)
    if shares_cores(args.command, sys.modules):
        share_cores_politely()
    try:
        _apply_local_rank(getattr(args, "local_rank", None))
        return int(args.func(args) or 0)
    except ValueError as error:  # bad input: a clear message, no traceback
        print(f"opsd-rollout: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupted:
        said = {"train": "nothing trained yet", "eval": "no result written"}.get(
            args.command, "finished configs are in the result file (finish with --resume-results)")
        print("opsd-rollout: interrupted; " + (str(interrupted) or said), file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
