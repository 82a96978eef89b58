"""The recipe practitioners run, built in (issue 49): a warm start by SFT on the labelled examples before the
distillation (``--warmup-sft-steps``: both phases in one run, one record stream, ``--resume`` inside either), a
built-in task split into a small labelled set and many prompts alone (``--task-labelled``, ``--task-unlabelled``),
and what makes no sense refused in one line before any work."""

from __future__ import annotations

import json
import logging

import pytest

from opsd_rollout.cli import main
from opsd_rollout.train import TrainConfig, train
from opsd_rollout.train.tasks import TASKS, ArithmeticTask, response_tokens, task_examples

SMALL = ArithmeticTask(seed=0, digits=3, terms=2, train_size=200, held_out_size=12)
RUN = dict(task="arithmetic", student="llama-tiny", teacher="qwen2-tiny", prompts_per_micro_batch=2, eval_every=2,
           eval_prompts=2, progress=False, lr=1e-3, temperature=1.0)


@pytest.fixture
def small_task(monkeypatch):
    monkeypatch.setitem(TASKS, "arithmetic", SMALL)
    return SMALL


def config(tmp_path, name="run", **changes) -> TrainConfig:
    return TrainConfig.from_flat({**RUN, "max_new_tokens": response_tokens("arithmetic"),
                                  "output_dir": str(tmp_path / name), **changes})


def test_the_split_keeps_the_first_solutions_and_the_next_prompts(small_task):
    train_examples, held_out = task_examples("arithmetic", 5, 3)
    assert [e.reference is not None for e in train_examples] == [True] * 5 + [False] * 3
    whole, _ = task_examples("arithmetic")
    assert [e.prompt for e in train_examples] == [e.prompt for e in whole[:8]]
    assert len(task_examples("arithmetic", 5)[0]) == SMALL.train_size  # the rest, prompts alone
    assert all(e.reference is not None for e in held_out)  # scored and evaluated on their solutions


def test_a_warm_start_then_the_distillation_in_one_record(tmp_path, small_task):
    """The first steps are SFT on the labelled examples alone (their references, cross-entropy), at the warm start's
    learning rate; the rest distil on every prompt at the run's."""
    result = train(config(tmp_path, steps=4, warmup_sft_steps=2, warmup_sft_lr=5e-3, task_labelled=6))
    steps = [r for r in result.records if "loss" in r]
    assert [r["divergence"] for r in steps] == ["cross_entropy"] * 2 + ["jsd"] * 2
    assert [r["on_policy"] for r in steps] == [None, None, True, True]
    assert [r["teacher"] for r in steps] == [None, None, "qwen2-tiny", "qwen2-tiny"]
    assert [r["learning_rate"] for r in steps] == pytest.approx([5e-3, 5e-3, 1e-3, 1e-3])
    assert result.plot is not None and result.plot.exists()


def test_the_warm_start_trains_on_the_labelled_set_alone(tmp_path, small_task, monkeypatch):
    from opsd_rollout.train.data import Encoder

    encoded = []
    real = Encoder.with_references
    monkeypatch.setattr(Encoder, "with_references", lambda self, examples, *a, **k: (
        encoded.extend(examples), real(self, examples, *a, **k))[1])
    train(config(tmp_path, steps=3, warmup_sft_steps=2, task_labelled=4, eval_every=100))
    labelled = {e.prompt for e in task_examples("arithmetic", 4)[0][:4]}
    held = {e.prompt for e in task_examples("arithmetic")[1]}
    trained = {e.prompt for e in encoded} - held  # the evaluation's cross-entropy encodes the held-out ones
    assert trained and trained <= labelled


