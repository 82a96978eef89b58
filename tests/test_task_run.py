"""``opsd-rollout train --task arithmetic``: the flag's wiring (the task's built-in run, its teacher cached apart
from the corpus's and named by the task's recipe, both runs scored on the task's held-out problems by the gsm8k
scorer), bad input, a student that trains on its own samples and never on a reference, and (slow tier) a cut-down
run end to end. The training itself is stood in for where the wiring is the point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opsd_rollout.cli import main
from opsd_rollout.train import TrainConfig, TrainResult, default, train
from opsd_rollout.train.tasks import TASKS, response_tokens
from opsd_rollout.train.tasks.arithmetic import ArithmeticTask

SMALL = ArithmeticTask(train_size=200, held_out_size=12)


@pytest.fixture
def small_task(monkeypatch):
    monkeypatch.setitem(TASKS, "arithmetic", SMALL)
    return SMALL


def fake_train(calls: list):
    """A ``train`` that writes the model a run leaves and records its config."""

    def train(config):
        calls.append(config)
        model = Path(config.output_dir) / "model"
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text("{}")
        return TrainResult(Path(config.output_dir), config.steps, model_dir=model)

    return train


def test_task_arithmetic_alone_is_its_built_in_run(tmp_path, monkeypatch, small_task):
    calls: list = []
    monkeypatch.setattr(default, "train", fake_train(calls))
    assert main(["train", "--task", "arithmetic", "--output-dir", str(tmp_path / "run"), "--cache-dir",
                 str(tmp_path / "cache"), "--quiet"]) == 0
    teacher, student = calls
    directory = default.teacher_dir(str(tmp_path / "cache"), default.ARITHMETIC_TEACHER)
    assert directory != default.teacher_dir(str(tmp_path / "cache"))  # not the corpus's teacher
    assert teacher.output_dir == str(directory) + ".partial" and teacher.objective == "sft"
    assert teacher.task == "arithmetic" and teacher.student == default.ARITHMETIC_TEACHER.student
    assert student.task == "arithmetic" and student.objective == "opsd"
    assert [spec.source for spec in student.teachers] == [str(directory / "model")]
    assert student.lmbda == 1.0 and student.student == default.ARITHMETIC_STUDENT["student"]  # its own samples only
    for config in (teacher, student):
        assert config.task_eval.scorer == "gsm8k" and config.task_eval.data == student.task_eval.data
    records = [json.loads(line) for line in Path(student.task_eval.data).read_text().splitlines()]
    assert records == [p.record() for p in small_task.problems()[1]]  # the held-out problems, answers and all


def test_the_task_teachers_name_follows_the_tasks_recipe(tmp_path, monkeypatch):
    names = set()
    for task in (SMALL, ArithmeticTask(seed=1, train_size=200, held_out_size=12),
                 ArithmeticTask(train_size=201, held_out_size=12)):
        monkeypatch.setitem(TASKS, "arithmetic", task)
        names.add(default.teacher_dir(str(tmp_path), default.ARITHMETIC_TEACHER).name)
    assert len(names) == 3


def test_task_with_models_of_ones_own_is_scored_on_the_task_too(tmp_path, monkeypatch, small_task):
    import opsd_rollout.train as package

    calls: list = []
    monkeypatch.setattr(package, "train", fake_train(calls))
    assert main(["train", "--task", "arithmetic", "--objective", "sft", "--steps", "3", "--output-dir",
                 str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--quiet"]) == 0
    (config,) = calls
    assert config.objective == "sft" and config.task == "arithmetic" and config.student == "llama-tiny"
    assert config.task_eval.scorer == "gsm8k" and Path(config.task_eval.data).parent == tmp_path / "cache" / "tasks"
    longest = max(len(p.reference) for split in small_task.problems() for p in split)
    assert config.sampling.max_new_tokens == response_tokens("arithmetic") == longest + 1  # and the EOS


def test_responses_too_short_for_the_worked_solutions_are_refused(small_task):
    needed = response_tokens("arithmetic")
    with pytest.raises(ValueError, match=f"max_new_tokens {needed - 1} cuts task 'arithmetic'.s worked solutions, "
                                         f"up to {needed} tokens with the EOS: give at least {needed}"):
        TrainConfig.from_flat(dict(output_dir="o", teacher="llama-tiny", task="arithmetic", max_new_tokens=needed - 1))
    TrainConfig.from_flat(dict(output_dir="o", teacher="llama-tiny", task="arithmetic", max_new_tokens=needed))


def test_an_unknown_task_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--task", "unknown", "--output-dir", str(tmp_path / "run")])
    assert exited.value.code == 2
    assert "argument --task: invalid choice: 'unknown' (choose from 'arithmetic', 'arithmetic-5d')" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"task must be one of \['arithmetic', 'arithmetic-5d'\]; got 'unknown'"):
        default.default_run(str(tmp_path / "run"), cache_dir=str(tmp_path), overrides={"task": "unknown"})
    with pytest.raises(ValueError, match=r"task must be one of \['arithmetic', 'arithmetic-5d'\]; got 'unknown'"):
        TrainConfig(output_dir="o", teachers=["llama-tiny"], task="unknown")
    with pytest.raises(ValueError, match="task 'arithmetic' brings its own examples; prompts 'p.jsonl'"):
        TrainConfig(output_dir="o", teachers=["llama-tiny"], task="arithmetic", prompts="p.jsonl")
    assert not (tmp_path / "run").exists()


def test_the_student_trains_on_its_own_samples_never_on_a_reference(tmp_path, monkeypatch, small_task):
    """Every step on-policy, and no training example's reference ever encoded (the held-out ones are, for the
    evaluation's cross-entropy)."""
    from opsd_rollout.train.data import Encoder

    encoded = []
    real = Encoder.with_references
    monkeypatch.setattr(Encoder, "with_references", lambda self, examples, *a, **k: (
        encoded.extend(examples), real(self, examples, *a, **k))[1])
    result = train(TrainConfig.from_flat(dict(
        output_dir=str(tmp_path / "run"), task="arithmetic", student="llama-tiny", teacher="qwen2-tiny", steps=3,
        prompts_per_micro_batch=2, max_new_tokens=response_tokens("arithmetic"), eval_every=2, eval_prompts=2,
        progress=False)))
    assert [r["on_policy"] for r in result.records if "loss" in r] == [True] * 3
    training = {p.prompt for p in small_task.problems()[0]}
    assert encoded and not any(e.prompt in training for e in encoded)


