"""The built-in run's cached teacher on a shared machine: trained privately and moved into the cache whole, one run
at a time per recipe (another waits, then reuses it), and resumed from its checkpoint after a Ctrl-C or a kill. The
training itself is stood in for: these are properties of the cache, not of the loop (test_train.py has those)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from opsd_rollout.train import default


def fake_train(calls: list, *, stop_at: int | None = None):
    """A ``train`` that writes what a run writes (metrics, checkpoints, model/) and records its config."""

    def train(config):
        out = Path(config.output_dir)
        calls.append(config)
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        start = int(config.resume and (out / "checkpoints" / "latest").read_text()[4:] or 0)
        end = stop_at if stop_at is not None else config.steps
        with open(out / "metrics.jsonl", "a") as metrics:
            metrics.writelines(f'{{"step": {step}}}\n' for step in range(start + 1, end + 1))
        (out / "checkpoints" / "latest").write_text(f"step{end}")
        if stop_at is not None:
            return SimpleNamespace(interrupted=True, model_dir=None, steps=end, checkpoint=out / "checkpoints" / f"step{end}")
        (out / "model").mkdir()
        (out / "model" / "config.json").write_text("{}")
        return SimpleNamespace(interrupted=False, model_dir=out / "model", steps=end)

    return train


def test_the_teacher_is_trained_aside_and_moved_into_the_cache_whole(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(default, "train", fake_train(calls))
    model = default.trained_teacher(str(tmp_path))
    directory = default.teacher_dir(str(tmp_path))
    assert model == directory / "model" and (model / "config.json").is_file()
    assert calls[0].output_dir == str(directory) + ".partial" and calls[0].resume is None
    assert not Path(str(directory) + ".partial").exists()  # moved, not copied
    assert default.trained_teacher(str(tmp_path)) == model and len(calls) == 1  # reused
    assert capsys.readouterr().out.endswith(f"teacher: reusing {model}\n")


def test_a_stopped_teacher_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(default, "train", fake_train(calls, stop_at=300))
    with pytest.raises(KeyboardInterrupt, match="stopped at step 300 of 800, checkpoint .*step300; the same command "
                                                "continues it"):
        default.trained_teacher(str(tmp_path))
    monkeypatch.setattr(default, "train", fake_train(calls))
    model = default.trained_teacher(str(tmp_path))
    assert calls[1].resume == calls[1].output_dir == calls[0].output_dir  # the same private directory, resumed
    steps = [int(line[9:-1]) for line in (model.parent / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 801))  # every step once


def test_a_second_run_waits_for_the_first_and_reuses_its_teacher(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(default, "train", fake_train(calls))
    directory = default.teacher_dir(str(tmp_path))
    got: list = []
    with default.teacher_lock(directory):  # another run is training
        waiting = threading.Thread(target=lambda: got.append(default.trained_teacher(str(tmp_path))))
        waiting.start()
        said, deadline = "", time.monotonic() + 120
        while "another run is training it" not in said and time.monotonic() < deadline:
            said += capsys.readouterr().out
            time.sleep(0.05)
        assert "another run is training it" in said and waiting.is_alive()  # it waits; it does not train beside
        (directory / "model").mkdir(parents=True)
        (directory / "model" / "config.json").write_text("{}")  # what the first run leaves
    waiting.join(timeout=120)
    assert got == [directory / "model"] and calls == []


def test_ctrl_c_in_the_teacher_phase_says_what_was_saved(tmp_path, monkeypatch, capsys):
    from opsd_rollout.cli import main

    monkeypatch.setattr(default, "train", fake_train([], stop_at=5))
    assert main(["train", "--output-dir", str(tmp_path / "student"), "--cache-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted; the teacher's training stopped at step 5 of 800" in err and "nothing trained" not in err


def test_the_cached_teachers_name_ignores_where_and_how_a_run_is_kept(tmp_path):
    """Fields that say where a run goes and how it is kept make no other teacher: a teacher cached before they
    existed keeps its name. The run's dtype makes another one, unless fp32 (what every cached teacher is)."""
    from dataclasses import replace

    name = default.teacher_dir(str(tmp_path)).name
    kept = replace(default.TEACHER, output_dir="elsewhere", overwrite=True, save_every=7, device="cpu", dtype="fp32")
    assert default.teacher_dir(str(tmp_path), kept).name == name
    assert default.teacher_dir(str(tmp_path), replace(default.TEACHER, dtype="bf16")).name != name
