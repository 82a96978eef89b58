"""``scripts/gpu_check.py`` runs on a lent GPU in one call with minutes of device time, so it must be right
before it gets there. The rehearsal (``--cpu``) runs every check's own code with CPU stand-ins for the calls that
exist on CUDA alone; these tests prove the stand-ins catch what the GPU calls would, and that a check reaching
for a name that no longer exists fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import clean_env, run_named

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ctx(gpu_check):
    """The rehearsal's context, inside its stand-ins for the whole run (the compiled step on ``aot_eager``)."""
    gpu = gpu_check.CpuStandIns()
    with gpu.running():
        yield gpu_check.Context("llama-tiny", "fp32", torch.device("cpu"), gpu)


def test_the_host_sync_stand_in_raises_where_cuda_would_wait(gpu_check):
    t = torch.arange(4)
    with gpu_check.HostSyncDetector():
        assert torch.equal(torch.where(t > 1, t, 0) + 1, torch.tensor([1, 1, 3, 4]))  # device work: no wait
        for wait in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: t.tolist(), lambda: t[t > 1],
                     lambda: torch.nonzero(t), lambda: torch.where(t > 1)):
            with pytest.raises(RuntimeError, match="host synchronization"):
                wait()


def test_a_number_written_through_an_integer_index_is_a_wait_in_the_stand_in(gpu_check):
    """On CUDA ``x[ints] = 5`` copies the number from pageable host memory (a wait): the first GPU run found one
    in the decode loop that the stand-in had let pass. A lone mask, ``index_fill_`` and a slice take the number
    as it is (as the H200 showed)."""
    x, ints = torch.zeros(4, 4), torch.tensor([1, 2])
    with gpu_check.HostSyncDetector():
        x[x[:, 0] > -1] = 5.0
        x.index_fill_(0, ints, 1.0)
        x[:, 0] = 2.0
        x[ints] = torch.ones(())
        for wait in (lambda: x.__setitem__(ints, 5.0), lambda: x.__setitem__((1, 2), 5.0),
                     lambda: x.__setitem__((ints, 0), 5)):
            with pytest.raises(RuntimeError, match="host synchronization: __setitem__"):
                wait()


def test_the_stand_ins_sync_rules_are_checked_against_what_cuda_does(gpu_check, ctx, monkeypatch):
    finding = gpu_check.check_sync_rules(ctx)
    assert finding.figure == f"{len(gpu_check.SYNC_FORMS)} forms as expected", finding
    forms = dict(gpu_check.SYNC_FORMS)
    expected, form = forms["x.index_fill_(0, ints, 5.0)"]
    forms["x.index_fill_(0, ints, 5.0)"] = (not expected, form)
    monkeypatch.setattr(gpu_check, "SYNC_FORMS", forms)
    with pytest.raises(AssertionError, match="index_fill_.*expected True, stand-in False"):
        gpu_check.check_sync_rules(ctx)


def test_the_decode_loop_takes_no_host_sync_eager_or_compiled(gpu_check, ctx):
    finding = gpu_check.check_no_host_sync(ctx)
    assert finding.figure == "0 syncs in 60 decode steps", finding  # 4 rollouts of 15 decode steps, each strict


def test_a_planted_sync_in_the_decode_step_fails_the_check(gpu_check, ctx, monkeypatch):
    from opsd_rollout.rollout.decode.loop import DecodeLoop

    finished = DecodeLoop.finished

    def reading(run, token, steps):
        token.max().item()  # what a host read in the loop would look like
        return finished(run, token, steps)

    monkeypatch.setattr(DecodeLoop, "finished", reading)
    with pytest.raises(RuntimeError, match="host synchronization: item"):
        gpu_check.check_no_host_sync(ctx)


def test_a_number_written_through_an_index_in_the_decode_step_fails_the_check(gpu_check, ctx, monkeypatch):
    """What the loop did until the first GPU run: ``finish[ended] = forward``, a host copy of the number."""
    from opsd_rollout.rollout.decode.loop import SlotState

    advance = SlotState.advance

    def copying(state, active, token, finished, forward):
        state.finish[torch.full((1,), state.sink, device=token.device)] = forward
        return advance(state, active, token, finished, forward)

    monkeypatch.setattr(SlotState, "advance", copying)
    with pytest.raises(RuntimeError, match="host synchronization: __setitem__"):
        gpu_check.check_no_host_sync(ctx)


def test_a_renamed_decode_step_fails_the_check(gpu_check, ctx, monkeypatch):
    """The sync check wraps the loop's own step by name: a rename breaks the rehearsal, not the GPU run."""
    from opsd_rollout.rollout.decode.loop import DecodeLoop

    step = DecodeLoop.step
    monkeypatch.delattr(DecodeLoop, "step")
    monkeypatch.setattr(DecodeLoop, "renamed_step", step, raising=False)
    with pytest.raises(AttributeError, match="step"):
        gpu_check.check_no_host_sync(ctx)


