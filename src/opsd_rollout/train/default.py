"""The built-in training runs, the project's main job: real ones, on data no one here wrote or made by code.

A teacher is trained by SFT on the run's references, or reused from a cache directory where an earlier run left it,
its training's own metrics beside it; then it is distilled on-policy into a smaller student that sees the prompts
alone. Two runs are built in: the corpus run (the Python documentation that ships with Python; ``llama-mini``
distilled into ``llama-tiny``, its figure the student's held-out reverse KL to the teacher) and, with ``task``, a
built-in task's (``arithmetic``: addition word problems made from a seed, judged by held-out accuracy). Nothing
downloads.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from opsd_rollout import checks
from opsd_rollout.placement import resolve_device, resolve_dtype
from opsd_rollout.train.checkpoint import latest_tag
from opsd_rollout.train.config import TrainConfig
from opsd_rollout.train.eval_file import TaskEvalConfig, read_eval_file
from opsd_rollout.train.loop import TrainResult, train
from opsd_rollout.train.run_dir import check_resumed_run

TEACHER = TrainConfig.from_flat(dict(output_dir="", objective="sft", student="llama-mini", steps=800,
                                     prompts_per_micro_batch=16, lr=1e-3, eval_every=100, eval_prompts=64,
                                     max_new_tokens=32, save_every=100))
"""The teacher's SFT on the corpus's references (a checkpoint every 100 steps: a killed training resumes)."""
STUDENT = dict(objective="opsd", student="llama-tiny", steps=200, prompts_per_micro_batch=8, lr=3e-3, eval_every=20,
               eval_prompts=64, max_new_tokens=32, loss="jsd", beta=0.5)
"""The on-policy distillation of that teacher into a smaller student, by the flags' names
(``TrainConfig.from_flat``)."""
ARITHMETIC_TEACHER = TrainConfig.from_flat(dict(output_dir="", objective="sft", task="arithmetic", student="llama-micro",
                                                steps=1000, prompts_per_micro_batch=16, lr=1e-3, eval_every=500,
                                                eval_prompts=16, max_new_tokens=80, save_every=250))
"""The arithmetic task's teacher: SFT on the worked solutions (measured in docs/TRAINING.md: a 2-layer model learns the
column-by-column sums in fewer steps than a deeper one)."""
ARITHMETIC_STUDENT = dict(objective="opsd", task="arithmetic", student="llama-tiny", steps=1200,
                          prompts_per_micro_batch=32, lr=1.5e-3, eval_every=200, eval_prompts=64, max_new_tokens=80,
                          loss="forward_kl", lmbda=1.0)
"""The arithmetic task's student, distilled on-policy from the prompts alone (``lmbda`` 1: never a reference) by the
forward KL (from a random start the JSD's gradient fades where the two disagree most: measured in docs/TRAINING.md)."""
ARITHMETIC_5D_TEACHER = TrainConfig.from_flat(dict(output_dir="", objective="sft", task="arithmetic-5d",
                                                   student="llama-micro", steps=1500, prompts_per_micro_batch=16,
                                                   lr=1e-3, eval_every=500, eval_prompts=16, max_new_tokens=134,
                                                   save_every=250))
"""The harder setting's teacher: the same model and schedule, 1500 steps (measured: 13.8% held-out at 500, 45.6% at
1000, 94.4% at 1500, 84.4% at 2000)."""
ARITHMETIC_5D_STUDENT = dict(objective="opsd", task="arithmetic-5d", student="llama-tiny", steps=800, task_labelled=300,
                             warmup_sft_steps=600, warmup_sft_lr=3e-3, lr=3e-4, prompts_per_micro_batch=16,
                             eval_every=100, eval_prompts=64, max_new_tokens=134, loss="reverse_kl",
                             teacher_cache="topk", teacher_top_k=64, top_k_rest="tail", lmbda=1.0)
"""The harder setting's student: the recipe practitioners run, as the task comparison measured it (docs/TRAINING.md,
"When does on-policy distillation pay off"): 300 labelled problems, a 600-step SFT warm start on them, then 200 steps
of on-policy reverse KL over the teacher's top 64 (the tail as one more class) on every prompt, the loss that led at
equal steps on the 3-digit task. At this size and budget no arm solved a 5-digit problem (the comparison's table)."""
RUNS = {None: (TEACHER, STUDENT), "arithmetic": (ARITHMETIC_TEACHER, ARITHMETIC_STUDENT),
        "arithmetic-5d": (ARITHMETIC_5D_TEACHER, ARITHMETIC_5D_STUDENT)}
"""The built-in runs by task (``None``: the corpus run): (the teacher's recipe, the student's by the flags' names)."""


UNMADE = ("output_dir", "progress", "verbose", "save_every", "resume", "overwrite", "save_total_limit", "save_best",
          "device", "gradient_checkpointing")
"""``TrainConfig``'s fields that change where a run goes and what it keeps, not the teacher it makes: left out of
the name of a cached teacher (``teacher_dir``)."""


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("OPSD_ROLLOUT_CACHE") or Path.home() / ".cache" / "opsd-rollout")


