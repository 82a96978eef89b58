"""``train`` with several teachers: ``--teacher NAME=PRESET_OR_DIR`` (repeatable, and ``--teacher-url NAME=URL``),
each example routed by its ``teacher`` field (the default teacher takes the rest). A two-teacher run's losses and
held-out figures per teacher equal those of one-teacher runs on the same examples; names, routes and vocabularies
are checked before any step. (tests/test_several_teachers.py tests the step.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opsd_rollout.cli import main
from opsd_rollout.train import TrainConfig, train
from opsd_rollout.train.teacher_spec import TeacherSpec, named, specs_from_flags

COMMON = dict(student="llama-tiny", max_new_tokens=6, temperature=0.0, eval_every=1, steps=1, progress=False,
              lr=1e-3)
ROUTED = ["q", "g", "q", "g", "g", "q", "q", "g"]


def prompts(path: Path, routes: list[str | None], questions: list[int] | None = None) -> Path:
    """Question ``i`` (``questions``, default 0, 1, ...) routed to ``routes[i]``."""
    questions = list(range(len(routes))) if questions is None else questions
    lines = [{"prompt": f"Question {i}: why so?", **({"teacher": name} if name else {})}
             for i, name in zip(questions, routes)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_two_teacher_run_equals_the_one_teacher_runs_on_the_same_examples(tmp_path):
    """Greedy samples (a row's tokens its prompt's alone), every example in the one micro-batch of step 1 (fewer
    than 10 examples: all of them train and are held out): each teacher's loss before any update and held-out KL
    are the one-teacher run's on its own examples."""
    both = train(TrainConfig.from_flat(dict(
        COMMON, output_dir=str(tmp_path / "both"), prompts=str(prompts(tmp_path / "both.jsonl", ROUTED)),
        teacher=["q=qwen2-tiny", "g=gpt2-tiny"], prompts_per_micro_batch=8, eval_prompts=8)))
    alone = {}
    for name, preset in (("q", "qwen2-tiny"), ("g", "gpt2-tiny")):
        mine = [i for i, route in enumerate(ROUTED) if route == name]
        data = prompts(tmp_path / f"{name}.jsonl", [None] * len(mine), mine)
        alone[name] = train(TrainConfig.from_flat(dict(
            COMMON, output_dir=str(tmp_path / name), prompts=str(data),
            teacher=preset, prompts_per_micro_batch=len(mine), eval_prompts=len(mine))))
    start, first = both.records[0], both.records[1]
    for name, run in alone.items():
        assert start[f"eval_reverse_kl/{name}"] == pytest.approx(run.records[0]["eval_reverse_kl"], rel=1e-4)
        assert first[f"loss/{name}"] == pytest.approx(run.records[1]["loss"], rel=1e-4)
    assert first["loss/q"] != pytest.approx(first["loss/g"], rel=1e-2)
    assert min(first["loss/q"], first["loss/g"]) < first["loss"] < max(first["loss/q"], first["loss/g"])
    saved = json.loads((tmp_path / "both" / "train_config.json").read_text())
    assert [(t["name"], t["source"]) for t in saved["teachers"]] == [("q", "qwen2-tiny"), ("g", "gpt2-tiny")]


def test_examples_without_a_teacher_go_to_the_default_one(tmp_path):
    """The teacher given without a name is ``default`` and takes the examples that name none; ``--default-teacher``
    picks another."""
    data = prompts(tmp_path / "p.jsonl", [None, "g", None, "g"])
    run = train(TrainConfig.from_flat(dict(COMMON, output_dir=str(tmp_path / "a"), prompts=str(data),
                                           teacher=["qwen2-tiny", "g=gpt2-tiny"],
                                           prompts_per_micro_batch=4, eval_prompts=4)))
    assert {"loss/default", "loss/g"} <= set(run.records[1])
    run = train(TrainConfig.from_flat(dict(COMMON, output_dir=str(tmp_path / "b"), prompts=str(data),
                                           teacher=["q=qwen2-tiny", "g=gpt2-tiny"], default_teacher="g",
                                           prompts_per_micro_batch=4, eval_prompts=4)))
    assert "loss/q" not in run.records[1] and "loss/g" in run.records[1]


