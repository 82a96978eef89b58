"""Command line: ``opsd-rollout <subcommand>``; flags map onto the library's dataclasses, nothing else parses.
One module a subcommand (``models``, ``bench`` with ``step``, ``compare``, ``train``, ``eval``,
``serve-teacher``), each adding its parser and the function that runs it; ``main`` parses, runs, and turns bad
input and Ctrl-C into a line and an exit status.

Building the parser reads only light modules (the scenarios' axes and settings, the presets), so ``--help``,
``models``, a dry run and a bad flag answer at once; torch, transformers and DeepSpeed are imported by the
command that runs work (``tests/test_cli_fast.py`` checks which modules each light command loads).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from opsd_rollout import __version__
from opsd_rollout.cli.bench import add_bench_parsers
from opsd_rollout.cli.common import apply_local_rank, common_flags, show_accelerator_fallback
from opsd_rollout.cli.compare import add_compare_parser
from opsd_rollout.cli.eval import add_eval_parser
from opsd_rollout.cli.models import add_models_parser
from opsd_rollout.cli.serve import add_serve_teacher_parser
from opsd_rollout.cli.train import add_train_parser
from opsd_rollout.cores import share_cores_politely

ERROR = "opsd-rollout: error: "
"""What begins every line that refuses an input, whoever refuses it (the parser, a check, a library call)."""


class FullFlags(argparse.ArgumentParser):
    """A parser that takes a flag only as spelled in full (its subcommands' parsers are of its class). argparse
    would take any unique prefix (``--resume`` for ``--resume-results``): spellings nobody chose, which change
    meaning or stop working when a flag is added. Its errors are one line with every other error's prefix (argparse
    prints the whole usage first, under the subcommand's name)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{ERROR}{message}\n")


def build_parser() -> argparse.ArgumentParser:
    common = common_flags()
    parser = FullFlags(prog="opsd-rollout", parents=[common], description=(
        "Profiled, fast rollouts for on-policy (self-)distillation on DeepSpeed."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_models_parser(sub, common)
    add_bench_parsers(sub, common)
    add_compare_parser(sub, common)
    add_train_parser(sub, common)
    add_eval_parser(sub, common)
    add_serve_teacher_parser(sub, common)
    return parser


def shares_cores(command: str, modules: Any) -> bool:
    """Whether to pick OpenMP's wait for shared cores (``cores.py``) now: for ``train`` (a benchmark measures the
    machine as it is), and only before torch is imported, as OpenMP reads the setting once."""
    return command == "train" and "torch" not in modules


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Parse ``argv`` with ``parser`` (default: ``opsd-rollout``'s; a developer tool passes its own, whose defaults
    name its ``command`` and ``func``) and run the command."""
    # torch deprecations raised from inside DeepSpeed are not the user's to act on
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = (parser or build_parser()).parse_args(argv)
    args.argv, args.verbose = argv, getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    show_accelerator_fallback(args.verbose)
    if shares_cores(args.command, sys.modules):
        share_cores_politely()
    try:
        apply_local_rank(getattr(args, "local_rank", None))
        return int(args.func(args) or 0)
    except ValueError as error:  # bad input: a clear message, no traceback
        print(f"{ERROR}{error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupted:
        said = {"train": "nothing trained yet", "eval": "no result written"}.get(
            args.command, "finished configs are in the result file (finish with --resume-results)")
        print("opsd-rollout: interrupted; " + (str(interrupted) or said), file=sys.stderr)
        return 130


def run() -> None:
    """The program (``opsd-rollout``, ``python -m opsd_rollout``): ``main``, then the process group the command
    joined (train and bench under a launcher) destroyed before the interpreter exits, as torch asks. ``main`` keeps
    it: a caller that runs commands in one process (DeepSpeed keeps the group it made for the next) may go on using
    it.

    A rank of several whose command succeeded then leaves without the interpreter's teardown (``os._exit(0)``, its
    logs and streams flushed first): DeepSpeed's module globals hold gloo groups past ``destroy_process_group``, and
    destroying them in the teardown, their threads still joinable, aborted one rank of a finished two-rank ZeRO-3
    run now and then (``terminate called without an active exception``, SIGABRT), so that the launcher reported a
    failure. A command that failed or was stopped exits as before: its status and last lines are the faults'."""
    status = main()
    distributed = sys.modules.get("torch.distributed")  # never imported here: a light command stays light
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        several = distributed.get_world_size() > 1
        distributed.destroy_process_group()
        if several and status == 0:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    sys.exit(status)

