"""Checkpoints: DeepSpeed's own (``save_checkpoint``, with the loop's state as client state) to resume from, and
the final student as a transformers checkpoint directory any tool (and ``--teacher``) loads; a LoRA student's as
PEFT's adapter directory (``PeftModel.from_pretrained`` loads it on its base, ``models.load_model`` merged), and
on request its merged model."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Any


def find_checkpoint(path: str | Path) -> Path:
    """The DeepSpeed checkpoint directory of a run (``DIR/checkpoints``) or the one given, with a ``latest`` tag."""
    path = Path(path)
    for candidate in (path / "checkpoints", path):
        if (candidate / "latest").is_file():
            return candidate
    raise ValueError(f"--resume {str(path)!r} holds no checkpoint (no 'latest' in it or in its checkpoints/): "
                     "pass the output directory of a run that saved one")


def latest_tag(run: Path) -> str | None:
    """The tag of a run's latest checkpoint (``run/checkpoints/latest``), or ``None`` when it saved none."""
    latest = run / "checkpoints" / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def save_model(engine: Any, tokenizer: Any, directory: Path, rank: Any, files: dict[str, str] | None = None) -> Path:
    """The student's weights and tokenizer in transformers' format (``from_pretrained`` loads them), written into
    a temporary directory and moved into place whole; a PEFT student's ``save_pretrained`` writes its adapters
    alone (``adapter_config.json``, ``adapter_model.safetensors``). ``files``: more files to write in it (name ->
    text), moved in with it."""
    module = engine.module
    whole = contextlib.nullcontext()  # below ZeRO-3 every rank holds the whole weights
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        whole = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    with whole:
        if rank.rank == 0:
            # a PEFT student: its adapters alone; save_embedding_layers=False, or PEFT looks its base up on the Hub
            # to see whether the vocabulary changed (it never does here: nothing resizes the embeddings)
            extra = {"save_embedding_layers": False} if hasattr(module, "peft_config") else {}
            _save_whole(module, tokenizer, directory, files, **extra)
    return directory


def save_merged(adapters: Path, directory: Path) -> Path:
    """The model of a LoRA run's adapter directory with the adapters merged into its base (PEFT's
    ``merge_and_unload``, through ``models.load_model``), saved like ``save_model``'s whole students."""
    from opsd_rollout.models import load_model

    model, tokenizer = load_model(str(adapters))
    return _save_whole(model, tokenizer, directory)


def _save_whole(model: Any, tokenizer: Any, directory: Path, files: dict[str, str] | None = None, **save: Any) -> Path:
    """``model.save_pretrained`` (safetensors, ``save``'s options), the tokenizer's and ``files`` into a temporary
    directory beside ``directory``, then moved into its place whole."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, **save)
    tokenizer.save_pretrained(tmp)
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


TAG = re.compile(r"step(\d+)")
"""The loop's checkpoint tags (``step200``): what ``prune_checkpoints`` may remove."""


def prune_checkpoints(checkpoints: Path, limit: int, keep: set[str]) -> list[str]:
    """At most ``limit`` of the loop's checkpoints left in ``checkpoints``, the oldest removed first, as
    transformers' Trainer does with ``save_total_limit``: never the ``latest`` (DeepSpeed's file goes on naming a
    checkpoint that exists) nor those in ``keep`` (the best model's step), so more are left when they alone are
    more. Returns the tags removed."""
    latest = (checkpoints / "latest").read_text().strip() if (checkpoints / "latest").is_file() else None
    tags = sorted((int(m.group(1)), p.name) for p in checkpoints.iterdir()
                  if p.is_dir() and (m := TAG.fullmatch(p.name)))
    kept = {latest, *keep}
    removable = [tag for _, tag in tags if tag not in kept]
    removed = removable[:max(0, len(tags) - max(limit, len(kept & {tag for _, tag in tags})))]
    for tag in removed:
        shutil.rmtree(checkpoints / tag)
    return removed