def test_the_command_line_names_teachers_and_monitors_each(tmp_path, capsys):
    data = prompts(tmp_path / "p.jsonl", ["q", "g", "q", "g"])
    argv = ["train", "--student", "llama-tiny", "--teacher", "q=qwen2-tiny", "--teacher", "g=gpt2-tiny", "--prompts",
            str(data), "--steps", "1", "--max-new-tokens", "4", "--prompts-per-micro-batch", "4", "--eval-every", "1",
            "--output-dir", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "loss/q" in records[1] and "eval_reverse_kl/g" in records[0]
    from opsd_rollout.train.report import monitor_events

    tags = {tag for tag, _, _ in monitor_events(records[1])}
    assert {"train/loss/q", "train/loss/g", "eval/reverse_kl/q"} <= tags


def test_names_split_as_written():
    assert named("--teacher", ["llama-mini"]) == ("llama-mini", {})
    assert named("--teacher", ["a=llama-mini", "runs/x=y/model", "b=qwen2-tiny"]) == (
        "runs/x=y/model", {"a": "llama-mini", "b": "qwen2-tiny"})
    assert named("--teacher-url", ["http://h:1/?a=b", "m=http://h:2"]) == ("http://h:1/?a=b", {"m": "http://h:2"})
    assert specs_from_flags({"teacher": ["a=x", "y"], "teacher_url": ["s=http://h"], "teacher_timeout": 5}) == (
        TeacherSpec(source="y"), TeacherSpec(name="a", source="x"),
        TeacherSpec(name="s", source="http://h", timeout=5))
    assert specs_from_flags({"teacher": "m", "teacher_url": "http://h"}) == (TeacherSpec(source="http://h", model="m"),)
    with pytest.raises(ValueError, match="--teacher given 2 times without a name"):
        named("--teacher", ["llama-mini", "qwen2-tiny"])
    with pytest.raises(ValueError, match="--teacher a= given twice"):
        named("--teacher", ["a=llama-mini", "a=qwen2-tiny"])


@pytest.mark.parametrize("argv,routes,message", [
    (["--teacher", "q=qwen2-tiny", "--teacher", "g=gpt2-tiny"], ["q", "x"],
     "line 2 names teacher 'x', which is none of the run's teachers ['g', 'q']"),
    (["--teacher", "qwen2-tiny"], ["q", None], "line 1 names teacher 'q', and the run has one teacher"),
    (["--teacher", "q=qwen2-tiny", "--teacher", "w=qwen2-0.5b"], ["q", "w"],
     "teacher 'w=qwen2-0.5b' one of 151,936: distillation needs the same vocabulary"),
    (["--teacher", "q=qwen2-tiny", "--teacher-url", "q=http://127.0.0.1:9"], ["q", "q"],
     "teacher name ['q'] given both as a model (--teacher) and as a server"),
    (["--teacher", "q=qwen2-tiny", "--default-teacher", "z"], ["q", None], "default_teacher 'z' is none of the"),
    (["--teacher", "q=qwen2-tiny", "--teacher-zero-stage", "3"], ["q", "q"], "with several teachers each is whole"),
])
def test_bad_teachers_are_one_line_before_any_step(tmp_path, capsys, argv, routes, message):
    data = prompts(tmp_path / "p.jsonl", routes)
    code = main(["train", "--student", "llama-tiny", *argv, "--prompts", str(data), "--output-dir",
                 str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "opsd-rollout: error:" in err and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_teacher_specs_round_trip_through_the_saved_config_without_their_key():
    """``train_config.json`` keeps every teacher's spec but its key; reading it back gives the same teachers."""
    spec = TeacherSpec(name="m", source="http://127.0.0.1:9", model="qwen2-tiny", api_key="s3cret", timeout=5.0)
    config = TrainConfig(output_dir="o", teachers=[spec, "qwen2-tiny"])
    saved = config.to_dict()
    assert "s3cret" not in json.dumps(saved)
    assert TrainConfig.from_dict(saved).teachers == (TeacherSpec(name="m", source="http://127.0.0.1:9",
                                                                 model="qwen2-tiny", timeout=5.0),
                                                     TeacherSpec(source="qwen2-tiny"))


@pytest.mark.parametrize("values,message", [
    (dict(teacher="qwen2-tiny", teacher_timeout=3), "--teacher-timeout: an option of a served teacher"),
    (dict(teacher_url="http://h:1", teacher_zero_stage=3), "--teacher-zero-stage: an option of an in-process"),
    (dict(teacher=["default=qwen2-tiny"]), "teacher name 'default' is the teacher given without a name"),
])
def test_an_option_for_a_kind_of_teacher_the_run_lacks_is_refused(values, message):
    with pytest.raises(ValueError, match=message):
        specs_from_flags(values)