def data_hash(task: str | None) -> str:
    """A hash of the data a teacher trains on: the built-in corpus's text, or the task's recipe (its seed and sizes)
    and every example it makes (so a change to the generator's code is a new teacher too)."""
    if task is None:
        from pydoc_data.topics import topics

        return hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()
    from dataclasses import asdict

    from opsd_rollout.train.tasks import TASKS, task_examples

    train_examples, held_out = task_examples(task)
    data = [asdict(TASKS[task]), [[e.prompt, e.reference, e.eos] for e in train_examples + held_out]]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def task_eval_flags(cache_dir: str | None, task: str) -> dict[str, str]:
    """``--eval-data`` and ``--eval-scorer`` of a built-in task: its held-out problems as an eval file in the cache
    (named by the task's data, written once) and the scorer of its answers."""
    from opsd_rollout.train.tasks import SCORERS, write_eval_file

    path = cache_root(cache_dir) / "tasks" / f"{task}-{data_hash(task)[:12]}.jsonl"
    return {"eval_data": str(path if path.is_file() else write_eval_file(task, path)), "eval_scorer": SCORERS[task]}


def task_flags(cache_dir: str | None, task: str) -> dict[str, Any]:
    """A run on a built-in task with models of one's own: ``--max-new-tokens`` its longest worked solution's, scored
    on its held-out problems (``task_eval_flags``)."""
    from opsd_rollout.train.tasks import response_tokens

    return {"max_new_tokens": response_tokens(task), **task_eval_flags(cache_dir, task)}


