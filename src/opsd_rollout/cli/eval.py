"""``opsd-rollout eval``: score any checkpoint (a teacher, a trained student's ``model/``) on an eval file with
answers: greedy accuracy, pass@1 and pass@K over K samples, unextractable answers, tokens/s. Its flags map onto
``TaskEvalConfig`` (the same ``--eval-*`` flags as ``train``'s) and DeepSpeed's ``SamplingConfig``. A light module
(argparse and rich only), so ``--help`` answers without importing torch; the command imports the evaluator when it
runs, and checks the whole eval file before it loads the model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from opsd_rollout.cli.common import add_placement_flags
from opsd_rollout.files import write_text_atomic

SCHEMA_VERSION = 1
"""Of ``eval --output``'s JSON: ``{schema_version, kind: "task_eval", model, eval_data, settings, result}``."""
DEFAULT_MAX_NEW_TOKENS = 256
"""A completion's tokens when ``--eval-max-new-tokens`` is not given (a GSM8K solution's length, roughly)."""


def add_eval_parser(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "eval", parents=[common], help="score a model on an eval file with answers: accuracy, pass@k",
        description="Score a model (a preset or a local checkpoint: a teacher, a trained student's model/) on an eval "
        "file with answers, with our rollout engine, batched: greedy accuracy, and with --eval-samples K > 1 pass@1 "
        "averaged over K samples a problem and the unbiased pass@K; answers the scorer cannot read count wrong and "
        "are counted apart. Prints a table; --output writes the same figures, and every problem's, as JSON. The "
        "eval file is checked whole before the model loads.")
    parser.add_argument("--model", required=True, help="a built-in preset or a local checkpoint directory")
    parser.add_argument("--eval-data", required=True, metavar="FILE", help="JSON lines with 'prompt' (or chat "
                        "'messages', rendered with the tokenizer's chat template) and 'answer' (bare, or a worked "
                        "solution the scorer reads its answer from)")
    parser.add_argument("--eval-scorer", required=True, metavar="NAME", help="how answers are read: gsm8k (the "
                        "number after ####), boxed (the last \\boxed{}), last-number or exact (the first line)")
    parser.add_argument("--eval-samples", type=int, metavar="K", help="samples per problem: pass@1 averaged over K "
                        "and the unbiased pass@K besides greedy accuracy (default 1: greedy alone)")
    parser.add_argument("--eval-max-new-tokens", type=int, metavar="N", help="tokens a completion may take "
                        f"(default {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--temperature", type=float, default=1.0, help="the samples' temperature (default "
                        "%(default)s; greedy accuracy is always greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="the samples' top-k, <= 0 disables (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the samples' top-p (default %(default)s)")
    parser.add_argument("--prompts-per-batch", type=int, default=16, metavar="N", help="prompts per rollout (each "
                        "with its K samples; default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the samples' seed: the same seed, the same samples "
                        "(default %(default)s)")
    add_placement_flags(parser, "the model")
    parser.add_argument("--output", metavar="FILE", help="also write the result as JSON (written whole)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_eval)
    return parser


def run_eval(args: argparse.Namespace) -> int:
    """Every input checked (the eval file whole) before the model loads; then the rollouts, the table, the JSON."""
    from opsd_rollout import checks
    from opsd_rollout.models import max_positions
    from opsd_rollout.train.eval_file import TaskEvalConfig, read_eval_file

    config = TaskEvalConfig(data=args.eval_data, scorer=args.eval_scorer,
                            samples=1 if args.eval_samples is None else args.eval_samples,
                            max_new_tokens=(DEFAULT_MAX_NEW_TOKENS if args.eval_max_new_tokens is None
                                            else args.eval_max_new_tokens))
    checks.integer("--prompts-per-batch", args.prompts_per_batch)
    checks.integer("--seed", args.seed, minimum=0)
    if config.samples > 1 and args.temperature <= 0:
        raise ValueError(f"--eval-samples {config.samples} at --temperature {args.temperature:g}, which is greedy: K "
                         "identical completions say nothing of pass@k; sample (--temperature > 0) or drop "
                         "--eval-samples")
    max_positions(args.model)  # a model that is neither a preset nor a directory: refused before the file is read
    records = read_eval_file(config.data, config.scorer)

    import torch
    from deepspeed.runtime.rollout.base import SamplingConfig

    from opsd_rollout.models import load_model
    from opsd_rollout.placement import resolve_device, resolve_dtype
    from opsd_rollout.quiet import progress_bars_hidden
    from opsd_rollout.rollout import HybridEngineRollout
    from opsd_rollout.rollout.validation import check_sampling
    from opsd_rollout.train.task_eval import evaluate_task, task_problems

    sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p)
    check_sampling(sampling)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, torch.device(device).type)
    with progress_bars_hidden():  # loading a checkpoint: the scoring bar says enough
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    problems = task_problems(records, tokenizer, [model], config.max_new_tokens)
    rollout = HybridEngineRollout(model, tokenizer)
    console = Console(stderr=True)
    with _progress(console, len(problems), args.quiet) as advance:
        result = evaluate_task(model, rollout, tokenizer, problems, config, sampling,
                               max_new_tokens=config.max_new_tokens, seed=args.seed,
                               batch_size=args.prompts_per_batch, progress=advance)
    out = Console()
    out.print(f"{args.model} on {args.eval_data}", soft_wrap=True, markup=False, highlight=False)  # paths kept whole
    out.print(result_table(result))
    if args.output:
        settings = {"eval_samples": config.samples, "eval_max_new_tokens": config.max_new_tokens,
                    "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                    "prompts_per_batch": args.prompts_per_batch, "dtype": dtype, "device": device}
        document = {"schema_version": SCHEMA_VERSION, "kind": "task_eval", "model": args.model,
                    "eval_data": args.eval_data, "command": ["opsd-rollout", *args.argv], "settings": settings,
                    "result": result.to_dict()}
        write_text_atomic(args.output, json.dumps(document, indent=2) + "\n")
        print(f"result {args.output}", file=sys.stderr)
    return 0


class _progress:
    """A rich progress bar over the problems (none with ``quiet``); ``with`` gives the evaluator's callback."""

    def __init__(self, console: Console, total: int, quiet: bool):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.bar = Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
                            disable=quiet)
        self.task = self.bar.add_task("scoring", total=total)

    def __enter__(self):
        self.bar.start()
        return lambda done: self.bar.advance(self.task, done)

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()


