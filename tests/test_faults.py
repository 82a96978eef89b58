"""What stops a training run, in one process (the same with several ranks: tests/test_faults_multirank.py): a stop
signal read at a micro-batch's boundary, a non-finite step skipped before it reaches the weights, a checkpoint that
cannot be written, a served teacher that answers what the wire refuses; each with the checkpoint it keeps, the line
it prints and its exit status. Tiny models, a few steps each."""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
from pathlib import Path

import pytest
import torch

from opsd_rollout.cli import main
from opsd_rollout.train import TrainConfig, train
from opsd_rollout.train import loop
from opsd_rollout.train.faults import (EXIT_CHECKPOINT, EXIT_SKIPPED, EXIT_TEACHER, Agreement, StopRequested,
                                       StopSignals, TeacherFailed, exit_status)

TINY = dict(student="llama-tiny", teacher="qwen2-tiny", prompts_per_micro_batch=2, max_new_tokens=6,
            eval_prompts=2, eval_every=100, progress=False, lr=1e-3)
ARGV = ["train", "--student", "llama-tiny", "--teacher", "qwen2-tiny", "--prompts-per-micro-batch", "2",
        "--max-new-tokens", "6", "--eval-prompts", "2", "--eval-every", "100", "--quiet"]


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def latest(directory: Path) -> str:
    return (directory / "checkpoints" / "latest").read_text()


def on_call(monkeypatch, owner, name, number, action):
    """``owner.name`` runs ``action(*args)`` before its ``number``-th call (counted from 1) and every later one when
    ``number`` is a range's start (``range(3, 99)``); the calls go on as they were."""
    calls, original = [], getattr(owner, name)
    numbers = number if isinstance(number, range) else range(number, number + 1)

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) in numbers:
            action(*args, **kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def weights_after_each_step(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """The student's parameters (by name) after each optimizer step of the next run, as they are then."""
    taken, step = [], loop._Run.train_step

    def snapped(self, number):
        record = step(self, number)
        taken.append({name: p.detach().clone() for name, p in self.engine.module.named_parameters()})
        return record

    monkeypatch.setattr(loop._Run, "train_step", snapped)
    return taken


# ---- stop signals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_stops_at_the_next_micro_batch_with_a_checkpoint_and_its_exit_status(tmp_path, monkeypatch,
                                                                                          capsys, signum):
    """The signal comes during step 3's rollout: the handler only sets a flag, the micro-batch's agreement (before
    its loss) stops the run there, step 2's checkpoint is saved, the exact --resume command printed, and the exit
    status is 128 + the signal's number; that command finishes the run, each step recorded once."""
    from opsd_rollout.opsd.step import OPSDStep

    on_call(monkeypatch, OPSDStep, "start", 3, lambda *a, **k: os.kill(os.getpid(), signum))
    out = tmp_path / "run"
    argv = [*ARGV, "--steps", "4", "--output-dir", str(out)]
    assert main(argv) == 128 + signum
    err = capsys.readouterr().err
    assert f"{signal.Signals(signum).name}: stopped at step 2; checkpoint {out / 'checkpoints' / 'step2'}" in err
    command = err.strip().splitlines()[-1].strip()
    assert command == shlex.join(["opsd-rollout", *argv, "--resume", str(out)])
    assert latest(out) == "step2" and [r["step"] for r in records(out)] == [0, 1, 2] and not (out / "model").exists()
    assert signal.getsignal(signum) is signal.SIG_DFL  # the run's handlers are gone with it
    monkeypatch.undo()
    assert main(shlex.split(command)[1:]) == 0
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4] and latest(out) == "step4"