def changed(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """What of ``values`` differs from ``defaults``, nested sections compared field by field."""
    out = {}
    for name, value in values.items():
        default = defaults.get(name, changed)  # a name the defaults lack: kept
        if isinstance(value, dict) and isinstance(default, dict):
            inner = changed(value, default)
            if inner:
                out[name] = inner
        elif value != default:
            out[name] = value
    return out


def teacher_dir(cache_dir: str | None, config: TrainConfig = TEACHER) -> Path:
    """Where the teacher of ``config`` is kept: named by a hash of everything that makes it, its fields away from
    their defaults (a field added to the config at its default leaves every cached teacher's name as it was)."""
    import opsd_rollout

    defaults = TrainConfig(output_dir="", objective=config.objective, teachers=config.teachers).to_dict()
    recipe = {k: v for k, v in changed(config.to_dict(), defaults).items() if k not in UNMADE}
    dtype = resolve_dtype(config.dtype, resolve_device(config.device).partition(":")[0])
    recipe.pop("dtype", None)
    if dtype != "fp32":  # the run's precision as it resolves here: an fp32 teacher's name as before the field
        recipe["dtype"] = dtype
    recipe.update(version=opsd_rollout.__version__, corpus=data_hash(config.task))
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / "teachers" / f"{config.student}-{key}"


class TeacherInterrupted(KeyboardInterrupt):
    """Ctrl-C while the built-in run trains its teacher: what was saved, and how to continue."""


@contextlib.contextmanager
def teacher_lock(directory: Path) -> Iterator[None]:
    """Held while one process trains the teacher of ``directory``: another run of the same recipe waits for it
    (and then reuses what it trained) instead of training into the same files."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"teacher: another run is training it into {directory}; waiting for it", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def trained_teacher(cache_dir: str | None, *, progress: bool = True, config: TrainConfig = TEACHER) -> Path:
    """The checkpoint directory of the teacher ``config`` makes: trained now, or the one a previous run cached.

    The teacher trains under a lock into ``<dir>.partial`` and is moved to ``<dir>`` whole when it is done, so a
    reader never sees half a teacher and two runs never train into one directory; a training that was stopped
    (Ctrl-C, a kill) resumes from its last checkpoint the next time."""
    directory = teacher_dir(cache_dir, config)
    model = directory / "model"
    if (model / "config.json").is_file():
        print(f"teacher: reusing {model}", flush=True)
        return model
    with teacher_lock(directory):
        if (model / "config.json").is_file():  # trained by the run we waited for
            print(f"teacher: reusing {model}", flush=True)
            return model
        partial = directory.with_name(directory.name + ".partial")
        if directory.is_dir() and not partial.exists():  # an older release trained in place and was stopped
            os.replace(directory, partial)
        saved = latest_tag(partial)
        data = "the built-in corpus" if config.task is None else f"the {config.task} task"
        print(f"teacher: {'resuming' if saved else 'training'} {config.student} on {data} "
              f"({config.steps} SFT steps{f', from {saved}' if saved else ''}) in {partial}", flush=True)
        if config.task is not None and config.task_eval is None:  # its accuracy as it trains (not in its name)
            flags = task_eval_flags(cache_dir, config.task)
            config = replace(config, task_eval=TaskEvalConfig(data=flags["eval_data"], scorer=flags["eval_scorer"]))
        result = train(replace(config, output_dir=str(partial), progress=progress,  # no checkpoint: start over
                               resume=str(partial) if saved else None, overwrite=not saved))
        if result.interrupted or result.model_dir is None:
            raise TeacherInterrupted(f"the teacher's training stopped at step {result.steps} of {config.steps}, "
                                     f"checkpoint {result.checkpoint}; the same command continues it")
        os.replace(partial, directory)  # whole, or not at all
    print(f"teacher: trained into {directory}", flush=True)
    return model


def default_run(output_dir: str, *, cache_dir: str | None = None, progress: bool = True,
                overrides: dict[str, Any] | None = None) -> TrainResult:
    """The teacher (trained or reused), then the student distilled into ``output_dir``; ``overrides`` are the
    student's run's fields by the flags' names (``TrainConfig.from_flat``); their ``task`` picks the built-in run
    (``RUNS``)."""
    overrides = overrides or {}
    task = overrides.get("task")
    if task not in RUNS:
        checks.choice("task", task, [name for name in RUNS if name is not None])
    teacher_config, student = RUNS[task]
    teacher = teacher_dir(cache_dir, teacher_config) / "model"
    scored = task_eval_flags(cache_dir, task) if task is not None and "eval_data" not in overrides else {}
    config = TrainConfig.from_flat({**student, **scored, "output_dir": output_dir, "teacher": str(teacher),
                                    "progress": progress, **overrides})  # checked before the teacher trains
    if config.task_eval is not None:  # the eval file too
        read_eval_file(config.task_eval.data, config.task_eval.scorer)
    if config.resume is not None:  # a run of the user's flags, resumed without them, is not this one
        check_resumed_run(config.resume, config)
    trained_teacher(cache_dir, progress=progress, config=teacher_config)
    print(f"student: distilling into {config.student} on-policy ({config.steps} steps) into {output_dir}", flush=True)
    return train(config)
