"""The built-in training run, the project's main job: a real one, on text no one here wrote.

A teacher (``llama-mini``) is trained by SFT on the built-in corpus (the Python documentation that ships with
Python), or reused from a cache directory where an earlier run left it, its training's own metrics beside it; then
it is distilled on-policy into a smaller student (``llama-tiny``), whose held-out reverse KL to the teacher is the
run's figure. Nothing downloads.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from opsd_rollout.train.config import TrainConfig
from opsd_rollout.train.loop import TrainResult, train

TEACHER = TrainConfig.from_flat(dict(output_dir="", objective="sft", student="llama-mini", steps=800,
                                     prompts_per_micro_batch=16, lr=1e-3, eval_every=100, eval_prompts=64,
                                     max_new_tokens=32))
"""The teacher's SFT on the corpus's references."""
STUDENT = dict(objective="opsd", student="llama-tiny", steps=200, prompts_per_micro_batch=8, lr=3e-3, eval_every=20,
               eval_prompts=64, max_new_tokens=32, loss="jsd", beta=0.5)
"""The on-policy distillation of that teacher into a smaller student, by the flags' names
(``TrainConfig.from_flat``)."""


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("OPSD_ROLLOUT_CACHE") or Path.home() / ".cache" / "opsd-rollout")


def teacher_dir(cache_dir: str | None, config: TrainConfig = TEACHER) -> Path:
    """Where the teacher of ``config`` is kept: named by a hash of everything that makes it."""
    from pydoc_data.topics import topics

    import opsd_rollout

    recipe = {k: v for k, v in config.to_dict().items() if k not in ("output_dir", "progress")}
    recipe.update(version=opsd_rollout.__version__, corpus=hashlib.sha256(
        json.dumps(topics, sort_keys=True).encode()).hexdigest())
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / "teachers" / f"{config.student}-{key}"


def trained_teacher(cache_dir: str | None, *, progress: bool = True) -> Path:
    """The teacher's checkpoint directory: trained now, or the one a previous run cached."""
    directory = teacher_dir(cache_dir)
    model = directory / "model"
    if (model / "config.json").is_file():
        print(f"teacher: reusing {model}", flush=True)
        return model
    print(f"teacher: training {TEACHER.student} on the built-in corpus ({TEACHER.steps} SFT steps) into {directory}",
          flush=True)
    result = train(replace(TEACHER, output_dir=str(directory), progress=progress))
    if result.interrupted or result.model_dir is None:
        raise KeyboardInterrupt
    return result.model_dir


def default_run(output_dir: str, *, cache_dir: str | None = None, progress: bool = True,
                overrides: dict[str, Any] | None = None) -> TrainResult:
    """The teacher (trained or reused), then the student distilled into ``output_dir``; ``overrides`` are the
    student's run's fields by the flags' names (``TrainConfig.from_flat``)."""
    teacher = teacher_dir(cache_dir) / "model"
    config = TrainConfig.from_flat({**STUDENT, "output_dir": output_dir, "teacher": str(teacher),
                                    "progress": progress, **(overrides or {})})  # checked before the teacher trains
    trained_teacher(cache_dir, progress=progress)
    print(f"student: distilling into {config.student} on-policy ({config.steps} steps) into {output_dir}", flush=True)
    return train(config)
