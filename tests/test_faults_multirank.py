"""What stops a training run on 2 CPU ranks (gloo, loopback), under torchrun and DeepSpeed's launcher: a stop signal
at the launcher or at one rank, a served teacher (``serve-teacher`` in its own process) killed mid-run, a rank
killed mid-step or mid-checkpoint, a NaN on one rank, a full disk on one rank. Each stops every rank alike, keeps a
whole checkpoint, prints what happened once, and ``--resume`` continues exactly. Faults are planted in the ranks by
a ``sitecustomize`` on their path (``FAULT``, ``FAULT_RANK``, ``FAULT_CALL``). Slow tier: each a few 2-rank runs."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import HOLD_HOOK, clean_env, held, holding, hook_path, release, run_named
from opsd_rollout.distributed import free_port

pytestmark = pytest.mark.slow

TRAIN = ["--student", "llama-tiny", "--prompts-per-micro-batch", "2", "--max-new-tokens", "6", "--eval-prompts",
         "2", "--eval-every", "100", "--quiet"]
HOOK = textwrap.dedent('''
    import os, signal, time
    FAULT, CALL = os.environ.get("FAULT"), int(os.environ.get("FAULT_CALL", "0"))
    if FAULT and os.environ.get("RANK") == os.environ.get("FAULT_RANK"):
        def planted(owner, name, act):
            original, calls = getattr(owner, name), []
            def counted(*args, **kwargs):
                calls.append(1)
                if len(calls) == CALL:
                    return act(original, *args, **kwargs)
                return original(*args, **kwargs)
            setattr(owner, name, counted)

        def killed(*_args, **_kwargs):  # the moment it dies, for the survivor's time to stop
            with open(os.environ["FAULT_MARK"], "w") as mark:
                mark.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        def hung(*_args, **_kwargs):  # alive and silent: no connection closes, only the timeout tells
            with open(os.environ["FAULT_MARK"], "w") as mark:
                mark.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

        def full_disk(_original, _engine, _state, path):
            raise OSError(28, "No space left on device", path)

        def teacher_gone(*_args, **_kwargs):
            raise ConnectionError("planted: the teacher server did not answer this rank")

        def nan_cache(original, *args, **kwargs):
            cache = original(*args, **kwargs)
            cache.values.fill_(float("nan"))
            return cache

        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        import opsd_rollout.opsd.in_flight as in_flight
        import opsd_rollout.opsd.step as step
        if FAULT == "kill-in-step":
            planted(in_flight.StepInFlight, "finish", killed)
        elif FAULT == "hang-in-step":
            planted(in_flight.StepInFlight, "finish", hung)
        elif FAULT == "kill-in-save":
            planted(TorchCheckpointEngine, "save", killed)
        elif FAULT == "full-disk":
            planted(TorchCheckpointEngine, "save", full_disk)
        elif FAULT == "nan-cache":
            planted(step, "build_teacher_cache", nan_cache)
        elif FAULT == "teacher-gone":
            from opsd_rollout.opsd.served import ServedTeacher
            planted(ServedTeacher, "build_cache", teacher_gone)
''')


def records(directory: Path) -> list[dict]:
    path = directory / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def latest(directory: Path) -> str:
    return (directory / "checkpoints" / "latest").read_text()


def environment(tmp_path: Path, **fault: str) -> dict[str, str]:
    """The ranks' environment: CPU, one thread each, and the fault planted (``FAULT=...`` and its rank and call) or
    the hold (``conftest.holding``)."""
    env = {**clean_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": hook_path(tmp_path, HOLD_HOOK, HOOK), "FAULT_MARK": str(tmp_path / "died")}
    return {**env, **{name.upper(): value for name, value in fault.items()}}


def launched(launcher: str, args: list[str]) -> list[str]:
    """``opsd-rollout ARGS`` on 2 ranks under ``launcher``."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), "-m", "opsd_rollout", *args]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2", "--master_port",
            str(free_port()), "--module", "opsd_rollout", *args]


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def finish(run: subprocess.Popen, what: str, timeout_s: float = 900) -> tuple[int, str]:
    """The launcher's exit status and everything printed, once every process of its session is gone."""
    try:
        out, err = run.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        pytest.fail(f"{what} did not finish within {timeout_s:.0f} s", pytrace=False)
    return run.returncode, out + err