def result_table(result: Any) -> Table:
    """A ``TaskEvalResult`` for people: one figure a row (the JSON's figures, read from the same object); its title,
    the model and the eval file, is printed above it whole (a table's title wraps at the table's width)."""
    table = Table(box=box.SIMPLE_HEAD, show_header=False, padding=(0, 1), pad_edge=False)
    table.add_column("figure", no_wrap=True)
    table.add_column("value", justify="right", overflow="fold")
    n, k = len(result.problems), result.samples
    correct = sum(p.greedy_correct for p in result.problems)
    table.add_row(f"problems ({result.scorer})", f"{n:,}")
    table.add_row("accuracy (greedy)", f"{result.accuracy:.1%} ({correct:,} of {n:,})")
    table.add_row("unextractable (greedy)", f"{result.unextractable:,}")
    if k > 1:
        table.add_row(f"pass@1 (mean of {k} samples)", f"{result.pass_at_1:.1%}")
        table.add_row(f"pass@{k}", f"{result.pass_at_k:.1%}")
        table.add_row("unextractable (samples)", f"{result.sampled_unextractable:,} of {n * k:,}")
    table.add_row("generated tokens", f"{result.generated_tokens:,}")
    table.add_row("tokens/s", f"{result.tokens_per_second:,.1f}")
    table.add_row("time", f"{result.seconds:,.1f} s")
    return table
