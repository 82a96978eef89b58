"""A run's output directory: one that holds a run is refused unless the run continues it (``--resume``) or starts
over (``--overwrite``, the old run removed, not mixed); ``--resume DIR`` alone continues into DIR; the command a
stopped run prints continues it as printed, with the served teacher's key left out."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from opsd_rollout.cli import main
from opsd_rollout.cli.train import resume_command
from opsd_rollout.train import TrainConfig, train
from opsd_rollout.train.run_dir import check_output_dir, check_resumed_run, clear_run
from test_train import write_prompts

FLAGS = ["--student", "llama-tiny", "--teacher", "qwen2-tiny", "--prompts-per-micro-batch", "2", "--max-new-tokens",
         "6", "--eval-every", "2", "--eval-prompts", "2", "--quiet"]


def steps(directory: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (directory / "metrics.jsonl").read_text().splitlines()]


def checkpoints(directory: Path) -> list[str]:
    return sorted(p.name for p in (directory / "checkpoints").iterdir() if p.is_dir())


@pytest.mark.parametrize("marker", ["metrics.jsonl", "checkpoints", "train_config.json"])
def test_any_mark_of_a_run_makes_a_directory_refused_unless_continued_or_overwritten(tmp_path, marker):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("the user's")
    check_output_dir(run, resume=None, overwrite=False)  # no run in it yet
    (run / marker).mkdir() if marker == "checkpoints" else (run / marker).write_text("{}\n")
    with pytest.raises(ValueError) as refused:
        check_output_dir(run, resume=None, overwrite=False)
    assert str(refused.value) == (f"--output-dir {str(run)!r} holds a run ({marker}): continue it with --resume {run}, "
                                  "or start over with --overwrite (which removes that run first)")
    check_output_dir(run, resume=run, overwrite=False)
    check_output_dir(run, resume=run / "checkpoints", overwrite=False)
    check_output_dir(run, resume=None, overwrite=True)
    with pytest.raises(ValueError, match="--overwrite would remove the run --resume"):
        check_output_dir(run, resume=run, overwrite=True)
    assert clear_run(run) == [marker] and sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_over_a_finished_run_the_command_line_refuses_and_overwrite_starts_clean(tmp_path, capsys):
    """The issue's run: a finished run's directory trained into again returned 0, metrics.jsonl cut to the new
    steps and DeepSpeed's latest moved beside the old checkpoints."""
    out = tmp_path / "run"
    prompts = str(write_prompts(tmp_path / "p.jsonl"))
    assert main(["train", *FLAGS, "--prompts", prompts, "--steps", "2", "--save-every", "1", "--output-dir",
                 str(out)]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", *FLAGS, "--prompts", prompts, "--steps", "1", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds a run (metrics.jsonl, checkpoints, train_config.json)" in err
    assert (out / "metrics.jsonl").read_text() == before and checkpoints(out) == ["step1", "step2"]
    assert main(["train", *FLAGS, "--prompts", prompts, "--steps", "1", "--output-dir", str(out), "--overwrite"]) == 0
    assert steps(out) == [0, 1] and checkpoints(out) == ["step1"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step1"
    assert json.loads((out / "train_config.json").read_text())["steps"] == 1


def test_the_library_refuses_too_before_any_model_loads(tmp_path, monkeypatch):
    from opsd_rollout.train import setup

    monkeypatch.setattr(setup, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds a run .*--resume .*--overwrite"):
        train(TrainConfig.from_flat(dict(output_dir=str(out), student="llama-tiny", teacher="qwen2-tiny")))
    with pytest.raises(ValueError, match="output_dir: name the directory the run writes"):
        TrainConfig(teachers=["qwen2-tiny"])
    assert TrainConfig(teachers=["qwen2-tiny"], resume=str(out / "checkpoints")).output_dir == str(out)


def test_ctrl_c_prints_a_command_that_continues_the_run_as_printed(tmp_path, monkeypatch, capsys):
    """After Ctrl-C the tool said ``continue with --resume DIR``, which alone did not run (the other flags and
    --output-dir were needed): it now prints the whole command, and that command finishes the run; ``--resume DIR``
    with no --output-dir continues into DIR."""
    from opsd_rollout.opsd.step import OPSDStep

    calls, start = [], OPSDStep.start

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return start(*args, **kwargs)

    monkeypatch.setattr(OPSDStep, "start", interrupted)
    out = tmp_path / "run"
    argv = ["train", *FLAGS, "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--steps", "3", "--output-dir",
            str(out), "--overwrite"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == f"opsd-rollout: Ctrl-C: stopped at step 2; checkpoint {out / 'checkpoints' / 'step2'}; continue with:"
    command = shlex.split(err[-1])
    assert command[0] == "opsd-rollout" and "--overwrite" not in command and command[-2:] == ["--resume", str(out)]
    monkeypatch.setattr(OPSDStep, "start", start)
    assert main(command[1:]) == 0 and steps(out) == [0, 1, 2, 3]
    alone = [arg for arg in argv if arg not in ("--overwrite", "--output-dir", str(out))]
    assert main([*alone, "--steps", "4", "--resume", str(out)]) == 0 and steps(out) == [0, 1, 2, 3, 4]


def test_the_resume_command_leaves_the_key_and_overwrite_out():
    """The key is never printed: it was, in clear, in the command a stopped run printed."""
    argv = ["train", "--teacher-url", "http://h:1", "--teacher-api-key", "s3cret", "--overwrite", "--output-dir", "o",
            "--teacher-api-key=s3cret", "--resume", "old", "--steps", "4"]
    assert resume_command(argv, "o") == ("opsd-rollout train --teacher-url http://h:1 --output-dir o --steps 4 "
                                         "--resume o")


def test_a_resume_without_the_flags_that_started_the_run_is_refused_before_any_model_loads(tmp_path, monkeypatch,
                                                                                            capsys):
    """``train --resume DIR`` alone, over a run of the user's flags, was the built-in run: its teacher trained for
    minutes, then its student resumed from the other run's checkpoint. The saved ``train_config.json`` says what
    the run was; flags that describe another are refused in one line, by the command line and the library alike."""
    from opsd_rollout.train import default, setup

    monkeypatch.setattr(setup, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(default, "trained_teacher", lambda *a, **k: pytest.fail("trained the built-in teacher"))
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "run"
    (out / "checkpoints" / "step1").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step1")
    (out / "train_config.json").write_text(json.dumps(TrainConfig.from_flat(dict(
        output_dir=str(out), student="llama-tiny", teacher="qwen2-tiny", prompts="p.jsonl")).to_dict()))
    assert main(["train", "--resume", str(out), "--steps", "4"]) == 2
    assert capsys.readouterr().err == (f"opsd-rollout: error: --resume {str(out)!r} continues another run than these "
                                       "flags describe (--prompts 'p.jsonl' there, none here): give the flags that "
                                       "started it, as the command a stopped run prints does\n")
    assert main(["train", "--student", "llama-tiny", "--teacher", "qwen2-tiny", "--resume", str(out)]) == 2
    assert "(--prompts 'p.jsonl' there, none here)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--student 'llama-tiny' there, 'qwen2-tiny' here; --prompts 'p.jsonl' there, "
                                         "none here"):
        train(TrainConfig.from_flat(dict(student="qwen2-tiny", teacher="qwen2-tiny", resume=str(out))))
    check_resumed_run(out, dict(student="llama-tiny", prompts=str(prompts), task=None, objective="opsd"))  # one file
    check_resumed_run(tmp_path / "elsewhere", dict(student="gpt2-tiny"))  # no saved config: nothing to compare