def rank_process(launcher: psutil.Process, rank: str) -> psutil.Process:
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == rank and "opsd_rollout" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under the launcher")


def node_launcher(runner: psutil.Process) -> psutil.Process:
    """DeepSpeed's per-node launcher (``deepspeed.launcher.launch``), which starts the ranks and passes a signal on
    to them (its runner, on one node, does not)."""
    return next(child for child in runner.children(recursive=True)
                if "deepspeed.launcher.launch" in " ".join(child.cmdline()))


@pytest.mark.parametrize("launcher,target,signum,zero_stage", [
    ("torchrun", "launcher", signal.SIGTERM, 0),
    ("torchrun", "rank 1", signal.SIGUSR1, 3),
    ("deepspeed", "launcher", signal.SIGTERM, 2),
    ("deepspeed", "rank 1", signal.SIGTERM, 0),
])
def test_a_stop_signal_stops_every_rank_with_one_checkpoint(tmp_path, launcher, target, signum, zero_stage):
    """Signalled after step 2: every rank stops at the same micro-batch, the checkpoint of the last completed step
    is written by both and published, rank 0 prints the stop and the command that continues it once, each rank
    exits with 128 + the signal's number, and the launcher exits non-zero. Under torchrun that command finishes
    the run, each step recorded once."""
    out = tmp_path / "run"
    args = ["train", *TRAIN, "--teacher", "qwen2-tiny", "--steps", "8", "--zero-stage", str(zero_stage),
            "--output-dir", str(out)]
    run = start(launched(launcher, args), environment(tmp_path, **holding(tmp_path, 3, until_signal=True)))
    held(run, tmp_path)  # in step 3 until the signal's handler runs: the run cannot finish before it comes
    process = psutil.Process(run.pid)
    (node_launcher(process) if launcher == "deepspeed" and target == "launcher" else
     process if target == "launcher" else rank_process(process, "1")).send_signal(signum)
    status, printed = finish(run, f"{launcher} after {signal.Signals(signum).name}")
    name = signal.Signals(signum).name
    assert status != 0 and printed.count(f"{name}: stopped at step") == 1, printed[-4000:]
    step = records(out)[-1]["step"]
    assert f"{name}: stopped at step {step}; checkpoint {out / 'checkpoints' / f'step{step}'}" in printed
    assert [r["step"] for r in records(out)] == list(range(step + 1)) and step >= 2 and latest(out) == f"step{step}"
    if zero_stage:  # every rank's part, written whole before it was published
        assert sorted(p.name for p in (out / "checkpoints" / f"step{step}").glob("*optim_states.pt")) == [
            f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)]
    assert not (out / "model").exists() and not list((out / "checkpoints").glob("*.partial"))
    if (launcher, target) == ("torchrun", "rank 1"):
        assert f"exitcode  : {128 + signum}" in printed  # torchrun's report of a rank's exit status
    line = printed[printed.index("continue with (under the same launcher):"):].splitlines()[1]
    resume = shlex.split(line)
    assert resume[0] == "opsd-rollout" and resume[-2:] == ["--resume", str(out)]
    assert not any(arg.startswith("--local_rank") for arg in resume)
    if (launcher, target) == ("torchrun", "launcher"):
        done = run_named("the resumed run on 2 ranks", launched("torchrun", resume[1:]),
                         env=environment(tmp_path), timeout=1500)
        assert done.returncode == 0, done.stderr[-4000:]
        assert [r["step"] for r in records(out)] == list(range(9)) and (out / "model" / "config.json").is_file()


def start_server(port: int) -> tuple[subprocess.Popen, str]:
    from test_train_served import start_server as served

    return served(port)


