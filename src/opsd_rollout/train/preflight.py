"""A training run's inputs checked before torch, transformers or DeepSpeed load: the files and names that need no
model (each flag's value; the prompt file, line by line; the DeepSpeed config file; a ``--resume`` directory; student and teacher
named as presets or checkpoint directories, their vocabularies from their configs; the LoRA flags), so that a
mistake costs the command line a fraction of a second, as ``bench``'s do. ``TrainConfig`` checks the same values
again (for the library's callers, and the combinations of flags: a loss and a cache that do not go together);
what needs a model (a LoRA target that matches no layer) is checked once its config is loaded, before any step.
Light: this module imports none of the three.
"""

from __future__ import annotations

import re
from typing import Any

from opsd_rollout import checks
from opsd_rollout.deepspeed_config import read_deepspeed_file
from opsd_rollout.models import vocab_size
from opsd_rollout.train.checkpoint import find_checkpoint
from opsd_rollout.train.eval_file import TaskEvalConfig, read_eval_file
from opsd_rollout.train.lora import AdapterConfig
from opsd_rollout.train.records import read_records

UNNAMED = "default"
"""The name of the teacher given without one beside named ones (``TrainConfig``'s, which a test checks)."""
NAME = re.compile(r"[A-Za-z0-9_.-]+")
DEFAULT_STUDENT = "llama-tiny"
"""``TrainConfig.student``'s default (a test checks they agree)."""
COUNT = checks.rule(checks.integer)
RULES = {
    **{name: COUNT for name in ("steps", "prompts_per_micro_batch", "samples_per_prompt", "max_new_tokens",
                                "max_prompt_tokens", "eval_every", "eval_prompts", "save_every", "teacher_top_k",
                                "gradient_accumulation_steps", "lora_rank")},
    "top_k": checks.rule(checks.integer, minimum=None), "lr": checks.rule(checks.number, above=0),
    "lmbda": checks.rule(checks.number, at_least=0, at_most=1), "beta": checks.rule(checks.number, at_least=0,
                                                                                    at_most=1),
    "top_p": checks.rule(checks.number, above=0, at_most=1), "temperature": checks.rule(checks.number),
    "teacher_timeout": checks.rule(checks.number, at_least=0), "lora_alpha": checks.rule(checks.number, above=0),
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
    if values.get("resume") is not None:
        find_checkpoint(values["resume"])
    if values.get("deepspeed") is not None and not isinstance(values["deepspeed"], dict):
        read_deepspeed_file(values["deepspeed"])
    AdapterConfig(**{leaf: values[flat] for flat, leaf in (("lora_rank", "rank"), ("lora_alpha", "alpha"),
                                                           ("lora_targets", "targets"), ("merge_lora", "merge"))
                     if values.get(flat) is not None})
    if not builtin:
        check_teacher_given(values.get("objective", "opsd"), values.get("teacher"), values.get("teacher_url"),
                            values.get("teachers"), values.get("teacher_urls"))
        student = values.get("student") or DEFAULT_STUDENT
        teacher = values.get("teacher") if values.get("teacher_url") is None else None
        models = {teacher: teacher} if teacher else {}
        models.update({f"{name}={spec}": spec for name, spec in (values.get("teachers") or {}).items()})
        for shown, spec in models.items():
            check_vocabularies(student, vocab_size(student), shown, vocab_size(spec))
    if values.get("prompts") is not None:
        check_routes(read_records(values["prompts"]), teacher_names(values), f"--prompts {values['prompts']!r}")
    task = {leaf: values[flat] for flat, leaf in (("eval_data", "data"), ("eval_scorer", "scorer"),
                                                  ("eval_samples", "samples"),
                                                  ("eval_max_new_tokens", "max_new_tokens"))
            if values.get(flat) is not None}
    if task:
        config = TaskEvalConfig(**task)
        read_eval_file(config.data, config.scorer)


def check_teacher_given(objective: str, teacher: str | None, teacher_url: str | None,
                        teachers: dict[str, str] | None = None, teacher_urls: dict[str, str] | None = None) -> None:
    """Distilling needs a teacher: a preset, a checkpoint directory, or a served one (or several, named)."""
    if objective == "opsd" and teacher is None and teacher_url is None and not teachers and not teacher_urls:
        raise ValueError("teacher is needed to distil (objective opsd): a preset, a local checkpoint directory or a "
                         "served teacher's teacher_url (--teacher, --teacher-url)")


def check_vocabularies(student: str, student_vocab: int | None, teacher: str | None,
                       teacher_vocab: int | None) -> None:
    """Refuses a teacher whose vocabulary is not the student's (sizes ``None`` when unknown yet: not checked)."""
    if teacher is not None and None not in (student_vocab, teacher_vocab) and student_vocab != teacher_vocab:
        raise ValueError(f"student {student!r} has a vocabulary of {student_vocab:,} tokens and teacher {teacher!r} "
                         f"one of {teacher_vocab:,}: distillation needs the same vocabulary")


def named(flag: str, values: list[str] | str | None) -> tuple[str | None, dict[str, str]]:
    """A repeatable teacher flag's values (``--teacher``, ``--teacher-url``): the one given without a name, and the
    ``NAME=VALUE`` ones by name. A value whose text before ``=`` is not a name (a path, ``http://...?a=b``) has
    none."""
    if values is None or isinstance(values, str):
        return values, {}
    plain, by_name = [], {}
    for value in values:
        name, equals, rest = value.partition("=")
        if equals and NAME.fullmatch(name) and rest and not name.startswith(("http", "/")):
            if name in by_name:
                raise ValueError(f"{flag} {name}= given twice: one teacher a name")
            by_name[name] = rest
        else:
            plain.append(value)
    if len(plain) > 1:
        raise ValueError(f"{flag} given {len(plain)} times without a name ({', '.join(plain)}): name each "
                         f"(--{flag.lstrip('-')} NAME=...) to distil from several teachers")
    return (plain[0] if plain else None), by_name


def split_teachers(values: dict[str, Any]) -> dict[str, Any]:
    """The command line's ``teacher`` and ``teacher_url`` lists as ``TrainConfig``'s fields: the unnamed one in
    ``teacher``/``teacher_url``, the named ones in ``teachers``/``teacher_urls``."""
    values = dict(values)
    for flag, single, several in (("--teacher", "teacher", "teachers"), ("--teacher-url", "teacher_url",
                                                                         "teacher_urls")):
        if single in values:
            plain, by_name = named(flag, values.pop(single))
            if plain is not None:
                values[single] = plain
            if by_name:
                values[several] = by_name
    return values


def teacher_names(values: dict[str, Any]) -> set[str] | None:
    """The names examples may route to (``None``: one teacher, no routing)."""
    if not values.get("teachers") and not values.get("teacher_urls"):
        return None
    unnamed = {UNNAMED} if values.get("teacher") or values.get("teacher_url") else set()
    return unnamed | set(values.get("teachers") or {}) | set(values.get("teacher_urls") or {})


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