def test_a_signal_during_a_checkpoint_never_cuts_it_short(tmp_path, monkeypatch):
    """SIGTERM while step 2's checkpoint is being written: the write finishes and is published, and the run stops
    at step 3's first micro-batch, keeping step 2 (nothing more to save)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    on_call(monkeypatch, TorchCheckpointEngine, "save", 1, lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "run"
    result = train(TrainConfig.from_flat(dict(TINY, steps=4, save_every=2, output_dir=str(out))))
    assert (result.interrupted, result.signal, result.steps) == (True, signal.SIGTERM, 2)
    assert latest(out) == "step2" and result.checkpoint == out / "checkpoints" / "step2"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step2"]
    assert exit_status(result) == 143


def test_ctrl_c_is_a_flag_and_a_second_one_later_stops_at_once(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("opsd_rollout.train.faults.time.monotonic", lambda: clock[0])
    signals = StopSignals()
    signals.handle(signal.SIGINT, None)
    signals.handle(signal.SIGINT, None)  # at once: the same Ctrl-C, forwarded by a launcher
    assert signals.received == signal.SIGINT
    clock[0] += 2
    with pytest.raises(KeyboardInterrupt):
        signals.handle(signal.SIGINT, None)
    signals = StopSignals()
    signals.handle(signal.SIGTERM, None)
    signals.handle(signal.SIGINT, None)  # the first signal's number is kept, and nothing raises
    assert signals.received == signal.SIGTERM


def test_one_ranks_agreement_raises_what_every_rank_would():
    signals = StopSignals()
    agreement = Agreement(signals, rank=0, world_size=1)
    agreement.check(None)
    with pytest.raises(TeacherFailed, match="gone"):
        agreement.check(ConnectionError("gone"))
    signals.received = signal.SIGUSR1
    with pytest.raises(StopRequested) as stop:
        agreement.check(None)
    assert stop.value.signum == signal.SIGUSR1 and agreement.checks == 3


def test_each_fault_has_its_exit_status():
    result = loop.TrainResult(output_dir=Path("."), steps=1)
    assert exit_status(result) == 0
    for fault, status in (("teacher", EXIT_TEACHER), ("checkpoint", EXIT_CHECKPOINT), ("skipped", EXIT_SKIPPED)):
        result.fault = fault
        assert exit_status(result) == status
    result.fault, result.interrupted, result.signal = None, True, signal.SIGTERM
    assert exit_status(result) == 143
    result.fault = "checkpoint"  # stopping for the signal, its checkpoint failed: the run kept less than it says
    assert exit_status(result) == EXIT_CHECKPOINT


# ---- a non-finite step ----------------------------------------------------------------------------------------------

def nan_cache(monkeypatch, calls):
    """The in-process teacher's cache is NaN from its ``calls``-th build (a range: those builds)."""
    from opsd_rollout.opsd import step as step_module

    build = step_module.build_teacher_cache
    count = []

    def poisoned(*args, **kwargs):
        cache = build(*args, **kwargs)
        count.append(1)
        if len(count) in calls:
            cache.values.fill_(float("nan"))
        return cache

    monkeypatch.setattr(step_module, "build_teacher_cache", poisoned)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_nan_teacher_cache_skips_the_step_on_the_weights_and_says_so(tmp_path, monkeypatch, zero_stage):
    """Step 3's teacher cache is NaN: its optimizer step is skipped (ZeRO-0's plain torch optimizer by the step's own
    check, ZeRO-2 by DeepSpeed's), the weights after it are step 2's bit for bit, the record says which part went
    non-finite, and step 4 trains on."""
    nan_cache(monkeypatch, range(3, 4))
    weights = weights_after_each_step(monkeypatch)
    result = train(TrainConfig.from_flat(dict(TINY, steps=4, zero_stage=zero_stage, output_dir=str(tmp_path))))
    steps = result.records[1:]
    assert [r["skipped_steps"] for r in steps] == [0, 0, 1, 1]
    assert [r.get("nonfinite") for r in steps] == [None, None, "teacher cache", None]
    assert steps[2]["loss"] is None and steps[2]["grad_norm"] is None and steps[3]["loss"] > 0
    assert all(torch.equal(weights[1][name], p) for name, p in weights[2].items())  # step 3 moved nothing
    assert not all(torch.equal(weights[2][name], p) for name, p in weights[3].items())  # step 4 did
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()  # null, which every JSON reader takes


