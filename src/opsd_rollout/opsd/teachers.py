"""The teachers of a step: one, or several with each prompt routed to one of them by name (NeMo-RL's multi-teacher
on-policy distillation). Each teacher gets its share of the rows, builds (or, served, asks for) the cache of
those rows alone, and the step's loss is the sum of every share's; a row's loss is what it would be with its
teacher alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias, overload

import torch

from opsd_rollout.modeling import innermost_model, model_config, text_config
from opsd_rollout.opsd.self_teacher import SelfTeacher
from opsd_rollout.opsd.served import InFlight, ServedTeacher, refuse_full_cache
from opsd_rollout.opsd.targets import ResponseTargets
from opsd_rollout.opsd.teacher import TeacherCache, TeacherCacheConfig

Teacher: TypeAlias = "torch.nn.Module | ServedTeacher"
"""A step's teacher: a model run here (plain, PEFT-wrapped or a DeepSpeed engine, ZeRO-3 partitioned or not; the
student in its own context, ``SelfTeacher``, is one), or a ``ServedTeacher`` whose server sends the cache."""
Teachers: TypeAlias = "Teacher | Mapping[str, Teacher]"
"""One teacher, or several by name (each step then routes each prompt to one)."""


@dataclass(eq=False, kw_only=True)
class Share:
    """One teacher's share of a step: its rows of the batch, their targets, and its cache (here, or on its way)."""

    name: str | None
    """The teacher's name; ``None`` for a step's only teacher."""
    teacher: Teacher
    rows: torch.Tensor | None
    """[n] the batch rows it scores (int64, ascending); ``None``: every row."""
    targets: ResponseTargets
    """Those rows' targets, in the whole batch's window: what the student's loss is over."""
    scored: ResponseTargets | None = None
    """What the teacher scores, when its prompts are not the student's (its own context before the same responses:
    ``targets.reprompted``); ``None``: ``targets``."""
    cache: TeacherCache | None = None
    pending: InFlight | None = None
    """A served teacher's cache on its way."""

    @property
    def teacher_targets(self) -> ResponseTargets:
        return self.scored if self.scored is not None else self.targets

    @property
    def served(self) -> bool:
        return isinstance(self.teacher, ServedTeacher)

    @property
    def built(self) -> TeacherCache:
        """Its cache, once built here or received."""
        if self.cache is None:
            raise RuntimeError(f"teacher {self.name!r}'s cache is not in yet")
        return self.cache

    @overload
    def pick(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @overload
    def pick(self, tensor: None) -> None: ...

    def pick(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor``'s rows of this share (``tensor`` [N, ...] over the whole batch)."""
        if tensor is None or self.rows is None:
            return tensor
        return tensor.index_select(0, self.rows.to(tensor.device))


def check_teacher(teacher: Teacher, student_vocab: int, cache: TeacherCacheConfig, name: str | None = None) -> None:
    """Before any work: a served teacher's cache mode, server, model, tokenizer and vocabulary; an in-process
    teacher's vocabulary against the student's."""
    called = f"teacher {name!r}" if name is not None else "the teacher"
    if isinstance(teacher, ServedTeacher):
        refuse_full_cache(cache)
        teacher.connect(student_vocab)
        return
    teacher_vocab = text_config(model_config(innermost_model(teacher))).vocab_size
    if student_vocab != teacher_vocab:  # a partitioned teacher would fail inside its gathers
        raise ValueError(f"{called}'s vocabulary ({teacher_vocab:,} tokens) differs from the student's "
                         f"({student_vocab:,}): distillation compares their distributions token by token")


def check_routes(teachers: Mapping[str, Teacher], routes: Sequence[str] | None, prompts: int) -> None:
    """``routes``: one teacher name per prompt of the request, each a key of ``teachers``."""
    if not isinstance(routes, Sequence) or isinstance(routes, str) or len(routes) != prompts:
        raise ValueError(f"routes must name one teacher for each of the request's {prompts} prompts (several "
                         f"teachers: {sorted(teachers)}); got {routes!r:.200}")
    unknown = sorted({name for name in routes if name not in teachers})
    if unknown:
        raise ValueError(f"routes name teachers {unknown} the step was not given; its teachers are {sorted(teachers)}")


def route_rows(teachers: Mapping[str, Teacher], routes: Sequence[str], samples_per_prompt: int,
               device: torch.device) -> dict[str, torch.Tensor]:
    """Each teacher's batch rows (prompt ``i``'s samples are rows ``i*n .. i*n+n-1``), in ``teachers``' order; a
    teacher routed no prompt gets no rows."""
    rows = {}
    for name in teachers:
        prompts = [i for i, route in enumerate(routes) if route == name]
        rows[name] = torch.tensor([p * samples_per_prompt + s for p in prompts for s in range(samples_per_prompt)],
                                  dtype=torch.long, device=device)
    return rows


def share_targets(targets: ResponseTargets, rows: torch.Tensor) -> ResponseTargets:
    """``targets``' ``rows`` (the window, prompt length and columns kept: a share's cache lines up with the whole
    batch's student forward)."""
    pick = rows.to(targets.input_ids.device)
    return ResponseTargets(targets.input_ids.index_select(0, pick), targets.attention_mask.index_select(0, pick),
                           targets.prompt_length, targets.labels.index_select(0, pick),
                           targets.mask.index_select(0, pick.to(targets.mask.device)))


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters held on this rank (a ZeRO-3 parameter's own partition); a ``SelfTeacher``'s
    own alone (the student's weights it scores with are the student's)."""
    params = module.parameters() if isinstance(module, SelfTeacher) else innermost_model(module).parameters()
    held = (getattr(p, "ds_tensor", p) for p in params)
    return sum(t.numel() * t.element_size() for t in held)