@pytest.mark.slow
def test_a_cut_down_task_run_end_to_end(tmp_path, monkeypatch, capsys, small_task):
    """The built-in task run at a few steps, for real: the teacher trained by SFT on the worked solutions into the
    cache and scored on the task as it trains, the student distilled with the teacher's figure at step 0 and its
    own at each evaluation; a second run reuses the teacher."""
    teacher = TrainConfig.from_flat(dict(output_dir="", objective="sft", task="arithmetic", student="llama-tiny",
                                         steps=4, prompts_per_micro_batch=4, eval_every=2, eval_prompts=4,
                                         max_new_tokens=80, save_every=2))
    student = dict(default.ARITHMETIC_STUDENT, steps=4, prompts_per_micro_batch=4, eval_every=2, eval_prompts=4)
    monkeypatch.setitem(default.RUNS, "arithmetic", (teacher, student))
    argv = ["train", "--task", "arithmetic", "--output-dir", str(tmp_path / "run"), "--cache-dir",
            str(tmp_path / "cache"), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "teacher: training llama-tiny on the arithmetic task (4 SFT steps)" in printed
    assert "task accuracy: " in printed and "(teacher " in printed
    taught = [json.loads(line) for line in (default.teacher_dir(str(tmp_path / "cache"), teacher) / "metrics.jsonl")
              .read_text().splitlines()]
    assert [r["step"] for r in taught if "eval_accuracy" in r] == [0, 2, 4]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= records[0]["teacher_eval_accuracy"] <= 1
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2, 4]
    assert [r["on_policy"] for r in records if "loss" in r] == [True] * 4
    assert main(argv[:4] + [str(tmp_path / "again"), *argv[5:]]) == 0
    assert "teacher: reusing" in capsys.readouterr().out


def test_the_flags_choices_are_the_built_in_tasks():
    from opsd_rollout.cli.train import FLAGS

    (choices,) = [kwargs["choices"] for flag, _dest, kwargs in FLAGS if flag == "--task"]
    assert tuple(choices) == tuple(TASKS) == tuple(name for name in default.RUNS if name is not None)


def test_the_harder_settings_student_is_the_recipe_measured():
    """``--task arithmetic-5d``'s built-in student: a warm start on 300 labelled problems, then on-policy reverse KL
    over the teacher's top 64 (docs/TRAINING.md, "When does on-policy distillation pay off")."""
    from opsd_rollout.train import TrainConfig

    config = TrainConfig.from_flat({**default.ARITHMETIC_5D_STUDENT, "output_dir": "o", "teacher": "llama-micro"})
    assert config.task == "arithmetic-5d" and config.task_labelled == 300
    assert config.warmup_sft_steps == 600 < config.steps == 800 and config.warmup_sft_lr == 3e-3
    assert config.divergence.loss == "reverse_kl" and config.teacher_cache.mode == "topk" and config.lmbda == 1.0