@pytest.mark.parametrize("part", ["student forward", "gradient"])
def test_each_part_that_goes_non_finite_is_named(tmp_path, monkeypatch, part):
    """A NaN out of the student's last norm (its forward), or a NaN gradient from a finite loss (a hook on the
    embedding's gradient): the step is skipped and named by the part."""
    from opsd_rollout.opsd.step import OPSDStep

    def poison(step, *args, **kwargs):
        model = step.engine.module
        if part == "student forward":
            model.model.norm.register_forward_hook(lambda _m, _i, out: out * float("nan"))
        else:
            model.model.embed_tokens.weight.register_hook(lambda grad: grad * float("nan"))

    on_call(monkeypatch, OPSDStep, "start", 2, poison)
    result = train(TrainConfig.from_flat(dict(TINY, steps=2, output_dir=str(tmp_path))))
    assert result.records[2]["nonfinite"] == part and result.records[2]["skipped_steps"] == 1


def test_too_many_skipped_steps_in_a_row_stop_the_run_with_the_last_good_weights(tmp_path, monkeypatch, capsys):
    """From step 3 on every teacher cache is NaN: after --max-skipped-steps 2 the run stops (exit 5) with a
    checkpoint whose weights are step 2's and a line naming the part; it is resumable."""
    nan_cache(monkeypatch, range(3, 99))
    weights = weights_after_each_step(monkeypatch)
    out = tmp_path / "run"
    assert main([*ARGV, "--steps", "6", "--max-skipped-steps", "2", "--output-dir", str(out)]) == EXIT_SKIPPED
    err = capsys.readouterr().err
    assert ("stopped after step 4: 2 optimizer steps in a row skipped (--max-skipped-steps 2), the last for a "
            "non-finite teacher cache: the weights are step 2's, the last good one") in err
    assert latest(out) == "step4" and [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]
    state = torch.load(out / "checkpoints" / "step4" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["skipped_steps"] == 2 and state["train_state"]["skipped_in_a_row"] == 2
    assert all(torch.equal(state["module"][name], p) for name, p in weights[1].items())  # step 2's, saved


# ---- a checkpoint that cannot be written ----------------------------------------------------------------------------

def test_a_checkpoint_write_that_fails_stops_the_run_and_keeps_the_one_before(tmp_path, monkeypatch, capsys):
    """The disk is full when step 4's checkpoint is written (DeepSpeed's writer raises ENOSPC): the run stops with
    one line naming the file and the error (exit 4), step 2's checkpoint stays the latest and loads, nothing of
    step 4's is left, metrics.jsonl keeps every step taken; the printed command finishes the run from step 2."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    def full(_engine, _state, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    on_call(monkeypatch, TorchCheckpointEngine, "save", range(2, 99), lambda *a, **k: full(*a, **k))
    out = tmp_path / "run"
    argv = [*ARGV, "--steps", "6", "--save-every", "2", "--output-dir", str(out)]
    assert main(argv) == EXIT_CHECKPOINT
    err = capsys.readouterr().err.strip().splitlines()
    stop = next(line for line in err if "stopped after step 4" in line)
    assert f"checkpoint step4 not written: {out / 'checkpoints' / 'step4.partial'}" in stop
    assert "No space left on device" in stop and "bytes free on its filesystem" in stop
    assert err[-2] == f"checkpoint {out / 'checkpoints' / 'step2'}; once it can be written, continue with:"
    assert latest(out) == "step2" and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step2"]
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]
    monkeypatch.undo()
    assert main(shlex.split(err[-1].strip())[1:]) == 0
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4, 5, 6] and latest(out) == "step6"


def test_a_save_cut_short_is_never_latest_and_the_next_save_clears_it(tmp_path, monkeypatch):
    """A process that dies while writing (here: an exception no handler takes, out of the writer) leaves its files
    under step4.partial: latest still names step 2, which --resume loads; the run resumed clears it."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class Killed(BaseException):
        pass

    def killed(*_args, **_kwargs):
        raise Killed()

    on_call(monkeypatch, TorchCheckpointEngine, "save", 2, killed)
    out = tmp_path / "run"
    with pytest.raises(Killed):
        train(TrainConfig.from_flat(dict(TINY, steps=4, save_every=2, output_dir=str(out))))
    assert latest(out) == "step2" and (out / "checkpoints" / "step4.partial").is_dir()
    monkeypatch.undo()
    resumed = train(TrainConfig.from_flat(dict(TINY, steps=4, save_every=2, output_dir=str(out), resume=str(out))))
    assert resumed.records[-1]["step"] == 4 and latest(out) == "step4"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step2", "step4"]


# ---- a served teacher that answers what the wire refuses ------------------------------------------------------------

def test_a_served_teacher_gone_bad_mid_run_stops_it_naming_the_field(tmp_path, monkeypatch, capsys):
    """The served teacher's weights turn NaN before step 3: the server refuses to send a NaN log-probability (500,
    naming the prompt and position), the client refuses the answer, and the run stops as for a teacher gone: step
    2's checkpoint, exit 3, the line naming what was refused."""
    from opsd_rollout.models import load_model
    from opsd_rollout.opsd.step import OPSDStep
    from opsd_rollout.serve import ServeConfig, TeacherServer

    teacher, tokenizer = load_model("qwen2-tiny")
    server = TeacherServer(ServeConfig(model="qwen2-tiny", port=0), model=teacher, tokenizer=tokenizer).start()

    def poison(*_args, **_kwargs):
        with torch.no_grad():
            teacher.lm_head.weight.fill_(float("nan"))

    on_call(monkeypatch, OPSDStep, "start", 3, poison)
    out = tmp_path / "run"
    try:
        status = main(["train", "--student", "llama-tiny", "--teacher-url", server.url, "--prompts-per-micro-batch",
                       "2", "--max-new-tokens", "6", "--eval-prompts", "2", "--eval-every", "100", "--steps", "4",
                       "--quiet", "--output-dir", str(out)])
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert status == EXIT_TEACHER, err
    assert "stopped after step 2: the teacher server at" in err and "HTTP 500" in err and "logprob nan" in err
    assert latest(out) == "step2" and [r["step"] for r in records(out)] == [0, 1, 2]


# ---- the process group's timeout ------------------------------------------------------------------------------------

def test_the_process_groups_timeout_outlasts_a_served_teachers_retries_and_reaches_the_group(monkeypatch):
    """A rank waits for a served teacher up to --teacher-timeout + one request's limit (at least 30 s): the default
    collective timeout (600 s) grows past that by 60 s, a shorter one given is refused naming the flag, one given
    without a served teacher is taken as it is; whichever it is, the process group is made with it."""
    from opsd_rollout.train import setup

    local = dict(TINY, output_dir="unused")
    served = dict(local, teacher=None, teacher_url="http://127.0.0.1:9", teacher_timeout=5)
    assert TrainConfig.from_flat(local).group_timeout_s == 600
    assert TrainConfig.from_flat(served).group_timeout_s == 600  # 5 + 30 + 60 is less
    assert TrainConfig.from_flat(dict(served, teacher_timeout=900)).group_timeout_s == 900 + 900 + 60
    with pytest.raises(ValueError, match=r"--collective-timeout 60 s is shorter than .* \(35 s: .*at least 95"):
        TrainConfig.from_flat(dict(served, collective_timeout=60))
    assert TrainConfig.from_flat(dict(served, collective_timeout=95)).group_timeout_s == 95
    assert TrainConfig.from_flat(dict(local, collective_timeout=20)).group_timeout_s == 20

    class Made(Exception):
        pass

    def made(timeout_s):
        raise Made(timeout_s)

    monkeypatch.setattr("opsd_rollout.deepspeed_engine.init_distributed", made)
    with pytest.raises(Made) as group:
        setup.build_student_engine(TrainConfig.from_flat(dict(local, collective_timeout=20)), None)
    assert group.value.args == (20,)