def test_a_teacher_killed_under_two_ranks_stops_both_and_resume_finishes_the_run(tmp_path):
    """serve-teacher killed (SIGKILL) mid-run: each rank's request fails within --teacher-timeout, the ranks agree
    before any loss, both save the last completed step and exit 3 (printed once, naming the rank and the
    server); serve-teacher back on its port, the printed command finishes the run and metrics.jsonl holds every
    step once."""
    port, out = free_port(), tmp_path / "run"
    server, url = start_server(port)
    try:
        args = ["train", *TRAIN, "--teacher-url", url, "--teacher-timeout", "5", "--steps", "8", "--output-dir",
                str(out)]
        run = start(launched("torchrun", args), environment(tmp_path, **holding(tmp_path, 3)))
        held(run, tmp_path)  # in step 3 until the server is gone
        server.kill()
        server.wait(60)
        killed = time.monotonic()
        release(tmp_path)
        status, printed = finish(run, "torchrun after the teacher's kill")
        stopped_s = time.monotonic() - killed
        assert status != 0 and printed.count("stopped after step") == 1, printed[-4000:]
        assert "did not answer POST /v1/completions" in printed and "exitcode  : 3" in printed
        step = records(out)[-1]["step"]
        assert [r["step"] for r in records(out)] == list(range(step + 1)) and latest(out) == f"step{step}"
        print(f"both ranks stopped {stopped_s:.1f} s after the teacher's kill (--teacher-timeout 5)")
        resume = shlex.split(printed[printed.index("continue with (under the same launcher):"):].splitlines()[1])
        server, _ = start_server(port)
        done = run_named("the resumed run on 2 ranks", launched("torchrun", resume[1:]), env=environment(tmp_path),
                         timeout=1500)
        assert done.returncode == 0, done.stderr[-4000:]
        assert [r["step"] for r in records(out)] == list(range(9)) and (out / "model" / "config.json").is_file()
    finally:
        server.kill()