@pytest.mark.parametrize("stop", [1, 3])
def test_resume_inside_either_phase_continues_exactly(tmp_path, small_task, monkeypatch, stop):
    """A run of 2 warm-start and 2 distillation steps, stopped (Ctrl-C) after step 1 (inside the warm start) or 3
    (inside the distillation) and resumed, gives the uninterrupted run's losses step for step."""
    from opsd_rollout.train.loop import _Run

    whole = train(config(tmp_path, "whole", steps=4, warmup_sft_steps=2, task_labelled=8))
    real = _Run.train_step

    def stopping(self, number):
        if number == stop + 1:
            raise KeyboardInterrupt
        return real(self, number)

    monkeypatch.setattr(_Run, "train_step", stopping)
    assert train(config(tmp_path, "half", steps=4, warmup_sft_steps=2, task_labelled=8)).interrupted
    monkeypatch.setattr(_Run, "train_step", real)
    resumed = train(config(tmp_path, "half", steps=4, warmup_sft_steps=2, task_labelled=8,
                           resume=str(tmp_path / "half")))
    losses = [(r["step"], r["divergence"], r["loss"]) for r in whole.records if "loss" in r]
    assert [(r["step"], r["divergence"], r["loss"]) for r in resumed.records if "loss" in r] == losses


def test_a_random_student_distilled_cold_with_jsd_is_warned(tmp_path, small_task, caplog):
    """A preset (random weights) distilled by JSD or the sampled reverse KL without a warm start, in a run judged by a
    task, is warned of before any model loads; with a warm start, another loss, or no task evaluation, not."""
    from opsd_rollout.train import inputs

    scored = dict(eval_data=str(loop_eval_file(tmp_path)), eval_scorer="gsm8k")
    cases = {"cold": (dict(scored), True), "warm": (dict(scored, warmup_sft_steps=1, task_labelled=4), False),
             "forward_kl": (dict(scored, loss="forward_kl"), False), "unscored": ({}, False)}
    for name, (changes, warned) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="opsd_rollout.train.inputs"):
            inputs.warn_if_cold(config(tmp_path, name, steps=2, **changes))
        assert any("random weights" in r.getMessage() for r in caplog.records) == warned, name


def loop_eval_file(tmp_path):
    from opsd_rollout.train.tasks import write_eval_file

    return write_eval_file("arithmetic", tmp_path / "eval.jsonl")


def test_a_self_teacher_on_a_split_task_trains_on_the_labelled_set(tmp_path, small_task, caplog):
    with caplog.at_level(logging.WARNING, logger="opsd_rollout.train.inputs"):
        result = train(config(tmp_path, steps=2, teacher="self", task_labelled=6, warmup_sft_steps=1,
                              eval_every=100))
    assert any("194 prompts without one are left out" in r.getMessage() for r in caplog.records)
    assert [r["teacher"] for r in result.records if "loss" in r] == [None, "self (initial)"]


@pytest.mark.parametrize("argv,message", [
    (["--task", "arithmetic", "--task-labelled", "201"], "--task-labelled 201: task 'arithmetic' has 200 training"),
    (["--task", "arithmetic", "--task-labelled", "150", "--task-unlabelled", "60"], "exceed the 200 training problems of task 'arithmetic'"),
    (["--task-labelled", "5"], "split a built-in task's problems: give --task"),
    (["--task", "arithmetic", "--warmup-sft-steps", "10", "--steps", "10"], "leaves no step of the 10"),
    (["--task", "arithmetic", "--warmup-sft-lr", "0.01"], "give --warmup-sft-steps too"),
    (["--task", "arithmetic", "--objective", "sft", "--warmup-sft-steps", "2"], "objective sft is SFT all along"),
    (["NOREFS", "--warmup-sft-steps", "2"], "trains on the examples with a 'reference', and none has one"),
])
def test_bad_warm_starts_and_splits_are_one_line_before_any_work(tmp_path, capsys, small_task, argv, message):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(12)))
    argv = [a for a in argv if a != "NOREFS"] + (["--prompts", str(data)] if "NOREFS" in argv else [])
    code = main(["train", "--student", "llama-tiny", "--teacher", "qwen2-tiny", *argv, "--output-dir",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
