"""A training run's inputs checked before torch, transformers or DeepSpeed load: the files and names that need no
model (each flag's value; the prompt file, line by line; the DeepSpeed config file; a ``--resume`` directory; an
output directory that holds another run; student and teacher named as presets or checkpoint directories, their
vocabularies from their configs; the LoRA flags), so that a
mistake costs the command line a fraction of a second, as ``bench``'s do. ``TrainConfig`` checks the same values
again (for the library's callers, and the combinations of flags: a loss and a cache that do not go together);
what needs a model (a LoRA target that matches no layer) is checked once its config is loaded, before any step.
Light: this module imports none of the three.
"""

from __future__ import annotations

from typing import Any

from opsd_rollout import checks
from opsd_rollout.deepspeed_config import read_deepspeed_file
from opsd_rollout.models import vocab_size
from opsd_rollout.train.best import check_save_best
from opsd_rollout.train.checkpoint import find_checkpoint
from opsd_rollout.train.eval_file import TaskEvalConfig, read_eval_file
from opsd_rollout.train.lora import AdapterConfig
from opsd_rollout.train.precision import run_dtype
from opsd_rollout.train.records import read_records
from opsd_rollout.train.run_dir import check_output_dir, check_resumed_run
from opsd_rollout.train.tasks import check_split
from opsd_rollout.train.teacher_spec import (TeacherSpec, check_self, check_specs, context_of, routed,
                                             specs_from_flags)

DEFAULT_STUDENT = "llama-tiny"
"""``TrainConfig.student``'s default (a test checks they agree)."""
COUNT = checks.rule(checks.integer)
RULES = {
    **{name: COUNT for name in ("steps", "prompts_per_micro_batch", "samples_per_prompt", "max_new_tokens",
                                "max_prompt_tokens", "eval_every", "eval_prompts", "save_every", "teacher_top_k",
                                "gradient_accumulation_steps", "lora_rank", "save_total_limit")},
    "top_k": checks.rule(checks.integer, minimum=None), "lr": checks.rule(checks.number, above=0),
    "lmbda": checks.rule(checks.number, at_least=0, at_most=1), "beta": checks.rule(checks.number, at_least=0,
                                                                                    at_most=1),
    "top_p": checks.rule(checks.number, above=0, at_most=1), "temperature": checks.rule(checks.number),
    "teacher_timeout": checks.rule(checks.number, at_least=0), "lora_alpha": checks.rule(checks.number, above=0),
    "warmup_sft_steps": checks.rule(checks.integer, minimum=0), "warmup_sft_lr": checks.rule(checks.number, above=0),
    "task_labelled": COUNT, "task_unlabelled": checks.rule(checks.integer, minimum=0),
    "max_skipped_steps": COUNT, "collective_timeout": checks.rule(checks.number, above=0),
}
"""The flags' values as ``TrainConfig`` and its sections check them, by their flat names (a test checks that
``TrainConfig`` refuses each value these refuse)."""