def test_a_teacher_that_fails_on_one_rank_alone_stops_both(tmp_path):
    """Rank 1's teacher request fails at step 3 (its 4th: the first was step 0's evaluation) while rank 0's is
    answered: the agreement before the loss stops both (exit 3, the line naming rank 1), with step 2's checkpoint;
    no rank waits for the other."""
    port, out = free_port(), tmp_path / "run"
    server, url = start_server(port)
    try:
        args = ["train", *TRAIN, "--teacher-url", url, "--steps", "4", "--output-dir", str(out)]
        done = run_named("a run on 2 ranks whose teacher fails on one", launched("torchrun", args),
                         env=environment(tmp_path, fault="teacher-gone", fault_rank="1", fault_call="4"),
                         timeout=1500)
    finally:
        server.kill()
    printed = done.stdout + done.stderr
    assert done.returncode != 0 and printed.count("stopped after step 2: rank 1: planted: the teacher server did "
                                                  "not answer this rank") == 1, printed[-4000:]
    assert "exitcode  : 3" in printed and latest(out) == "step2"
    assert [r["step"] for r in records(out)] == [0, 1, 2]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The records of an uninterrupted 2-rank run, what the killed and resumed runs must reproduce."""
    tmp = tmp_path_factory.mktemp("whole")
    out = tmp / "run"
    done = run_named("an uninterrupted run on 2 ranks", launched("torchrun", [
        "train", *TRAIN, "--teacher", "qwen2-tiny", "--steps", "6", "--zero-stage", "2", "--temperature", "1.0",
        "--output-dir", str(out)]), env=environment(tmp), timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return records(out)


@pytest.mark.parametrize("fault", ["kill-in-step", "kill-in-save"])
def test_a_killed_rank_stops_the_other_and_resume_continues_exactly(tmp_path, uninterrupted, fault):
    """Rank 1 SIGKILLed in step 5 (before its 5th micro-batch's loss) or while step 4's checkpoint is written: rank 0
    fails at its next collective (gloo: at once, the dead rank's connection is closed), torchrun exits non-zero,
    ``latest`` names a whole checkpoint (step 4, or step 2 when step 4's was cut short: its files stay under
    step4.partial), and --resume from it gives the uninterrupted run's losses."""
    out = tmp_path / "run"
    args = ["train", *TRAIN, "--teacher", "qwen2-tiny", "--steps", "6", "--zero-stage", "2", "--temperature", "1.0",
            "--save-every", "2", "--output-dir", str(out)]
    env = environment(tmp_path, fault=fault, fault_rank="1", fault_call="5" if fault == "kill-in-step" else "2")
    run = start(launched("torchrun", args), env)
    status, printed = finish(run, "torchrun after a rank's kill")
    survived_s = time.time() - float((tmp_path / "died").read_text())
    assert status != 0, printed[-4000:]
    kept = "step4" if fault == "kill-in-step" else "step2"
    assert latest(out) == kept and (out / "checkpoints" / kept / "mp_rank_00_model_states.pt").is_file()
    assert (out / "checkpoints" / "step4.partial").is_dir() == (fault == "kill-in-save")
    print(f"{fault}: the launcher exited {survived_s:.1f} s after rank 1 died")
    done = run_named("the resumed run on 2 ranks", launched("torchrun", [*args, "--resume", str(out)]),
                     env=environment(tmp_path), timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = records(out)
    assert [r["step"] for r in resumed] == list(range(7))
    assert [r["loss"] for r in resumed[1:]] == [r["loss"] for r in uninterrupted[1:]]


def test_a_hung_rank_is_waited_for_the_collective_timeout_not_forever(tmp_path):
    """Rank 1 stops (SIGSTOP) in step 5, its connections open: rank 0 waits at the micro-batch's agreement for
    --collective-timeout (60 s; the default is 600) and fails, and torchrun, which then kills rank 1, exits
    non-zero, step 4's checkpoint the latest. The bound given to finish: the timeout, torchrun's 30 s before it
    kills, and the busy machine's slack, well under the default timeout."""
    out = tmp_path / "run"
    args = ["train", *TRAIN, "--teacher", "qwen2-tiny", "--steps", "6", "--save-every", "2",
            "--collective-timeout", "60", "--output-dir", str(out)]
    run = start(launched("torchrun", args), environment(tmp_path, fault="hang-in-step", fault_rank="1",
                                                        fault_call="5"))
    mark, deadline = tmp_path / "died", time.monotonic() + 900
    while not mark.is_file() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mark.is_file(), finish(run, "torchrun before the hang", timeout_s=60)[1][-4000:]
    status, printed = finish(run, "torchrun after a rank's hang", timeout_s=400)
    waited_s = time.time() - float(mark.read_text())
    assert status != 0 and latest(out) == "step4", printed[-4000:]
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]
    print(f"the launcher exited {waited_s:.1f} s after rank 1 hung (--collective-timeout 60)")


def test_a_nan_on_one_rank_skips_the_step_on_both(tmp_path):
    """Rank 1's teacher cache is NaN at step 3: the loss, averaged over both ranks, is NaN on both, so both skip the
    optimizer step (ZeRO-2: DeepSpeed's check), the record names the teacher cache (rank 1's, agreed), and the two
    ranks' weights stay one model (the run goes on in lockstep and ends with one model)."""
    out = tmp_path / "run"
    args = ["train", *TRAIN, "--teacher", "qwen2-tiny", "--steps", "4", "--zero-stage", "2", "--output-dir",
            str(out)]
    done = run_named("a run on 2 ranks with a NaN", launched("torchrun", args),
                     env=environment(tmp_path, fault="nan-cache", fault_rank="1", fault_call="3"), timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = records(out)[1:]
    assert [r["skipped_steps"] for r in steps] == [0, 0, 1, 1]
    assert [r.get("nonfinite") for r in steps] == [None, None, "teacher cache", None]
    assert steps[2]["loss"] is None and steps[3]["loss"] > 0


def test_a_full_disk_on_one_rank_stops_both_and_keeps_the_checkpoint_before(tmp_path):
    """Rank 1 cannot write its part of step 4's checkpoint (ENOSPC): both ranks stop (exit 4) with one line naming
    rank 1's file and the error, and step 2's checkpoint stays the latest."""
    out = tmp_path / "run"
    args = ["train", *TRAIN, "--teacher", "qwen2-tiny", "--steps", "6", "--zero-stage", "2", "--save-every", "2",
            "--output-dir", str(out)]
    done = run_named("a run on 2 ranks with a full disk", launched("torchrun", args),
                     env=environment(tmp_path, fault="full-disk", fault_rank="1", fault_call="2"), timeout=1500)
    printed = done.stdout + done.stderr
    assert done.returncode != 0 and "exitcode  : 4" in printed, printed[-4000:]
    assert printed.count("checkpoint step4 not written: rank 1: ") == 1
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: No space left on device" in printed
    assert latest(out) == "step2" and not list((out / "checkpoints").glob("*.partial"))
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]
