"""What stops a training run before its last step, how every rank comes to stop at the same place, and the exit
status each leaves: a signal (SIGTERM, SIGUSR1, Ctrl-C's SIGINT), a served teacher that failed on some rank, a
checkpoint some rank could not write, too many non-finite steps in a row. Each stops with a checkpoint of the last
completed optimizer step (a failed checkpoint: the one before it stays the latest).

Light at import (no torch): the command line maps a result to its exit status with it."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

EXIT_TEACHER = 3
"""A served teacher did not answer (for ``--teacher-timeout``) or answered what was refused, on some rank."""
EXIT_CHECKPOINT = 4
"""A checkpoint could not be written on some rank (a full disk, a write error); the previous one is the latest."""
EXIT_SKIPPED = 5
"""``--max-skipped-steps`` optimizer steps in a row were skipped (a non-finite loss or gradient)."""
SIGNAL_BASE = 128
"""A run stopped by signal N exits with 128 + N, the shell's convention for "terminated by N": 130 for Ctrl-C,
138 for SIGUSR1, 143 for SIGTERM (a scheduler reads it as the signal's doing, not a failure of the program)."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
"""Signals that stop a run at the next micro-batch with a checkpoint: Ctrl-C, a scheduler's preemption (SLURM,
Kubernetes) and SLURM's warning before a time limit (``--signal=USR1@SECONDS``)."""
AGAIN_AFTER_S = 1.0
"""A second SIGINT this long after the first stops at once (a person pressing Ctrl-C again); one sooner is the
same Ctrl-C forwarded by a launcher (torchrun passes on the terminal's SIGINT to ranks that got it already)."""
FAULTS = {"teacher": EXIT_TEACHER, "checkpoint": EXIT_CHECKPOINT, "skipped": EXIT_SKIPPED}
"""``TrainResult.fault`` -> the exit status."""


class StopRequested(Exception):
    """A stop signal was received on some rank: every rank leaves the micro-batch at the same boundary."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class TeacherFailed(ConnectionError):
    """A served teacher's answer did not arrive (or was refused at the wire) on some rank: every rank stops before
    the loss, with the checkpoint of the last completed step."""


class CheckpointNotWritten(OSError):
    """A checkpoint some rank could not write (a full disk, a write error), raised on every rank alike; the one
    before it is still ``latest``."""


class TooManySkipped(Exception):
    """``max_skipped_steps`` optimizer steps in a row were skipped: the run stops with the checkpoint of its weights,
    the last good step's."""


def exit_status(result: Any) -> int:
    """A ``TrainResult``'s exit status: 0 for a finished run; a checkpoint not written first (the run did not keep
    what it was stopping for), then 128 + N when signal N stopped it, else its fault's."""
    if result.interrupted and result.fault != "checkpoint":
        return SIGNAL_BASE + (result.signal or signal.SIGINT)
    return FAULTS[result.fault] if result.fault is not None else 0


def stopped_by(error: BaseException, result: Any) -> bool:
    """Whether ``error`` ends a run with the checkpoint of its last completed step, and why, set on ``result``: a stop
    signal or Ctrl-C (``interrupted``, ``signal``), a served teacher that failed (``fault`` ``teacher``), a checkpoint
    not written (``checkpoint``: the one before it is kept), too many steps skipped (``skipped``); ``stopped`` says
    the fault in a line."""
    if isinstance(error, (StopRequested, KeyboardInterrupt)):
        result.interrupted, result.signal = True, getattr(error, "signum", signal.SIGINT)
        return True
    fault = next((name for kind, name in ((CheckpointNotWritten, "checkpoint"), (ConnectionError, "teacher"),
                                          (TooManySkipped, "skipped")) if isinstance(error, kind)), None)
    if fault is not None:  # a checkpoint that failed while stopping for another fault: both said
        result.fault, result.stopped = fault, str(error) if result.stopped is None else f"{result.stopped}; {error}"
    return fault is not None


def signal_name(signum: int | None) -> str:
    return "Ctrl-C" if signum in (None, signal.SIGINT) else signal.Signals(signum).name


class StopSignals:
    """``STOP_SIGNALS`` as a flag, as torchtitan's and Megatron-LM's handlers do: the handler does no work (a
    checkpoint being written is never cut short), ``received`` holds the first signal's number (0 before any), and
    the loop reads it at each micro-batch's boundary, where every rank agrees to stop together. A second Ctrl-C
    (``AGAIN_AFTER_S`` after the first) raises ``KeyboardInterrupt`` at once. ``with`` installs the handlers and puts
    the previous ones back; off the main thread (Python takes handlers there only) it installs none."""

    def __init__(self) -> None:
        self.received = 0
        self.at = 0.0
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT and time.monotonic() - self.at > AGAIN_AFTER_S:
            raise KeyboardInterrupt("Ctrl-C twice: stopped at once")
        if not self.received:
            self.received, self.at = signum, time.monotonic()
            if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0":  # a person waits for an answer
                os.write(2, b"\nopsd-rollout: stopping at the next micro-batch, with a checkpoint of the last "
                            b"completed step (Ctrl-C again to stop at once)\n")


class Agreement:
    """What every rank must decide alike before a micro-batch goes on, decided in one small all-reduce of host
    integers (``distributed.agree_max`` on a gloo group: no device sync): whether a stop signal came to any rank,
    and whether every rank's teachers answered. ``check`` runs once a micro-batch, between the teachers' answers
    and the loss (``StepInFlight.finish(agree=...)``; before an SFT micro-batch); with one rank it reads the flag
    and nothing is exchanged. The failure path alone exchanges more: the failing rank's message."""

    def __init__(self, signals: StopSignals, rank: int, world_size: int, group: Any = None):
        self.signals, self.rank, self.world_size, self.group = signals, rank, world_size, group
        self.checks = 0
        """Agreements made so far (one a micro-batch)."""

    def values(self, local: list[int]) -> list[int]:
        """Every rank's largest of each of ``local``."""
        from opsd_rollout.distributed import agree_max

        return agree_max(local, group=self.group)

    def first_text(self, text: str | None) -> str | None:
        """The lowest rank's non-empty ``text`` (on every rank), named by its rank when there are several; call it
        on every rank, on a path they all take (a failure already agreed)."""
        if self.world_size == 1:
            return text
        from opsd_rollout.distributed import gather_objects

        given = [(rank, each) for rank, each in enumerate(gather_objects(text, group=self.group)) if each]
        return f"rank {given[0][0]}: {given[0][1]}" if given else None

    def check(self, failure: BaseException | None = None) -> None:
        """Raise alike on every rank: ``TeacherFailed`` when a teacher failed on any rank (``failure``: this rank's),
        else ``StopRequested`` when a stop signal came to any."""
        self.checks += 1
        signum, failed = self.values([self.signals.received, int(failure is not None)])
        if failed:
            raise TeacherFailed(self.first_text(None if failure is None else str(failure))) from failure
        if signum:
            raise StopRequested(signum)