def preflight(values: dict[str, Any], *, builtin: bool = False) -> None:
    """Refuses (``ValueError``, one line naming the flag) what is wrong in ``values`` (``TrainConfig.from_flat``'s
    names) before any heavy import. ``builtin``: the built-in run, whose teacher is its own."""
    for name, rule in RULES.items():
        if values.get(name) is not None:
            rule("--" + name.replace("_", "-"), values[name])
    if values.get("task") is not None and values.get("prompts") is not None:
        raise ValueError(f"--task {values['task']} brings its own examples and --prompts {values['prompts']!r} "
                         "another set: give one of them")
    check_split(values.get("task"), values.get("task_labelled"), values.get("task_unlabelled"))
    if values.get("resume") is not None:
        find_checkpoint(values["resume"])
    if values.get("output_dir") is not None:
        check_output_dir(values["output_dir"], resume=values.get("resume"), overwrite=bool(values.get("overwrite")))
    if values.get("deepspeed") is not None and not isinstance(values["deepspeed"], dict):
        ds = read_deepspeed_file(values["deepspeed"])
        if values.get("dtype") not in (None, "auto"):  # auto takes what the config says: no disagreement
            run_dtype(values["dtype"], ds, "cpu", values["deepspeed"])
    AdapterConfig(**{leaf: values[flat] for flat, leaf in (("lora_rank", "rank"), ("lora_alpha", "alpha"),
                                                           ("lora_targets", "targets"), ("merge_lora", "merge"))
                     if values.get(flat) is not None})
    specs = specs_from_flags(values)
    check_save_best(values.get("save_best"), objective=values.get("objective", "opsd"),
                    task_eval=values.get("eval_data") is not None or values.get("task") is not None,
                    eval_samples=values.get("eval_samples") or 1,
                    teachers=tuple(spec.name for spec in specs) if routed(specs) else ())
    check_specs(specs, values.get("default_teacher"))
    check_self(specs, values.get("objective", "opsd"), values.get("lmbda", 1.0),
               teacher_samples=values.get("off_policy") == "teacher")
    if not builtin:
        check_teacher_given(values.get("objective", "opsd"), specs)
        if values.get("resume") is not None:
            check_resumed_run(values["resume"], {"student": DEFAULT_STUDENT, "prompts": None, "task": None,
                                                 "objective": "opsd", **values})
        student = values.get("student") or DEFAULT_STUDENT
        for spec in specs:
            if spec.kind == "model":
                check_vocabularies(student, vocab_size(student), spec.label, vocab_size(spec.source))
    if values.get("prompts") is not None:
        names = {spec.name for spec in specs} if routed(specs) else None
        records = read_records(values["prompts"])
        where = f"--prompts {values['prompts']!r}"
        check_routes(records, names, where)
        check_references_shown(records, context_of(specs, values.get("default_teacher")), where)
    task = {leaf: values[flat] for flat, leaf in (("eval_data", "data"), ("eval_scorer", "scorer"),
                                                  ("eval_samples", "samples"),
                                                  ("eval_max_new_tokens", "max_new_tokens"))
            if values.get(flat) is not None}
    if task:
        config = TaskEvalConfig(**task)
        read_eval_file(config.data, config.scorer)


def check_teacher_given(objective: str, teachers: tuple[TeacherSpec, ...]) -> None:
    """Distilling needs a teacher: a preset, a checkpoint directory, or a served one (or several, named)."""
    if objective == "opsd" and not teachers:
        raise ValueError("a teacher is needed to distil (objective opsd): a preset, a local checkpoint directory or a "
                         "served teacher's address (--teacher, --teacher-url)")


def check_vocabularies(student: str, student_vocab: int | None, teacher: str | None,
                       teacher_vocab: int | None) -> None:
    """Refuses a teacher whose vocabulary is not the student's (sizes ``None`` when unknown yet: not checked)."""
    if teacher is not None and None not in (student_vocab, teacher_vocab) and student_vocab != teacher_vocab:
        raise ValueError(f"student {student!r} has a vocabulary of {student_vocab:,} tokens and teacher {teacher!r} "
                         f"one of {teacher_vocab:,}: distillation needs the same vocabulary")


def check_references_shown(records: list[Any], contexts: Any, where: str) -> None:
    """Every record whose teacher is shown the reference (a context) has one."""
    for record in records if contexts is not None else ():
        if contexts(record.teacher) is not None and record.reference is None:
            raise ValueError(f"{where} line {record.line}: its teacher is shown the reference (--teacher-context, "
                             "--teacher self), and it has no 'reference'")


def check_routes(records: list[Any], names: set[str] | None, where: str) -> None:
    """Every record's ``teacher`` is one of the run's teachers; with one teacher, no record names one."""
    for record in records:
        if record.teacher is None:
            continue
        if names is None:
            raise ValueError(f"{where} line {record.line} names teacher {record.teacher!r}, and the run has one "
                             "teacher: give each by name (--teacher NAME=PRESET_OR_DIR, --teacher-url NAME=URL)")
        if record.teacher not in names:
            raise ValueError(f"{where} line {record.line} names teacher {record.teacher!r}, which is none of the "
                             f"run's teachers {sorted(names)}")
