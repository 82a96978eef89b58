"""How long a training run's collectives wait: long enough for a served teacher's retries on one rank.

A rank that waits for a served teacher keeps every other rank waiting in the next collective, so the process group's
timeout must outlast the longest such wait, or the healthy ranks give up first and the run dies of a slow teacher.
"""

from __future__ import annotations

from opsd_rollout import checks
from opsd_rollout.deepspeed_engine import DEFAULT_COLLECTIVE_TIMEOUT_S
from opsd_rollout.train.teacher_spec import TeacherSpec

COLLECTIVE_MARGIN_S = 60.0
"""What a collective waits beyond the longest a served teacher keeps one rank: that rank's checkpoint and the
micro-batch's other work."""


def teacher_wait_bound(teachers: tuple[TeacherSpec, ...]) -> float:
    """The longest a rank waits for a served teacher before it gives up (``TeacherSpec.wait_bound_s``); 0 without
    one."""
    return max((spec.wait_bound_s for spec in teachers if spec.served), default=0.0)


def default_collective_timeout(teachers: tuple[TeacherSpec, ...]) -> float:
    """``DEFAULT_COLLECTIVE_TIMEOUT_S``, or longer when a served teacher may keep a rank ``teacher_wait_bound``
    seconds."""
    return max(DEFAULT_COLLECTIVE_TIMEOUT_S, teacher_wait_bound(teachers) + COLLECTIVE_MARGIN_S)


def check_collective_timeout(timeout: float | None, teachers: tuple[TeacherSpec, ...]) -> None:
    """A collective timeout given (``collective_timeout``, ``None`` for the default) must outlast a served teacher's
    retries: the other ranks wait for them."""
    timeout = checks.number("collective_timeout", timeout, above=0, optional=True)
    bound = teacher_wait_bound(teachers)
    if timeout is not None and bound and timeout < bound + COLLECTIVE_MARGIN_S:
        raise ValueError(f"--collective-timeout {timeout:g} s is shorter than the ranks may wait for a served teacher "
                         f"({bound:g} s: --teacher-timeout and one request's limit, + {COLLECTIVE_MARGIN_S:g} s): give "
                         f"at least {bound + COLLECTIVE_MARGIN_S:g}, or a shorter --teacher-timeout")
