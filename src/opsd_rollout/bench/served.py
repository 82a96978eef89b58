"""A served teacher for the step benchmark: ``opsd-rollout serve-teacher`` started on loopback in a process of its
own, as a user runs it (the bench does not import the server: ``bench`` and ``serve`` stand side by side), on the
cores the run kept for it (``--split-cores``) or on the run's own, and stopped with the run."""

from __future__ import annotations

import collections
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from opsd_rollout.distributed import environment_without_ranks

READY = "serving teacher"
"""What ``serve-teacher`` prints once it listens, with its URL after `` at ``."""


class TeacherProcess:
    """``serve-teacher --model <model> --port 0`` and the URL it printed; ``stop()`` ends it. Its output is read
    all along (a full pipe would stall it), the last lines kept for the error when it fails to start."""

    def __init__(self, model: str, *, dtype: str, device: str, seed: int | None, compact: bool, max_logprobs: int,
                 cores: Sequence[int] = (), start_timeout_s: float = 300.0):
        command = [sys.executable, "-m", "opsd_rollout", "serve-teacher", "--model", model, "--port", "0",
                   "--dtype", dtype, "--device", device, "--max-logprobs", str(max_logprobs),
                   *(["--seed", str(seed)] if seed is not None else []), *([] if compact else ["--no-compact-answers"])]
        env = environment_without_ranks()
        if cores:  # as many threads as the cores it has
            env["OMP_NUM_THREADS"] = str(len(cores))
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if cores:  # before it imports torch (seconds): every thread it starts inherits the cores
            os.sched_setaffinity(self.process.pid, set(cores))
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        ready: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(ready,), daemon=True, name="serve-teacher-output").start()
        self.url = self._wait(ready, start_timeout_s, " ".join(command[2:]))

    def _read(self, ready: queue.Queue[str]) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if READY in line:
                ready.put(line.split(" at ", 1)[1].split()[0])

    def _wait(self, ready: queue.Queue[str], timeout_s: float, what: str) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return ready.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
        self.stop()
        raise RuntimeError(f"`{what}` did not start within {timeout_s:.0f} s (exit {self.process.returncode}):\n"
                           + "".join(self.lines))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
