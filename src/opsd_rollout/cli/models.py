"""``opsd-rollout models``: the built-in model presets as a table. Light: listing builds no model."""

from __future__ import annotations

import argparse
from typing import Any

from rich import box
from rich.table import Table

from opsd_rollout.bench.tables import PhraseText
from opsd_rollout.cli.common import console
from opsd_rollout.presets import DEFAULT_MODEL, PRESETS

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


def run_models(_args: argparse.Namespace) -> int:
    out = console()
    out.print(PhraseText(MODELS_TITLE, style="table.title"))
    out.print(models_table())
    return 0


def add_models_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    models = sub.add_parser("models", parents=[common], help="list the built-in model presets")
    models.set_defaults(func=run_models)
