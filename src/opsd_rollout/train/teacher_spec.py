"""Who teaches a run: one list of ``TeacherSpec`` (a name, where the teacher comes from, and its own options), and
the command line's teacher flags mapped onto it in one place (``specs_from_flags``). Light: no torch, transformers or
DeepSpeed at import, so ``train``'s checks answer before they load.

A teacher comes from a preset name or a local checkpoint directory (run in-process beside the student), or from an
``http(s)://`` address (a served teacher: vLLM's or SGLang's server, or ``opsd-rollout serve-teacher``). With one
teacher every example goes to it; with several (or one given a name) each example goes to the one its ``teacher``
field names, else to the run's default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from opsd_rollout import checks

UNNAMED = "default"
"""The name of the teacher given without one."""
NAME = re.compile(r"[A-Za-z0-9_.-]+")
PROTOCOLS = ("vllm", "sglang")
"""A served teacher's API: vLLM's OpenAI-compatible ``/v1/completions`` (also ``serve-teacher``'s), SGLang's
``/generate``."""
KINDS = ("model", "served")


@dataclass(frozen=True, kw_only=True)
class TeacherSpec:
    """One teacher of a run."""

    source: str
    """Where it comes from: a preset name or a local checkpoint directory (run here, frozen, in eval mode), or the
    ``http://``/``https://`` address of a server that scores the rollouts."""
    name: str = UNNAMED
    """What examples route by (their ``teacher`` field); ``default`` for the teacher given without a name."""
    model: str | None = None
    """Served: the model the server must serve (checked at the start; ``None``: the one it serves)."""
    zero_stage: int = 0
    """In-process: 0, whole beside the student on every rank; 3, a DeepSpeed ZeRO-3 inference engine, partitioned
    across the ranks (a teacher larger than one device)."""
    protocol: str = "vllm"
    """Served: ``vllm`` or ``sglang`` (``PROTOCOLS``)."""
    api_key: str | None = None
    """Served: the server's key, sent as a bearer token; never written to ``train_config.json``. ``None``:
    ``$OPSD_ROLLOUT_API_KEY`` if set."""
    timeout: float = 120.0
    """Served: seconds an unanswering server is retried, with backoff, at the start and mid-run; then the run stops
    with a checkpoint of its last completed step (a vLLM server may still be loading its model)."""
    overlap: bool | None = None
    """Served: its requests in flight while the student works (its forward, and with gradient accumulation the next
    micro-batches' rollouts); ``False``: each micro-batch waits for its answer (the same samples and losses).
    ``None``: on, unless the server is on this machine's loopback and the student on its CPU (the same cores)."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"teacher source must be a preset name, a checkpoint directory or a server's http(s):// "
                             f"address; got {self.source!r}")
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ValueError(f"teacher name {self.name!r}: letters, digits, '_', '-' and '.'")
        checks.choice("zero_stage", self.zero_stage, (0, 3))
        checks.choice("protocol", self.protocol, PROTOCOLS)
        checks.number("timeout", self.timeout, at_least=0)
        if self.kind == "served" and self.zero_stage != 0:
            raise ValueError(f"teacher {self.name!r}: zero_stage partitions an in-process teacher; a served teacher "
                             "runs on its server")
        if self.kind == "model" and self.model is not None:
            raise ValueError(f"teacher {self.name!r}: model names what a server must serve; {self.source!r} is not "
                             "a server's address")

    @property
    def kind(self) -> str:
        """``served`` (an address) or ``model`` (a preset or a directory, run here)."""
        return "served" if self.source.startswith(("http://", "https://")) else "model"

    @property
    def served(self) -> bool:
        return self.kind == "served"

    @property
    def label(self) -> str:
        """The teacher as a message names it: ``NAME=SOURCE``, or the source alone for the unnamed one."""
        return self.source if self.name == UNNAMED else f"{self.name}={self.source}"

    def to_dict(self) -> dict[str, Any]:
        """What ``train_config.json`` keeps: every field but the key."""
        return {**{name: getattr(self, name) for name in self.__dataclass_fields__}, "api_key": None}


DEFAULTS = {name: f.default for name, f in TeacherSpec.__dataclass_fields__.items()}


def check_specs(specs: tuple[TeacherSpec, ...], default: str | None) -> None:
    """Several teachers: names unique, ``default`` one of them, each whole on every rank."""
    names = [spec.name for spec in specs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"teacher name{'s' if len(twice) > 1 else ''} {', '.join(twice)} given twice: a name is one "
                         "teacher")
    if default is not None and default not in names:
        raise ValueError(f"default_teacher {default!r} is none of the teachers {sorted(names)}")
    if routed(specs) and any(spec.zero_stage != 0 for spec in specs):
        raise ValueError("teacher zero_stage 3 partitions one teacher across the ranks; with several teachers each is "
                         "whole on every rank (serve a large one: --teacher-url NAME=URL)")


def routed(specs: tuple[TeacherSpec, ...]) -> bool:
    """Whether examples are routed by name: several teachers, or one given a name."""
    return len(specs) > 1 or any(spec.name != UNNAMED for spec in specs)


def as_specs(teachers: Iterable[TeacherSpec | str]) -> tuple[TeacherSpec, ...]:
    """``TrainConfig.teachers`` as given (specs, or sources as strings) as a tuple of specs."""
    if isinstance(teachers, (str, TeacherSpec)):
        teachers = [teachers]
    out = []
    for teacher in teachers:
        if isinstance(teacher, dict):  # read back from train_config.json
            teacher = TeacherSpec(**teacher)
        elif isinstance(teacher, str):
            teacher = TeacherSpec(source=teacher)
        elif not isinstance(teacher, TeacherSpec):
            raise TypeError(f"teachers: a TeacherSpec or a source string each; got {type(teacher).__name__}")
        out.append(teacher)
    return tuple(out)


# ---- the command line's teacher flags -----------------------------------------------------------------------------

SERVED_OPTIONS = {"teacher_api_key": "api_key", "teacher_timeout": "timeout", "teacher_protocol": "protocol",
                  "teacher_overlap": "overlap"}
"""Flags that set an option of every served teacher, by flat name -> ``TeacherSpec`` field."""
MODEL_OPTIONS = {"teacher_zero_stage": "zero_stage"}
"""Flags that set an option of every in-process teacher."""
FLAGS = ("teacher", "teacher_url", *SERVED_OPTIONS, *MODEL_OPTIONS)
"""The flat names ``specs_from_flags`` consumes."""


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


def specs_from_flags(values: dict[str, Any]) -> tuple[TeacherSpec, ...]:
    """The teachers the flags name, in the order: the unnamed one first, then ``--teacher NAME=...``, then
    ``--teacher-url NAME=...``. ``--teacher`` and ``--teacher-url`` are repeatable lists (or one string, from the
    library); an unnamed ``--teacher`` beside an unnamed ``--teacher-url`` names the model that server must serve.
    The served teachers' flags (key, timeout, protocol, overlap) set each served one's options, and
    ``--teacher-zero-stage`` each in-process one's."""
    model, models = named("--teacher", values.get("teacher"))
    url, urls = named("--teacher-url", values.get("teacher_url"))
    both = sorted(set(models) & set(urls))
    if both:
        raise ValueError(f"teacher name{'s' if len(both) > 1 else ''} {both} given both as a model (--teacher) and "
                         "as a server (--teacher-url): a name is one teacher")
    for name in (*models, *urls):
        if name == UNNAMED:
            raise ValueError(f"teacher name {UNNAMED!r} is the teacher given without a name: choose another")
    options = {"served": {field: values[flag] for flag, field in SERVED_OPTIONS.items() if values.get(flag) is not None},
               "model": {field: values[flag] for flag, field in MODEL_OPTIONS.items() if values.get(flag) is not None}}
    specs = [TeacherSpec(source=url, model=model)] if url is not None else [TeacherSpec(source=model)] if model else []
    specs += [TeacherSpec(name=name, source=source) for name, source in (*models.items(), *urls.items())]
    kinds = {spec.kind for spec in specs}
    for kind, flags, what in (("served", SERVED_OPTIONS, "a served teacher (--teacher-url)"),
                              ("model", MODEL_OPTIONS, "an in-process teacher (--teacher PRESET_OR_DIR)")):
        given = ", ".join("--" + flag.replace("_", "-") for flag, field in flags.items()
                          if values.get(flag) is not None and values[flag] != DEFAULTS[field])
        if given and kind not in kinds:
            raise ValueError(f"{given}: an option of {what}, and the run has none")
    return tuple(replace(spec, **options[spec.kind]) for spec in specs)
