"""Who teaches a run: one list of ``TeacherSpec`` (a name, where the teacher comes from, and its own options), and
the command line's teacher flags mapped onto it in one place (``specs_from_flags``). Light: no torch, transformers or
DeepSpeed at import, so ``train``'s checks answer before they load.

A teacher comes from a preset name or a local checkpoint directory (run in-process beside the student), from an
``http(s)://`` address (a served teacher: vLLM's or SGLang's server, or ``opsd-rollout serve-teacher``), or is the
student itself (``self``: on-policy self-distillation, its starting weights or its live ones). A teacher may see
another prompt than the student's: its ``context``, a template filled with each example's prompt and reference (a
self-teacher's default: ``DEFAULT_CONTEXT``). With one teacher every example goes to it; with several (or one given
a name) each example goes to the one its ``teacher`` field names, else to the run's default.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from opsd_rollout import checks

UNNAMED = "default"
"""The name of the teacher given without one."""
NAME = re.compile(r"[A-Za-z0-9_.-]+")
PROTOCOLS = ("vllm", "sglang")
"""A served teacher's API: vLLM's OpenAI-compatible ``/v1/completions`` (also ``serve-teacher``'s), SGLang's
``/generate``."""
KEY_VARIABLE = "OPSD_ROLLOUT_API_KEY"
"""The environment variable a served teacher's key is read from when none is given: the way to pass it, as a
command line's arguments are visible to every user of the machine."""
SELF = "self"
"""The source (or, served, the model) that names the student itself."""
SELF_WEIGHTS = ("initial", "live")
"""Which of the student's weights teach: its starting ones, frozen (the paper's fixed teacher), or its live ones
(``opsd.self_teacher.SelfTeacher`` builds each)."""
DEFAULT_CONTEXT = ("{prompt}\nA reference solution:\n{reference}\n\nRead it, then solve the problem above in your "
                   "own words.\n")
"""A self-teacher's prompt unless told (the problem, then the reference solution, then an instruction to solve the
problem in its own words, as the OPSD paper's teacher prompt has it)."""
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


SLOWEST_ANSWER_S = 30.0
"""The shortest limit on one served request (``TeacherSpec.request_timeout_s``)."""


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
    """Served: the server's key, sent as a bearer token; never written to ``train_config.json``, printed or logged.
    ``None``: ``$OPSD_ROLLOUT_API_KEY`` if set (``KEY_VARIABLE``)."""
    timeout: float = 120.0
    """Served: seconds an unanswering server is retried, with backoff, at the start and mid-run; then the run stops
    with a checkpoint of its last completed step (a vLLM server may still be loading its model)."""
    overlap: bool | None = None
    """Served: its requests in flight while the student works (its forward, and with gradient accumulation the next
    micro-batches' rollouts); ``False``: each micro-batch waits for its answer (the same samples and losses).
    ``None``: on, unless the server is on this machine's loopback and the student on its CPU (the same cores)."""
    self_weights: str = "initial"
    """Self-distillation (``source="self"``, or a served teacher whose ``model`` is ``self``): which of the student's
    weights teach, ``initial`` (its starting weights, frozen: a LoRA student's base with the adapters disabled, a
    full student's frozen copy; a server serves them) or ``live`` (the student as it is, without gradient; in this
    process only)."""
    context: str | None = None
    """The teacher's own prompt: a template where ``{prompt}`` is the example's prompt (a chat example's last user
    turn) and ``{reference}`` its reference, so the teacher scores the student's response knowing the answer.
    ``None``: the student's prompt (a self-teacher: ``DEFAULT_CONTEXT``)."""

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
        if self.kind != "served" and self.model is not None:
            raise ValueError(f"teacher {self.name!r}: model names what a server must serve; {self.source!r} is not "
                             "a server's address")
        checks.choice("self_weights", self.self_weights, SELF_WEIGHTS)
        if not self.is_self and self.self_weights != "initial":
            raise ValueError(f"teacher {self.label!r}: self_weights (--self-teacher) says which of the student's "
                             "weights teach, and this teacher is not the student (--teacher self)")
        if self.is_self and self.served and self.self_weights == "live":
            raise ValueError("--self-teacher live is the student's weights as they train, in this process; a server "
                             "holds its own copy (the student's starting weights): use --self-teacher initial with a "
                             "served self-teacher, or drop --teacher-url")
        if self.is_self and self.zero_stage != 0:
            raise ValueError("teacher self is partitioned as the student is (its starting weights under ZeRO-3 "
                             "too): drop --teacher-zero-stage")
        if self.is_self and self.context is None:
            object.__setattr__(self, "context", DEFAULT_CONTEXT)
        if self.context is not None:
            check_context(self.context)

    @property
    def request_timeout_s(self) -> float:
        """Served: one request's limit, its ``timeout`` but at least ``SLOWEST_ANSWER_S`` (a slow answer from a busy
        server is not a gone one)."""
        return max(self.timeout, SLOWEST_ANSWER_S)

    @property
    def wait_bound_s(self) -> float:
        """Served: the longest a rank waits for it before it gives up: retried for ``timeout`` seconds, the last try
        lasting up to ``request_timeout_s`` (a server that hangs with its connection open); a gone server (its port
        refuses, its connections reset) is given up on after ``timeout``."""
        return self.timeout + self.request_timeout_s

    @property
    def kind(self) -> str:
        """``served`` (an address), ``self`` (the student, here) or ``model`` (a preset or a directory, run here)."""
        if self.source.startswith(("http://", "https://")):
            return "served"
        return "self" if self.source == SELF else "model"

    @property
    def is_self(self) -> bool:
        """Whether the student teaches itself: here (``source="self"``) or served (``model="self"``)."""
        return self.source == SELF or self.model == SELF

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


def check_context(template: str, flag: str = "--teacher-context") -> None:
    """A teacher's context template: ``{reference}`` in it (else it would show the teacher nothing the student lacks),
    and no placeholder but ``{prompt}`` and ``{reference}``."""
    if not isinstance(template, str):
        raise TypeError(f"{flag} must be a text with {{prompt}} and {{reference}}; got {type(template).__name__}")
    unknown = sorted({name for name in PLACEHOLDER.findall(template)} - {"prompt", "reference"})
    if unknown:
        raise ValueError(f"{flag}: unknown placeholder{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join('{' + name + '}' for name in unknown)}; a context has {{prompt}} and {{reference}}")
    if "{reference}" not in template:
        raise ValueError(f"{flag} must show the teacher the reference: put {{reference}} in it (and {{prompt}} where "
                         f"the problem goes); got {template!r:.80}")


def fill(template: str, *, prompt: str, reference: str) -> str:
    """``template`` with ``{prompt}`` and ``{reference}`` replaced (other braces are kept as written)."""
    return PLACEHOLDER.sub(lambda m: {"prompt": prompt, "reference": reference}[m.group(1)], template)


def check_self(specs: tuple[TeacherSpec, ...], objective: str, lmbda: float, teacher_samples: bool) -> None:
    """What the student as its own teacher cannot do: train by SFT (it has no teacher then), or make the off-policy
    steps' samples (a self-teacher would sample with the reference in its prompt: train those steps on the
    references)."""
    if not any(spec.is_self for spec in specs):
        return
    if objective != "opsd":
        raise ValueError(f"--teacher self distils the student from itself on its own samples; --objective {objective} "
                         "trains on the references alone: drop --teacher self, or use --objective opsd")
    if lmbda < 1 and teacher_samples:
        raise ValueError("--lmbda < 1 with --teacher self: the other steps would train on the teacher's samples, and "
                         "the self-teacher scores, it does not sample; train them on the references "
                         "(--off-policy references, every example with a 'reference') or use --lmbda 1")


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


def context_of(specs: tuple[TeacherSpec, ...], default: str | None = None) -> Callable[[str | None], str | None] | None:
    """An example's teacher (its ``teacher`` field: a name, or ``None`` for the default one) -> that teacher's context
    template (``None``: it sees the student's prompt); ``None`` when no teacher has a context."""
    if not any(spec.context is not None for spec in specs):
        return None
    by_name = {spec.name: spec.context for spec in specs}
    fallback = default or (UNNAMED if UNNAMED in by_name else specs[0].name)
    if not routed(specs):
        return lambda _name: specs[0].context
    return lambda name: by_name.get(name or fallback)


def described(specs: tuple[TeacherSpec, ...]) -> tuple[str | None, str | None]:
    """What a step record says of its teachers: who (each one's source, ``self (initial)`` or ``self (live)`` for the
    student, ``NAME=...`` with several) and the context they were shown (the template; ``NAME=...`` each when they
    differ; ``None``: the student's prompts)."""
    def who(spec: TeacherSpec) -> str:
        if not spec.is_self:
            return spec.source
        return f"self ({spec.self_weights})" if not spec.served else f"self ({spec.self_weights}, {spec.source})"

    if not specs:
        return None, None
    several = routed(specs)
    teacher = ", ".join(f"{spec.name}={who(spec)}" if several else who(spec) for spec in specs)
    contexts = {spec.context for spec in specs}
    if contexts == {None}:
        return teacher, None
    if len(contexts) == 1:
        return teacher, contexts.pop()
    return teacher, "; ".join(f"{spec.name}={spec.context}" for spec in specs if spec.context is not None)


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

OPTIONS: dict[str, tuple[str, str]] = {
    "teacher_api_key": ("api_key", "served"), "teacher_timeout": ("timeout", "served"),
    "teacher_protocol": ("protocol", "served"), "teacher_overlap": ("overlap", "served"),
    "teacher_zero_stage": ("zero_stage", "model"), "self_teacher": ("self_weights", "self"),
    "teacher_context": ("context", "any"),
}
"""Flags that set an option of each teacher of a kind, by flat name -> (``TeacherSpec`` field, the teachers it sets:
``served`` ones, in-process ``model`` ones, ``self`` (the student teaching itself, here or served) or ``any``)."""
TAKES = {"served": lambda spec: spec.served, "model": lambda spec: spec.kind == "model",
         "self": lambda spec: spec.is_self, "any": lambda spec: True}
WHAT = {"served": "a served teacher (--teacher-url)", "model": "an in-process teacher (--teacher PRESET_OR_DIR)",
        "self": "the student as its own teacher (--teacher self)", "any": "a teacher"}
FLAGS = ("teacher", "teacher_url", *OPTIONS)
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
    ``--teacher self`` is the student (with ``--teacher-url``: served, the server serving the student's starting
    weights). Each option flag sets that option of every teacher of its kind (``OPTIONS``); one for a kind the run
    lacks is refused."""
    model, models = named("--teacher", values.get("teacher"))
    url, urls = named("--teacher-url", values.get("teacher_url"))
    both = sorted(set(models) & set(urls))
    if both:
        raise ValueError(f"teacher name{'s' if len(both) > 1 else ''} {both} given both as a model (--teacher) and "
                         "as a server (--teacher-url): a name is one teacher")
    for name in (*models, *urls):
        if name == UNNAMED:
            raise ValueError(f"teacher name {UNNAMED!r} is the teacher given without a name: choose another")
    specs = [TeacherSpec(source=url, model=model)] if url is not None else [TeacherSpec(source=model)] if model else []
    specs += [TeacherSpec(name=name, source=source) for name, source in (*models.items(), *urls.items())]
    for flag, (field, kind) in OPTIONS.items():
        if values.get(flag) is None:
            continue
        taking = [i for i, spec in enumerate(specs) if TAKES[kind](spec)]
        if not taking and (kind in ("self", "any") or values[flag] != DEFAULTS[field]):
            raise ValueError(f"--{flag.replace('_', '-')}: an option of {WHAT[kind]}, and the run has none")
        for i in taking:
            specs[i] = replace(specs[i], **{field: values[flag]})
    return tuple(specs)
