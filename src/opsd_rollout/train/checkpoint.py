"""Checkpoints: DeepSpeed's own (``save_checkpoint``, with the loop's state as client state) to resume from, and
the final student as a transformers checkpoint directory any tool (and ``--teacher``) loads; a LoRA student's as
PEFT's adapter directory (``PeftModel.from_pretrained`` loads it on its base, ``models.load_model`` merged), and
on request its merged model.

A DeepSpeed checkpoint is written into ``<tag>.partial`` and becomes ``<tag>``, and ``latest``, only once every
rank's files are whole (``save_published``): one half-written when a rank died or a write failed is never what
``--resume`` or DeepSpeed's ``load_checkpoint`` reads (DeepSpeed's own ``latest`` is written by rank 0 as soon as
its own files are, whatever the other ranks' are doing)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opsd_rollout.files import write_text_atomic
from opsd_rollout.train.faults import CheckpointNotWritten

PARTIAL = ".partial"
"""The suffix of a checkpoint's directory while it is written."""


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


class WriteGuard:
    """DeepSpeed's checkpoint engine (``engine.checkpoint_engine``, through which ``save_checkpoint`` writes every
    file and makes every folder), with a failed write kept instead of raised: a rank whose write raised would leave
    ``save_checkpoint`` before its last barrier while the others wait in it. ``take()`` hands the first failure of a
    save over (``"path: error"``) and forgets it; the writes after a failure are skipped. Everything else (loading,
    committing) is DeepSpeed's engine's own."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.failure: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        self._guarded(path, self.inner.save, state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._guarded(path, self.inner.makedirs, path, exist_ok=exist_ok)

    def _guarded(self, path: str, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self.failure is not None:
            return
        try:
            write(*args, **kwargs)
        except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
            said = error.strerror if isinstance(error, OSError) and error.strerror else error
            self.failure = f"{path}: {said}{free_space(Path(path))}"

    def take(self) -> str | None:
        failure, self.failure = self.failure, None
        return failure


def free_space(path: Path) -> str:
    """``" (N bytes free on its filesystem)"``, what tells a full disk from another write error."""
    for folder in (path, *path.parents):
        if folder.exists():
            return f" ({shutil.disk_usage(folder).free:,} bytes free on its filesystem)"
    return ""


def guard_writes(engine: Any) -> WriteGuard:
    """``engine``'s checkpoint engine in a ``WriteGuard`` (once)."""
    if not isinstance(engine.checkpoint_engine, WriteGuard):
        engine.checkpoint_engine = WriteGuard(engine.checkpoint_engine)
    return engine.checkpoint_engine


def save_published(engine: Any, directory: Path, tag: str, client_state: dict[str, Any], *, rank: int,
                   agree: Callable[[list[int]], list[int]], first_text: Callable[[str | None], str | None],
                   exclude_frozen_parameters: bool = False) -> Path:
    """Every rank's part of DeepSpeed's checkpoint written into ``directory/<tag>.partial``; once every rank's files
    are whole, moved to ``directory/<tag>`` and named in ``directory/latest`` (written whole), by rank 0. Call it on
    every rank. ``agree`` and ``first_text``: ``faults.Agreement``'s (every rank's largest values; the failing rank's
    message). A write that failed on any rank is a ``CheckpointNotWritten`` on every rank naming the path and the
    error; the partial directory is removed and the previous checkpoint stays the latest."""
    guard = guard_writes(engine)
    partial, final = directory / f"{tag}{PARTIAL}", directory / tag
    if rank == 0:  # what saves killed before left; DeepSpeed's first barrier orders this before any rank writes
        for stale in directory.glob(f"*{PARTIAL}"):
            shutil.rmtree(stale, ignore_errors=True)
    engine.save_checkpoint(str(directory), tag=partial.name, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=exclude_frozen_parameters)
    problem = guard.take()
    (failed,) = agree([int(problem is not None)])  # every rank's files whole: the barrier before publishing
    if not failed:
        if rank == 0:
            try:
                _publish(directory, partial, final)
            except OSError as error:
                problem = f"{directory / 'latest'}: {error}{free_space(directory)}"
        (failed,) = agree([int(problem is not None)])  # no rank goes on before it is published
    if failed:
        message = first_text(problem)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointNotWritten(f"checkpoint {tag} not written: {message}")
    return final


def _publish(directory: Path, partial: Path, final: Path) -> None:
    """``partial`` renamed to ``final`` and named in ``latest`` (an older save of the same tag, from a run resumed
    before it, set aside first and removed after)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    write_text_atomic(directory / "latest", final.name)
    shutil.rmtree(old, ignore_errors=True)


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
