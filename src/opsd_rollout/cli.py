"""Command line: ``opsd-rollout <subcommand>``; flags map onto the library's dataclasses, nothing else parses."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table


def _cmd_models(_args: argparse.Namespace) -> int:
    from opsd_rollout.models import DEFAULT_MODEL, PRESETS

    table = Table(title="Built-in model presets (random weights, byte tokenizer; nothing downloads)")
    for column in ("name", "architecture", "parameters", "description"):
        table.add_column(column)
    for preset in PRESETS.values():
        default = " (default)" if preset.name == DEFAULT_MODEL else ""
        table.add_row(preset.name + default, preset.arch, f"{preset.num_parameters() / 1e6:.2f}M", preset.description)
    Console().print(table)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from opsd_rollout.bench.single import SingleRolloutSpec, run_single

    spec = SingleRolloutSpec(model=args.model, batch_size=args.batch_size, samples_per_prompt=args.samples_per_prompt,
                             prompt_length=args.prompt_length, max_new_tokens=args.max_new_tokens,
                             warmup=args.warmup, seed=args.seed)
    run_single(spec, Console())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from opsd_rollout.models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="opsd-rollout", description=(
        "Profiled, fast rollouts for on-policy (self-)distillation on DeepSpeed."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    models = sub.add_parser("models", help="list the built-in model presets")
    models.set_defaults(func=_cmd_models)
    bench = sub.add_parser("bench", help="profile a rollout on a model and print where the time goes")
    bench.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local checkpoint directory")
    bench.add_argument("--batch-size", type=int, default=4)
    bench.add_argument("--samples-per-prompt", type=int, default=4)
    bench.add_argument("--prompt-length", type=int, default=128)
    bench.add_argument("--max-new-tokens", type=int, default=32)
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--seed", type=int, default=0)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as error:  # bad input: one clear line, no traceback
        print(f"opsd-rollout: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