def test_a_step_the_loop_no_longer_calls_fails_the_check(gpu_check, ctx, monkeypatch):
    """Wrapping a method the loop has stopped calling would check nothing: the check counts the calls."""
    from opsd_rollout.rollout.decode.loop import DecodeLoop

    step = DecodeLoop.step
    monkeypatch.setattr(DecodeLoop, "loop_step", step, raising=False)
    loop = DecodeLoop.run

    def loop_without_step(run):
        run.step = lambda: DecodeLoop.loop_step(run)  # the loop now takes its steps through another name
        return loop(run)

    monkeypatch.setattr(DecodeLoop, "run", loop_without_step)
    with pytest.raises(AssertionError):
        gpu_check.check_no_host_sync(ctx)


def test_the_teachers_follow_the_student_in_the_rehearsal(gpu_check, ctx):
    finding = gpu_check.check_teacher_placement(ctx)
    assert finding.figure == "4 teachers on cpu in torch.bfloat16, as the student", finding
    assert "self" in finding.detail and "DeepSpeedEngine" in finding.detail, finding


def test_a_teacher_left_where_it_loaded_fails_the_placement_check(gpu_check, ctx, monkeypatch):
    """What train did before: the teacher kept on the host in fp32, whatever the student's engine."""
    from opsd_rollout.train import precision, setup

    monkeypatch.setattr(precision, "place_teachers", lambda teacher, *_: teacher)
    monkeypatch.setattr(setup, "load_teacher", lambda spec, config, *a: setup.load_model(spec.source, seed=1)[0])
    with pytest.raises(AssertionError, match="teacher a: .*float32"):
        gpu_check.check_teacher_placement(ctx)


def test_a_profiled_training_step_waits_only_to_read_its_records(gpu_check, ctx):
    finding = gpu_check.check_profiled_step_syncs(ctx)
    assert "profiling adds 1 (profiling/clock.py:settle)" in finding.figure, finding
    assert "profiling/clock.py:settle 3" in finding.detail, finding


def test_a_phase_that_waits_for_the_device_fails_the_step_check(gpu_check, ctx, monkeypatch):
    """What the probes did before: a wait around every timed phase."""
    from opsd_rollout.profiling.probes import PhaseProbes

    opened = PhaseProbes._open

    def waiting(probes, phase):
        probes.clock.settle()
        return opened(probes, phase)

    monkeypatch.setattr(PhaseProbes, "_open", waiting)
    with pytest.raises(AssertionError, match="profiling added .*profiling/clock.py:settle"):
        gpu_check.check_profiled_step_syncs(ctx)


def test_the_sync_stand_in_counts_each_read_at_the_line_of_ours_that_made_it(gpu_check):
    from opsd_rollout.rollout.continuous_stats import continuous_stats
    from opsd_rollout.rollout.decode.stats import DecodeStats

    with gpu_check.CpuStandIns().syncs() as seen:
        torch.ones(2).sum().item()  # not the package's
        continuous_stats(DecodeStats(), torch.tensor([3, 5]), 4)  # reads the longest row once
    assert seen == {"elsewhere": 1, "rollout/continuous_stats.py:continuous_stats": 1}, seen


def test_graph_recordings_stand_in_counts_compiles(gpu_check):
    torch._dynamo.reset()
    with gpu_check.CpuStandIns().graph_recordings() as recordings:
        double = torch.compile(lambda x: x * 2, backend="eager")
        double(torch.ones(3))
        first = len(recordings)
        double(torch.ones(3))
        again = len(recordings) - first
        double(torch.ones(3, dtype=torch.int64))
    assert (first, again, len(recordings)) == (1, 0, 2)


def test_one_failing_check_prints_every_row_and_fails_the_run(gpu_check, monkeypatch, capsys):
    def broken(ctx):
        raise KeyError("gone")

    monkeypatch.setattr(gpu_check, "CHECKS", [("broken", broken), ("metadata", gpu_check.check_profile_metadata)])
    assert gpu_check.main(["--cpu", "--model", "llama-tiny"]) == 1
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [(row[0].lstrip("| "), row[1]) for row in rows] == [("broken", "FAILED"), ("metadata", "ok")]
    assert "KeyError" in rows[0][-1]


def test_skip_leaves_checks_out(gpu_check, monkeypatch, capsys):
    def broken(ctx):
        raise KeyError("gone")

    monkeypatch.setattr(gpu_check, "CHECKS", [("broken", broken), ("metadata", gpu_check.check_profile_metadata)])
    assert gpu_check.main(["--cpu", "--model", "llama-tiny", "--skip", "brok"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == ["metadata"]


def test_a_setup_that_fails_still_prints_every_row(gpu_check, capsys):
    assert gpu_check.main(["--cpu", "--model", "no-such-preset"]) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(gpu_check.CHECKS) and all("| FAILED |" in row and "setup failed" in row for row in rows)


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_check_and_skips_none(gpu_check):
    result = run_named("the GPU check's CPU rehearsal (about 90 s on 2 quiet cores)",
                       [sys.executable, str(SCRIPT), "--cpu", "--model", "llama-tiny"], env=clean_env(), timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1]
            for line in result.stdout.splitlines() if line.startswith("| ") and " | " in line[2:]}
    rows.pop("check", None)
    assert set(rows) == {name for name, _check in gpu_check.CHECKS}, result.stdout
    assert set(rows.values()) <= {"ok", "rehearsed"} and "rehearsed" in rows.values(), result.stdout
