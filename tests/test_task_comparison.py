"""scripts/task_comparison.py's report: accuracy at equal steps and at equal wall time, the step at which half the
teacher's accuracy is reached, supervised KD's generation counted in its wall time (made-up runs, nothing trained);
the document it writes, and the one committed, are what its schema (scripts/task_comparison.schema.json) says."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "scripts" / "task_comparison.schema.json").read_text())


def _script():
    """The script, imported as a module (pytest's pythonpath has scripts/)."""
    import task_comparison

    return task_comparison


def _run(path: Path, points: list[tuple[int, float, float]], teacher: float | None = None) -> None:
    path.mkdir(parents=True)
    records = []
    for step, accuracy, seconds in points:
        record = {"step": step, "eval_accuracy": accuracy, "eval_unextractable": 0}
        if step:
            record["time/steps_s"] = seconds
        elif teacher is not None:
            record["teacher_eval_accuracy"] = teacher
        records.append(record)
        records.append({"step": step + 1, "loss": 1.0})  # a step without an evaluation is not a point
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    (path / "train_config.json").write_text("{}")


def test_the_report_reads_equal_steps_equal_time_and_half_the_teacher(tmp_path):
    tc = _script()
    runs = tmp_path / "runs"
    _run(runs / "forward_kl", [(0, 0.0, 0), (200, 0.1, 100.0), (400, 0.6, 200.0)], teacher=0.9)
    _run(runs / "supervised_kd", [(0, 0.0, 0), (200, 0.5, 20.0), (400, 0.7, 40.0)])
    (runs / "teacher_samples.json").write_text(json.dumps({"seconds": 150.0}))
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"prompt": "1+1\\n", "answer": "2"}\n' * 3)
    result = tc.report(runs, ["forward_kl", "supervised_kd"], {}, tc.student_settings(400), 1, 2,
                       tmp_path / "teacher", eval_file)
    assert result["teacher_eval_accuracy"] == 0.9 and result["eval_problems"] == 3
    kd, fkl = result["arms"]["supervised_kd"], result["arms"]["forward_kl"]
    assert [p["wall_seconds"] for p in kd["points"]] == [150.0, 170.0, 190.0]  # the generation counted
    assert result["equal_steps"] == 400 and result["equal_wall_seconds"] == 190.0
    assert fkl["summary"]["accuracy_at_equal_time"] == 0.1 and fkl["summary"]["step_at_equal_time"] == 200
    assert kd["summary"]["accuracy_at_equal_time"] == 0.7
    assert fkl["summary"]["half_teacher_step"] == 400 and kd["summary"]["half_teacher_step"] == 200
    assert kd["summary"]["half_teacher_wall_seconds"] == 170.0
    assert fkl["summary"]["accuracy_at_each_arms_end"] == {"forward_kl": 0.6, "supervised_kd": 0.1}
    jsonschema.validate(result, SCHEMA)
    assert result["kind"] == "task_comparison" and result["version"] == 1
    tc.plot(result, tmp_path / "out" / "comparison.png")
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 0


def test_supervised_kds_samples_train_the_teachers_tokens_and_its_eos_where_it_ended(tmp_path):
    """A teacher's sample that ended trains its tokens and that EOS, once; one cut at max_new_tokens its tokens
    alone (a continuation): exactly the tokens the teacher sampled, whichever way it stopped."""
    import torch

    from opsd_rollout.models import EOS_ID, byte_tokenizer
    from opsd_rollout.opsd.targets import response_targets
    from opsd_rollout.train import read_examples
    from opsd_rollout.train.data import Encoder

    tc, tokenizer = _script(), byte_tokenizer()
    samples = ["7+8=15, 5\n#### 15</s>", "7+8=15, 5\n#### 1"]  # as teacher_responses returns them: ended, cut
    path = tmp_path / "teacher_samples.jsonl"
    path.write_text("".join(json.dumps(tc.sample_record("7+8?\n", s, tokenizer.eos_token)) + "\n" for s in samples))
    batch = Encoder(tokenizer, max_prompt_tokens=64, max_reference_tokens=80).with_references(
        read_examples(path, tokenizer), torch.device("cpu"))
    targets = response_targets(batch)
    trained = [labels[mask].tolist() for labels, mask in zip(targets.labels, targets.mask)]
    assert trained == [tokenizer(s, add_special_tokens=False)["input_ids"] for s in samples]
    assert [row.count(EOS_ID) for row in trained] == [1, 0]


def test_the_committed_comparison_is_a_document_of_its_schema():
    document = json.loads((ROOT / "benchmarks" / "task" / "comparison.json").read_text())
    jsonschema.validate(document, SCHEMA)
    assert set(document["arms"]) <= set(_script().ARMS)


def test_an_arm_says_where_its_teacher_comes_from():
    """What run_arm and the report read of an arm (issue 49 adds arms): the teacher, its samples, its flags."""
    arms = _script().ARMS
    assert not arms["sft"].teacher and arms["supervised_kd"].teacher_samples
    assert [name for name, arm in arms.items() if arm.teacher_samples] == ["supervised_kd"]
    assert all("--loss" in arm.flags or "--objective" in arm.flags for arm in arms.values())
